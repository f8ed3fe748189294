#pragma once

// A client of the coordinator's Jobs and Fleet services for programs and
// muonmeshctl: submit jobs, read them, watch them, cancel them, read their
// step records and the fleet. Link `muonmesh_client`.
//
// Thread-safe: one client may be shared; each call is independent and has
// its own deadline (options.timeout; Watch runs until the job ends).

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "muonmesh/v1/fleet.grpc.pb.h"
#include "muonmesh/v1/jobs.grpc.pb.h"
#include "proto/credentials/credentials.h"

namespace muonmesh::client {

struct CoordinatorClientOptions {
  absl::Duration timeout = absl::Seconds(30);
  // TLS, client certificate and token (credentials::LoadChannelSecurity); default:
  // plaintext.
  credentials::ChannelSecurity security;
  // The most pages one List or Metrics call reads before it gives up on the
  // coordinator (DataLoss; a page token seen twice is one too).
  int max_pages = 100000;
};

class CoordinatorClient {
 public:
  // Does not connect yet; an unreachable address is the first call's error
  // (UNAVAILABLE, naming the address).
  explicit CoordinatorClient(std::string address, CoordinatorClientOptions options = {});

  const std::string& address() const { return address_; }

  // INVALID_ARGUMENT with every violation ("spec.field: reason", one per
  // line) for a job the coordinator refuses.
  absl::StatusOr<v1::SubmitJobResponse> Submit(const v1::JobSpec& spec,
                                               const std::string& request_id);
  absl::StatusOr<v1::Job> Get(const std::string& job_id);
  // Every job matching the filter (all pages).
  absl::StatusOr<std::vector<v1::Job>> List(const std::vector<v1::JobState>& states,
                                            const std::string& name);
  // `checkpoint`: the ranks checkpoint their current step before they stop.
  absl::StatusOr<v1::Job> Cancel(const std::string& job_id, const std::string& reason,
                                 bool checkpoint = false);
  // Jobs.DeleteJob: a finished job and its records.
  absl::Status Delete(const std::string& job_id);
  // Jobs.PruneJobs (admin): the ids of the jobs that finished before `t`.
  absl::StatusOr<std::vector<std::string>> Prune(absl::Time t);
  // Fleet.DrainWorker (admin): the worker as it is now (DRAINING).
  absl::StatusOr<v1::Worker> Drain(const std::string& worker_id, const std::string& reason);
  // Fleet.RemoveWorker (admin): forgets a LOST worker.
  absl::Status RemoveWorker(const std::string& worker_id);
  // Every step record in [first, last] (last < 0: to the end), all pages.
  absl::StatusOr<std::vector<v1::StepRecord>> Metrics(const std::string& job_id, int64_t first,
                                                      int64_t last, bool all_ranks);
  absl::StatusOr<std::vector<v1::Worker>> Workers();

  // Calls `on_event` for every event from `from_index` on, live, until the
  // job ends (OK), `on_event` returns false (OK), `deadline` passes
  // (DeadlineExceeded) or the stream breaks; a broken stream is resumed
  // from the last event seen, without gaps or duplicates.
  absl::Status Watch(const std::string& job_id, int64_t from_index, absl::Duration deadline,
                     const std::function<bool(const v1::JobEvent&)>& on_event);

 private:
  absl::Status Error(const grpc::Status& s, const std::string& what) const;

  std::string address_;
  CoordinatorClientOptions options_;
  std::unique_ptr<v1::Jobs::Stub> jobs_;
  std::unique_ptr<v1::Fleet::Stub> fleet_;
};

// A job file made ready to submit: relative paths joined to the file's
// folder and made absolute (the coordinator and workers cannot resolve them
// against the client's folder), output.dir defaulting to
// <file's folder>/runs/<name>, and a synthetic model's spec file read into
// model.synthetic.model. Errors as protoio::LoadMessageFile, naming the
// file.
absl::StatusOr<v1::JobSpec> LoadJobForSubmit(const std::string& path);

// The job that continues `earlier` (a submitted job's spec) from the newest
// complete checkpoint in its output folder: the same job with
// init: {checkpoint: <its output.dir>} (any other init dropped), at
// `world_size` ranks when > 0 (a checkpoint loads under any layout). It
// writes into the same folder, continuing its series and appending to its
// metrics, so the earlier job must have ended (the coordinator refuses two
// unfinished jobs in one folder). InvalidArgument when the earlier job has
// no output folder.
absl::StatusOr<v1::JobSpec> ResumeSpecOf(const v1::JobSpec& earlier, int64_t world_size);

}  // namespace muonmesh::client

#pragma once

// The coordinator's durable state: jobs, their event logs and their per-step
// records, in one SQLite database, with the jobs also kept in memory for
// fast reads.
//
// Durability: every mutating call commits (WAL journal, synchronous=FULL)
// before it returns, so a caller may acknowledge a submit once Submit
// returns OK and a restart loses nothing acknowledged. A failed write
// changes nothing, in the database or in memory.
//
// Thread-safe: one mutex serialises every call; reads of jobs are served
// from memory under the same mutex. Owned by the coordinator's JobManager.

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "muonmesh/v1/jobs.pb.h"

struct sqlite3;

namespace muonmesh::coordinator {

// Longest client request id accepted.
inline constexpr size_t kMaxRequestIdBytes = 128;

class JobStore {
 public:
  // Opens (creating when needed) the database at `path`, or in memory for
  // ":memory:". InvalidArgument naming the path if it cannot be opened or
  // is not this store's database (a newer schema included).
  static absl::StatusOr<std::unique_ptr<JobStore>> Open(const std::string& path);
  ~JobStore();
  JobStore(const JobStore&) = delete;
  JobStore& operator=(const JobStore&) = delete;

  // Bounds on the jobs not in a final state, which Submit enforces (0: no
  // bound). A client is what Submit is told (Job.submitted_by: the caller's
  // address); jobs submitted with none count only towards `unfinished`.
  struct Limits {
    int64_t unfinished = 0;
    int64_t unfinished_per_client = 0;
  };
  void SetLimits(Limits limits);

  struct Submitted {
    v1::Job job;
    bool created = false;
  };
  // A new PENDING job ("j-<n>") with its first event, or, when request_id
  // is not empty and was used before, that request's job (created false).
  // AlreadyExists when the request id was used with another spec;
  // InvalidArgument for a request id over kMaxRequestIdBytes;
  // ResourceExhausted, naming the bound, when a new job would pass one of
  // the Limits (a request id seen before is answered whatever the bounds);
  // FailedPrecondition naming the other job when an unfinished job's output
  // folder is the new one's, holds it or lies in it, or the two name one
  // export file (checked with the insert, under one lock: two submits at
  // once cannot both pass).
  absl::StatusOr<Submitted> Submit(const std::string& request_id, const v1::JobSpec& spec,
                                   const std::string& reason, int64_t now_ms,
                                   const std::string& client = "");

  // Jobs not in a final state: in all, and of `client`.
  int64_t UnfinishedCount() const;
  int64_t UnfinishedCountOf(const std::string& client) const;

  // NotFound for an unknown id.
  absl::StatusOr<v1::Job> Get(const std::string& job_id) const;

  struct Page {
    std::vector<v1::Job> jobs;
    std::string next_page_token;
  };
  // Newest first. InvalidArgument for a page token this store did not make.
  absl::StatusOr<Page> List(const std::vector<v1::JobState>& states, const std::string& name,
                            int32_t page_size, const std::string& page_token) const;

  // Jobs not in a final state, oldest first (scheduling order).
  std::vector<v1::Job> Unfinished() const;
  // The same, only what the scheduler looks at in each pass (no spec: a
  // spec may carry a whole model inline, and a pass visits every job).
  struct Summary {
    std::string id;
    v1::JobState state = v1::JOB_STATE_UNSPECIFIED;
    int32_t attempt = 0;
    std::string device;  // spec.device ("" is cpu)
    int64_t world_size = 0;
    bool elastic = false;
  };
  std::vector<Summary> UnfinishedSummaries() const;

  // OK when Submit would not refuse a new job of `client` for a bound, or
  // `request_id` names a job already (a cheap check before validation).
  absl::Status Admits(const std::string& request_id, const std::string& client) const;

  // How many jobs are in each state (states with none are absent).
  std::vector<std::pair<v1::JobState, int64_t>> CountByState() const;

  // Applies `update` to the job and appends `event` (its index and time set
  // here) in one transaction; returns the event as stored. NotFound for an
  // unknown id. `update` must not change the id.
  absl::StatusOr<v1::JobEvent> Append(const std::string& job_id, v1::JobEvent event,
                                      int64_t now_ms,
                                      const std::function<void(v1::Job&)>& update);

  // Applies `update` to the job, with no event (bookkeeping a restarted
  // coordinator needs). NotFound for an unknown id.
  absl::Status Update(const std::string& job_id, const std::function<void(v1::Job&)>& update);

  // The index of the job's newest event, from memory (NotFound for an
  // unknown id): a watcher reads the database only when there is news.
  absl::StatusOr<int64_t> LastEventIndex(const std::string& job_id) const;

  // Events with index >= from_index, at most `limit`, in order.
  absl::StatusOr<std::vector<v1::JobEvent>> Events(const std::string& job_id, int64_t from_index,
                                                   int32_t limit) const;

  // Stores one rank's record of one step (a later attempt's record of the
  // same step and rank replaces it).
  absl::Status PutStep(const std::string& job_id, const v1::StepRecord& record);

  struct StepPage {
    std::vector<v1::StepRecord> records;
    std::string next_page_token;
  };
  // Records with step in [first_step, last_step] (last_step < 0: no upper
  // bound), of rank `rank` or of every rank (rank < 0), by step then rank.
  absl::StatusOr<StepPage> Steps(const std::string& job_id, int64_t first_step,
                                 int64_t last_step, int32_t rank, int32_t page_size,
                                 const std::string& page_token) const;

  // Removes the job, its events and step records, in one transaction; its
  // request id is free again. NotFound for an unknown job. The caller
  // decides whether it may go (JobManager: finished jobs only).
  absl::Status Delete(const std::string& job_id);
  // Ids of the jobs in a final state that finished before `unix_ms`,
  // oldest first.
  std::vector<std::string> FinishedBefore(int64_t unix_ms) const;

  // Whether the database answers a read (for /readyz): Internal naming
  // SQLite's error otherwise.
  absl::Status Ping() const;

  // Tests: every write from now on fails as on a read-only disk (SQLite's
  // query_only), or works again.
  absl::Status SetReadOnlyForTest(bool read_only);

 private:
  struct Row {
    int64_t seq = 0;
    v1::Job job;
  };
  explicit JobStore(sqlite3* db);
  absl::Status Load() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Rows of the first schema (the spec inside the job's blob): moved to the
  // second (the spec in its own table), in one transaction.
  absl::Status MoveSpecsApart(const std::vector<int64_t>& seqs) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Writes a job's row: everything but its spec (stored once at submit, so
  // a step's update does not rewrite it).
  absl::Status WriteJob(int64_t seq, v1::Job& job) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::StatusOr<const Row*> Find(const std::string& job_id) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status Exec(const char* sql) const;
  absl::Status AdmitsLocked(const std::string& client) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Adds `delta` to the unfinished counts when `job` is not final.
  void CountUnfinished(const v1::Job& job, int64_t delta) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  mutable absl::Mutex mu_;
  sqlite3* db_;
  int64_t next_seq_ ABSL_GUARDED_BY(mu_) = 1;
  // seq -> job, in seq order; id and request id -> seq.
  std::map<int64_t, Row> rows_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, int64_t> by_id_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, int64_t> by_request_ ABSL_GUARDED_BY(mu_);
  Limits limits_ ABSL_GUARDED_BY(mu_);
  int64_t unfinished_ ABSL_GUARDED_BY(mu_) = 0;
  // Clients with unfinished jobs only (an entry at 0 is removed).
  absl::flat_hash_map<std::string, int64_t> unfinished_by_client_ ABSL_GUARDED_BY(mu_);
};

// Whether `state` is one a job never leaves (SUCCEEDED, FAILED, CANCELLED).
bool IsFinal(v1::JobState state);

}  // namespace muonmesh::coordinator

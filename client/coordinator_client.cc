#include "client/coordinator_client.h"

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <thread>
#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "core/base/status_macros.h"
#include "grpcpp/client_context.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "proto/io/message_file.h"
#include "proto/job/model_kind.h"
#include "proto/rpc/rpc_status.h"

namespace muonmesh::client {
namespace {

namespace fs = std::filesystem;

// The largest answer taken: a job carries its spec (the coordinator takes
// specs up to 64 MiB) and a page of jobs several; the coordinator sends up
// to 1 GiB. gRPC's default of 4 MiB failed GetJob on a large inline model.
constexpr int kMaxReceiveBytes = 1 << 30;

std::string Absolute(const fs::path& base, const std::string& path) {
  if (path.empty()) return path;
  const fs::path p(path);
  return (p.is_absolute() ? p : fs::absolute(base / p)).lexically_normal().string();
}

}  // namespace

CoordinatorClient::CoordinatorClient(std::string address, CoordinatorClientOptions options)
    : address_(std::move(address)), options_(options) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(kMaxReceiveBytes);
  auto channel = credentials::CreateChannel(address_, options_.security, args);
  jobs_ = v1::Jobs::NewStub(channel);
  fleet_ = v1::Fleet::NewStub(channel);
}

absl::Status CoordinatorClient::Error(const grpc::Status& s, const std::string& what) const {
  if (s.ok()) return absl::OkStatus();
  const auto code = static_cast<absl::StatusCode>(s.error_code());
  if (code == absl::StatusCode::kUnavailable) {
    return absl::UnavailableError(
        absl::StrCat("cannot reach the coordinator at ", address_, ": ", s.error_message()));
  }
  if (code == absl::StatusCode::kDeadlineExceeded) {
    return absl::DeadlineExceededError(absl::StrCat(what, ": no answer from ", address_,
                                                    " before the deadline"));
  }
  return rpc::FromGrpcStatus(s);
}

absl::StatusOr<v1::SubmitJobResponse> CoordinatorClient::Submit(const v1::JobSpec& spec,
                                                                const std::string& request_id) {
  v1::SubmitJobRequest request;
  *request.mutable_spec() = spec;
  request.set_request_id(request_id);
  v1::SubmitJobResponse response;
  grpc::ClientContext context;
  rpc::SetDeadline(context, options_.timeout);
  MUONMESH_RETURN_IF_ERROR(Error(jobs_->SubmitJob(&context, request, &response), "submit"));
  return response;
}

absl::StatusOr<v1::Job> CoordinatorClient::Get(const std::string& job_id) {
  v1::GetJobRequest request;
  request.set_job_id(job_id);
  v1::Job job;
  grpc::ClientContext context;
  rpc::SetDeadline(context, options_.timeout);
  MUONMESH_RETURN_IF_ERROR(Error(jobs_->GetJob(&context, request, &job), "status"));
  return job;
}

namespace {

// A page loop's guard: the server's page tokens must not repeat, and a
// listing ends within `max_pages` pages (by default 10^5: 10^8 jobs or
// records at the server's page size), so a broken or hostile server cannot
// keep the client paging for ever.
class PageGuard {
 public:
  PageGuard(const char* what, int max_pages) : what_(what), max_pages_(max_pages) {}
  absl::Status Next(const std::string& token) {
    if (token.empty()) return absl::OkStatus();
    if (++pages_ > max_pages_) {
      return absl::DataLossError(
          absl::StrCat(what_, ": the coordinator sent more than ", max_pages_, " pages; stopping"));
    }
    if (!seen_.insert(token).second) {
      return absl::DataLossError(absl::StrCat(what_, ": the coordinator sent page token '",
                                              token.substr(0, 64), "' twice; stopping"));
    }
    return absl::OkStatus();
  }

 private:
  const char* what_;
  const int max_pages_;
  int pages_ = 0;
  absl::flat_hash_set<std::string> seen_;
};

}  // namespace

absl::StatusOr<std::vector<v1::Job>> CoordinatorClient::List(
    const std::vector<v1::JobState>& states, const std::string& name) {
  std::vector<v1::Job> out;
  std::string token;
  PageGuard guard("list", options_.max_pages);
  do {
    v1::ListJobsRequest request;
    for (v1::JobState s : states) request.add_states(s);
    request.set_name(name);
    request.set_page_size(1000);
    request.set_page_token(token);
    v1::ListJobsResponse response;
    grpc::ClientContext context;
    rpc::SetDeadline(context, options_.timeout);
    MUONMESH_RETURN_IF_ERROR(Error(jobs_->ListJobs(&context, request, &response), "list"));
    for (v1::Job& j : *response.mutable_jobs()) out.push_back(std::move(j));
    token = response.next_page_token();
    MUONMESH_RETURN_IF_ERROR(guard.Next(token));
  } while (!token.empty());
  return out;
}

absl::Status CoordinatorClient::Delete(const std::string& job_id) {
  grpc::ClientContext context;
  rpc::SetDeadline(context, options_.timeout);
  v1::DeleteJobRequest request;
  request.set_job_id(job_id);
  v1::DeleteJobResponse response;
  return Error(jobs_->DeleteJob(&context, request, &response), "delete");
}

absl::StatusOr<std::vector<std::string>> CoordinatorClient::Prune(absl::Time t) {
  grpc::ClientContext context;
  rpc::SetDeadline(context, options_.timeout);
  v1::PruneJobsRequest request;
  request.set_finished_before_unix_ms(absl::ToUnixMillis(t));
  v1::PruneJobsResponse response;
  MUONMESH_RETURN_IF_ERROR(Error(jobs_->PruneJobs(&context, request, &response), "prune"));
  return std::vector<std::string>(response.job_ids().begin(), response.job_ids().end());
}

absl::StatusOr<v1::Job> CoordinatorClient::Cancel(const std::string& job_id,
                                                  const std::string& reason, bool checkpoint) {
  v1::CancelJobRequest request;
  request.set_job_id(job_id);
  request.set_reason(reason);
  request.set_checkpoint(checkpoint);
  v1::Job job;
  grpc::ClientContext context;
  rpc::SetDeadline(context, options_.timeout);
  MUONMESH_RETURN_IF_ERROR(Error(jobs_->CancelJob(&context, request, &job), "cancel"));
  return job;
}

absl::StatusOr<v1::Worker> CoordinatorClient::Drain(const std::string& worker_id,
                                                    const std::string& reason) {
  v1::DrainWorkerRequest request;
  request.set_worker_id(worker_id);
  request.set_reason(reason);
  v1::Worker worker;
  grpc::ClientContext context;
  rpc::SetDeadline(context, options_.timeout);
  MUONMESH_RETURN_IF_ERROR(Error(fleet_->DrainWorker(&context, request, &worker), "drain"));
  return worker;
}

absl::Status CoordinatorClient::RemoveWorker(const std::string& worker_id) {
  v1::RemoveWorkerRequest request;
  request.set_worker_id(worker_id);
  v1::RemoveWorkerResponse response;
  grpc::ClientContext context;
  rpc::SetDeadline(context, options_.timeout);
  return Error(fleet_->RemoveWorker(&context, request, &response), "workers remove");
}

absl::StatusOr<std::vector<v1::StepRecord>> CoordinatorClient::Metrics(const std::string& job_id,
                                                                       int64_t first, int64_t last,
                                                                       bool all_ranks) {
  std::vector<v1::StepRecord> out;
  std::string token;
  PageGuard guard("metrics", options_.max_pages);
  do {
    v1::GetJobMetricsRequest request;
    request.set_job_id(job_id);
    request.set_first_step(first);
    request.set_last_step(last < 0 ? 0 : last);
    request.set_all_ranks(all_ranks);
    request.set_page_token(token);
    v1::GetJobMetricsResponse response;
    grpc::ClientContext context;
    rpc::SetDeadline(context, options_.timeout);
    MUONMESH_RETURN_IF_ERROR(Error(jobs_->GetJobMetrics(&context, request, &response), "metrics"));
    for (v1::StepRecord& r : *response.mutable_records()) out.push_back(std::move(r));
    token = response.next_page_token();
    MUONMESH_RETURN_IF_ERROR(guard.Next(token));
  } while (!token.empty());
  return out;
}

absl::StatusOr<std::vector<v1::Worker>> CoordinatorClient::Workers() {
  v1::ListWorkersResponse response;
  grpc::ClientContext context;
  rpc::SetDeadline(context, options_.timeout);
  if (absl::Status s = Error(fleet_->ListWorkers(&context, {}, &response), "workers"); !s.ok()) {
    return s;
  }
  return std::vector<v1::Worker>(response.workers().begin(), response.workers().end());
}

absl::Status CoordinatorClient::Watch(const std::string& job_id, int64_t from_index,
                                      absl::Duration deadline,
                                      const std::function<bool(const v1::JobEvent&)>& on_event) {
  // An infinite deadline is a year (the clock would overflow).
  const auto end = std::chrono::system_clock::now() +
                   absl::ToChronoMilliseconds(std::min(deadline, absl::Hours(24 * 365)));
  int64_t next = std::max<int64_t>(from_index, 1);
  // A broken stream (a coordinator restart, a network blip) is resumed
  // after the last event seen, for up to kWatchOutage without one.
  constexpr auto kWatchOutage = std::chrono::seconds(60);
  auto last_heard = std::chrono::steady_clock::now();
  auto backoff = std::chrono::milliseconds(100);
  while (true) {
    v1::WatchJobRequest request;
    request.set_job_id(job_id);
    request.set_from_index(next);
    grpc::ClientContext context;
    context.set_deadline(end);
    auto reader = jobs_->WatchJob(&context, request);
    v1::JobEvent e;
    while (reader->Read(&e)) {
      last_heard = std::chrono::steady_clock::now();
      backoff = std::chrono::milliseconds(100);
      next = e.index() + 1;
      if (!on_event(e)) {
        context.TryCancel();
        reader->Finish();
        return absl::OkStatus();
      }
    }
    const grpc::Status s = reader->Finish();
    if (s.ok()) return absl::OkStatus();  // the job ended
    if (s.error_code() != grpc::StatusCode::UNAVAILABLE ||
        std::chrono::steady_clock::now() - last_heard > kWatchOutage ||
        std::chrono::system_clock::now() >= end) {
      return Error(s, "watch");
    }
    std::this_thread::sleep_for(backoff);
    backoff = std::min(backoff * 2, std::chrono::milliseconds(2000));
  }
}

absl::StatusOr<v1::JobSpec> ResumeSpecOf(const v1::JobSpec& earlier, int64_t world_size) {
  if (earlier.output().dir().empty()) {
    return absl::InvalidArgumentError(
        "output.dir: the job has no output folder, so no checkpoint to resume from");
  }
  v1::JobSpec spec = earlier;
  spec.clear_init();
  spec.mutable_init()->set_checkpoint(earlier.output().dir());
  if (world_size > 0) spec.set_world_size(world_size);
  return spec;
}

absl::StatusOr<v1::JobSpec> LoadJobForSubmit(const std::string& path) {
  v1::JobSpec spec;
  MUONMESH_RETURN_IF_ERROR(protoio::LoadMessageFile(path, &spec));
  const fs::path base = fs::absolute(fs::path(path)).parent_path();
  if (spec.init().source_case() == v1::InitConfig::kSafetensors) {
    spec.mutable_init()->set_safetensors(Absolute(base, spec.init().safetensors()));
  }
  if (spec.init().source_case() == v1::InitConfig::kCheckpoint) {
    spec.mutable_init()->set_checkpoint(Absolute(base, spec.init().checkpoint()));
  }
  if (spec.data().source_case() == v1::DataConfig::kSafetensors) {
    spec.mutable_data()->set_safetensors(Absolute(base, spec.data().safetensors()));
  }
  // A corpus's train and val files or patterns (patterns stay patterns: the
  // workers expand them on their machines).
  const auto absolute_corpus = [&](auto* corpus) {
    if (!corpus->train().empty()) corpus->set_train(Absolute(base, corpus->train()));
    if (!corpus->val().empty()) corpus->set_val(Absolute(base, corpus->val()));
  };
  if (spec.data().source_case() == v1::DataConfig::kText) {
    absolute_corpus(spec.mutable_data()->mutable_text());
  } else if (spec.data().source_case() == v1::DataConfig::kTokens) {
    absolute_corpus(spec.mutable_data()->mutable_tokens());
  }
  v1::OutputConfig* out = spec.mutable_output();
  out->set_dir(Absolute(base, out->dir().empty() ? absl::StrCat("runs/", spec.name()) : out->dir()));
  if (!out->export_().empty()) out->set_export_(Absolute(base, out->export_()));
  // A file the model section names travels inline: the coordinator plans
  // without the workers' files.
  if (const std::optional<job::ModelFile> file = job::ModelFileOf(spec.model());
      file.has_value() && !file->given_inline && !file->path.empty()) {
    const job::ModelKind* kind = job::FindModelKind(spec.model().kind_case());
    MUONMESH_RETURN_IF_ERROR(
        kind->embed_model_file(spec.mutable_model(), Absolute(base, file->path)), path, ": ",
        file->field);
  }
  return spec;
}

}  // namespace muonmesh::client

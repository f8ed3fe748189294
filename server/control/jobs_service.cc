#include "server/control/jobs_service.h"

#include <algorithm>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "proto/io/message_file.h"
#include "proto/rpc/rpc_status.h"

namespace muonmesh::coordinator {
namespace {

// How long one wait for new events lasts before the stream checks the
// client (a watch itself lasts until the job ends or the deadline passes).
constexpr absl::Duration kWatchSlice = absl::Seconds(1);

// ParseJobFile's largest text: parsing costs up to ~24 bytes a byte
// (proto/io/message_file.h), so 4 MiB bounds one call near 100 MB; job
// files are a few KiB and DeepSeek-V3's spec 130 KiB.
constexpr size_t kMaxParseTextBytes = size_t{4} << 20;

}  // namespace

std::string ClientOf(const std::string& peer) {
  const bool ip = absl::StartsWith(peer, "ipv4:") || absl::StartsWith(peer, "ipv6:");
  const size_t colon = peer.rfind(':');
  // "ipv6:[::1]:5000": the port follows the bracket.
  if (!ip || colon <= 4 || (absl::StartsWith(peer, "ipv6:[") && peer[colon - 1] != ']')) {
    return peer.substr(0, 256);
  }
  return peer.substr(0, std::min<size_t>(colon, 256));
}

bool JobsService::EnterWatch(const std::string& client) {
  absl::MutexLock lock(&mu_);
  int64_t& n = watches_[client];
  if (max_watches_per_client_ > 0 && n >= max_watches_per_client_) return false;
  ++n;
  return true;
}

void JobsService::LeaveWatch(const std::string& client) {
  absl::MutexLock lock(&mu_);
  auto it = watches_.find(client);
  if (it == watches_.end()) return;
  if (--it->second <= 0) watches_.erase(it);
}

grpc::Status JobsService::SubmitJob(grpc::ServerContext* context,
                                    const v1::SubmitJobRequest* request,
                                    v1::SubmitJobResponse* response) {
  std::vector<plan::FieldViolation> violations;
  absl::StatusOr<JobStore::Submitted> s = manager_.Submit(request->request_id(), request->spec(),
                                                          &violations, ClientOf(context->peer()));
  if (!s.ok()) {
    std::vector<rpc::FieldViolation> fields;
    std::vector<std::string> parts;
    for (const plan::FieldViolation& v : violations) {
      fields.push_back({"spec." + v.field, v.description});
      parts.push_back(absl::StrCat("spec.", v.field, ": ", v.description));
    }
    if (fields.empty()) return rpc::ToGrpcStatus(s.status());
    std::string message = absl::StrCat(s.status().message(), ": ");
    for (size_t i = 0; i < parts.size(); ++i) absl::StrAppend(&message, i ? "; " : "", parts[i]);
    return rpc::ToGrpcStatus(absl::InvalidArgumentError(message), fields);
  }
  *response->mutable_job() = s->job;
  response->set_created(s->created);
  return grpc::Status::OK;
}

grpc::Status JobsService::GetJob(grpc::ServerContext*, const v1::GetJobRequest* request,
                                 v1::Job* response) {
  absl::StatusOr<v1::Job> job = store_.Get(request->job_id());
  if (!job.ok()) return rpc::ToGrpcStatus(job.status());
  *response = *std::move(job);
  return grpc::Status::OK;
}

grpc::Status JobsService::ListJobs(grpc::ServerContext*, const v1::ListJobsRequest* request,
                                   v1::ListJobsResponse* response) {
  std::vector<v1::JobState> states;
  for (int s : request->states()) states.push_back(static_cast<v1::JobState>(s));
  absl::StatusOr<JobStore::Page> page =
      store_.List(states, request->name(), request->page_size(), request->page_token());
  if (!page.ok()) return rpc::ToGrpcStatus(page.status());
  for (v1::Job& j : page->jobs) {
    if (!request->full_spec()) j.clear_spec();
    *response->add_jobs() = std::move(j);
  }
  response->set_next_page_token(page->next_page_token);
  return grpc::Status::OK;
}

grpc::Status JobsService::WatchJob(grpc::ServerContext* context,
                                   const v1::WatchJobRequest* request,
                                   grpc::ServerWriter<v1::JobEvent>* writer) {
  const std::string client = ClientOf(context->peer());
  if (!EnterWatch(client)) {
    return grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED,
                        absl::StrCat("client ", client, " already holds ", max_watches_per_client_,
                                     " open watches, the limit per client; close one first"));
  }
  struct Leave {
    JobsService* service;
    const std::string& client;
    ~Leave() { service->LeaveWatch(client); }
  } leave{this, client};
  int64_t next = std::max<int64_t>(request->from_index(), 1);
  while (true) {
    absl::StatusOr<std::vector<v1::JobEvent>> events = manager_.WaitEvents(
        request->job_id(), next, kWatchSlice, [context] { return context->IsCancelled(); });
    if (!events.ok()) return rpc::ToGrpcStatus(events.status());
    for (const v1::JobEvent& e : *events) {
      if (!writer->Write(e)) return grpc::Status(grpc::StatusCode::CANCELLED, "client left");
      next = e.index() + 1;
      if (e.has_state_change() && IsFinal(e.state_change().state())) return grpc::Status::OK;
    }
    if (context->IsCancelled()) return grpc::Status(grpc::StatusCode::CANCELLED, "client left");
    // Watching an ended job from past its last event: nothing will come.
    if (events->empty()) {
      absl::StatusOr<v1::Job> job = store_.Get(request->job_id());
      if (job.ok() && IsFinal(job->state())) return grpc::Status::OK;
    }
  }
}

grpc::Status JobsService::CancelJob(grpc::ServerContext*, const v1::CancelJobRequest* request,
                                    v1::Job* response) {
  absl::StatusOr<v1::Job> job = manager_.Cancel(request->job_id(), request->reason().substr(0, 1024),
                                                   request->checkpoint());
  if (!job.ok()) return rpc::ToGrpcStatus(job.status());
  *response = *std::move(job);
  return grpc::Status::OK;
}

grpc::Status JobsService::DeleteJob(grpc::ServerContext*, const v1::DeleteJobRequest* request,
                                    v1::DeleteJobResponse*) {
  return rpc::ToGrpcStatus(manager_.Delete(request->job_id()));
}

grpc::Status JobsService::PruneJobs(grpc::ServerContext*, const v1::PruneJobsRequest* request,
                                    v1::PruneJobsResponse* response) {
  if (request->finished_before_unix_ms() <= 0) {
    return rpc::ToGrpcStatus(absl::InvalidArgumentError(
        "finished_before_unix_ms: required (milliseconds since the Unix epoch)"));
  }
  absl::StatusOr<std::vector<std::string>> ids = manager_.Prune(request->finished_before_unix_ms());
  if (!ids.ok()) return rpc::ToGrpcStatus(ids.status());
  for (std::string& id : *ids) response->add_job_ids(std::move(id));
  return grpc::Status::OK;
}

grpc::Status JobsService::ParseJobFile(grpc::ServerContext*,
                                       const v1::ParseJobFileRequest* request,
                                       v1::ParseJobFileResponse* response) {
  const std::string source = request->source_name().empty() ? "job" : request->source_name();
  if (request->text().size() > kMaxParseTextBytes) {
    return rpc::ToGrpcStatus(absl::InvalidArgumentError(absl::StrCat(
        source, ": ", request->text().size(), " bytes: this coordinator parses files of up to ",
        kMaxParseTextBytes, " bytes (job files and model specs are far smaller)")));
  }
  google::protobuf::Message* out = request->model_spec()
                                       ? static_cast<google::protobuf::Message*>(
                                             response->mutable_model_spec())
                                       : response->mutable_job();
  return rpc::ToGrpcStatus(protoio::ParseMessageText(request->text(), source, out));
}

grpc::Status JobsService::GetJobMetrics(grpc::ServerContext*,
                                        const v1::GetJobMetricsRequest* request,
                                        v1::GetJobMetricsResponse* response) {
  const int64_t last = request->last_step() == 0 ? -1 : request->last_step();
  const int32_t rank = request->all_ranks() ? -1 : request->rank();
  absl::StatusOr<JobStore::StepPage> page =
      store_.Steps(request->job_id(), request->first_step(), last, rank, request->page_size(),
                   request->page_token());
  if (!page.ok()) return rpc::ToGrpcStatus(page.status());
  for (v1::StepRecord& r : page->records) *response->add_records() = std::move(r);
  response->set_next_page_token(page->next_page_token);
  return grpc::Status::OK;
}

}  // namespace muonmesh::coordinator

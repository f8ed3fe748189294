#include "worker/comm/grpc_store.h"

#include <algorithm>
#include <chrono>

#include "absl/strings/str_cat.h"
#include "core/base/status_macros.h"
#include "grpcpp/client_context.h"
#include "proto/rpc/rpc_status.h"

namespace muonmesh::comm {
namespace {

absl::Status FromGrpc(const grpc::Status& s, absl::string_view what) {
  return rpc::FromGrpcStatus(s, absl::StrCat("coordinator store, ", what));
}

}  // namespace

GrpcStore::GrpcStore(std::shared_ptr<grpc::Channel> channel, std::string job_id, int attempt,
                     absl::Duration outage)
    : stub_(v1::Store::NewStub(std::move(channel))), outage_(outage) {
  scope_.set_job_id(std::move(job_id));
  scope_.set_attempt(attempt);
}

void GrpcStore::Abort(const std::string& reason) {
  absl::MutexLock lock(&mu_);
  if (aborted_.has_value()) return;
  aborted_ = reason;
  for (grpc::ClientContext* c : in_flight_) c->TryCancel();
}

bool GrpcStore::Enter(grpc::ClientContext* context) {
  absl::MutexLock lock(&mu_);
  if (aborted_.has_value()) return false;
  in_flight_.push_back(context);
  return true;
}

void GrpcStore::Leave(grpc::ClientContext* context) {
  absl::MutexLock lock(&mu_);
  in_flight_.erase(std::remove(in_flight_.begin(), in_flight_.end(), context), in_flight_.end());
}

bool GrpcStore::IsAborted() {
  absl::MutexLock lock(&mu_);
  return aborted_.has_value();
}

absl::Status GrpcStore::Aborted(absl::string_view what) {
  absl::MutexLock lock(&mu_);
  return absl::CancelledError(
      absl::StrCat("coordinator store, ", what, ": aborted: ", aborted_.value_or("")));
}

grpc::Status GrpcStore::SetOnce(const v1::StoreSetRequest& request, absl::Time deadline) {
  v1::StoreSetResponse response;
  grpc::ClientContext context;
  context.set_wait_for_ready(true);
  context.set_deadline(absl::ToChronoTime(std::min(deadline, absl::Now() + kRpcSlack)));
  if (!Enter(&context)) return grpc::Status(grpc::StatusCode::CANCELLED, "aborted");
  grpc::Status s = stub_->Set(&context, request, &response);
  Leave(&context);
  return s;
}

absl::Status GrpcStore::Call(absl::Time deadline, const char* what,
                             const std::function<grpc::Status(grpc::ClientContext&)>& call) {
  absl::Duration backoff = absl::Milliseconds(100);
  bool lost = false;  // the coordinator was away: set our keys again first
  while (true) {
    grpc::Status s;
    if (lost) {
      std::vector<v1::StoreSetRequest> written;
      {
        absl::MutexLock lock(&mu_);
        written = written_;
      }
      for (const v1::StoreSetRequest& w : written) {
        s = SetOnce(w, deadline);
        if (!s.ok()) break;
      }
    }
    if (s.ok()) {
      grpc::ClientContext context;
      context.set_wait_for_ready(lost);
      context.set_deadline(absl::ToChronoTime(deadline));
      if (!Enter(&context)) return Aborted(what);
      s = call(context);
      Leave(&context);
      if (!s.ok() && IsAborted()) return Aborted(what);
      if (s.ok() || s.error_code() != grpc::StatusCode::UNAVAILABLE) {
        return FromGrpc(s, what);
      }
    }
    if (IsAborted()) return Aborted(what);
    if (lost && s.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED) {
      return absl::UnavailableError(
          absl::StrCat("coordinator store, ", what,
                       ": the coordinator did not answer again before the "
                       "deadline (",
                       s.error_message(), ")"));
    }
    if (s.error_code() != grpc::StatusCode::UNAVAILABLE || absl::Now() + backoff >= deadline) {
      return FromGrpc(s, what);
    }
    lost = true;
    absl::SleepFor(backoff);
    backoff = std::min(backoff * 2, absl::Milliseconds(500));
  }
}

absl::Status GrpcStore::Set(absl::string_view key, absl::string_view value) {
  v1::StoreSetRequest request;
  *request.mutable_scope() = scope_;
  request.set_key(std::string(key));
  request.set_value(std::string(value));
  {
    absl::MutexLock lock(&mu_);
    written_.push_back(request);
  }
  v1::StoreSetResponse response;
  return Call(absl::Now() + outage_, "set", [&](grpc::ClientContext& context) {
    context.set_deadline(std::min(context.deadline(), std::chrono::system_clock::now() +
                                                          absl::ToChronoMilliseconds(kRpcSlack)));
    return stub_->Set(&context, request, &response);
  });
}

absl::Status GrpcStore::SetAgain(absl::Duration within) {
  std::vector<v1::StoreSetRequest> written;
  {
    absl::MutexLock lock(&mu_);
    written = written_;
  }
  const absl::Time deadline = absl::Now() + within;
  for (const v1::StoreSetRequest& w : written) {
    MUONMESH_RETURN_IF_ERROR(FromGrpc(SetOnce(w, deadline), "set again"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> GrpcStore::Get(absl::string_view key, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout + kRpcSlack;
  v1::StoreGetRequest request;
  *request.mutable_scope() = scope_;
  request.set_key(std::string(key));
  v1::StoreGetResponse response;
  MUONMESH_RETURN_IF_ERROR(Call(deadline, "get", [&](grpc::ClientContext& context) {
    // The server waits what is left of the timeout.
    request.set_timeout_ms(
        std::max<int64_t>(1, absl::ToInt64Milliseconds(deadline - kRpcSlack - absl::Now())));
    return stub_->Get(&context, request, &response);
  }));
  return std::move(*response.mutable_value());
}

absl::Status GrpcStore::Wait(absl::Span<const std::string> keys, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout + kRpcSlack;
  v1::StoreWaitRequest request;
  *request.mutable_scope() = scope_;
  for (const std::string& k : keys) request.add_keys(k);
  v1::StoreWaitResponse response;
  return Call(deadline, "wait", [&](grpc::ClientContext& context) {
    request.set_timeout_ms(
        std::max<int64_t>(1, absl::ToInt64Milliseconds(deadline - kRpcSlack - absl::Now())));
    return stub_->Wait(&context, request, &response);
  });
}

}  // namespace muonmesh::comm

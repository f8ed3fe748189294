#include "server/control/store_service.h"

#include <algorithm>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/base/status_macros.h"
#include "proto/rpc/rpc_status.h"

namespace muonmesh::coordinator {
namespace {

absl::StatusOr<RendezvousScope> ScopeOf(const v1::StoreScope& scope) {
  if (scope.job_id().empty()) return absl::InvalidArgumentError("scope.job_id: required");
  if (scope.job_id().size() > 128 || scope.attempt() < 0) {
    return absl::InvalidArgumentError("scope: job_id over 128 bytes or a negative attempt");
  }
  return RendezvousScope{scope.job_id(), scope.attempt()};
}

absl::Duration WaitFor(int64_t timeout_ms) {
  if (timeout_ms <= 0) return kMaxStoreWait;
  return std::min(absl::Milliseconds(timeout_ms), kMaxStoreWait);
}

Rendezvous::Cancelled CancelledOf(grpc::ServerContext* context) {
  return [context] { return context->IsCancelled(); };
}

}  // namespace

absl::StatusOr<RendezvousScope> StoreService::LiveScope(const v1::StoreScope& scope) const {
  MUONMESH_ASSIGN_OR_RETURN(RendezvousScope s, ScopeOf(scope));
  if (live_ && !live_(s.job_id, s.attempt)) {
    return absl::FailedPreconditionError(
        absl::StrCat("scope: attempt ", s.attempt, " of job ", s.job_id.substr(0, 128),
                     " is not running (rendezvous keys live only while their attempt runs)"));
  }
  return s;
}

grpc::Status StoreService::Set(grpc::ServerContext*, const v1::StoreSetRequest* request,
                               v1::StoreSetResponse*) {
  absl::StatusOr<RendezvousScope> scope = LiveScope(request->scope());
  if (!scope.ok()) return rpc::ToGrpcStatus(scope.status());
  return rpc::ToGrpcStatus(rendezvous_.Set(*scope, request->key(), request->value()));
}

grpc::Status StoreService::Get(grpc::ServerContext* context, const v1::StoreGetRequest* request,
                               v1::StoreGetResponse* response) {
  absl::StatusOr<RendezvousScope> scope = LiveScope(request->scope());
  if (!scope.ok()) return rpc::ToGrpcStatus(scope.status());
  absl::StatusOr<std::string> value = rendezvous_.Get(
      *scope, request->key(), WaitFor(request->timeout_ms()), CancelledOf(context));
  if (!value.ok()) return rpc::ToGrpcStatus(value.status());
  response->set_value(*std::move(value));
  return grpc::Status::OK;
}

grpc::Status StoreService::Wait(grpc::ServerContext* context, const v1::StoreWaitRequest* request,
                                v1::StoreWaitResponse*) {
  absl::StatusOr<RendezvousScope> scope = LiveScope(request->scope());
  if (!scope.ok()) return rpc::ToGrpcStatus(scope.status());
  if (request->keys_size() > 65536) {
    return rpc::ToGrpcStatus(absl::InvalidArgumentError("keys: more than 65536"));
  }
  const std::vector<std::string> keys(request->keys().begin(), request->keys().end());
  return rpc::ToGrpcStatus(
      rendezvous_.Wait(*scope, keys, WaitFor(request->timeout_ms()), CancelledOf(context)));
}

grpc::Status StoreService::Add(grpc::ServerContext*, const v1::StoreAddRequest* request,
                               v1::StoreAddResponse* response) {
  absl::StatusOr<RendezvousScope> scope = LiveScope(request->scope());
  if (!scope.ok()) return rpc::ToGrpcStatus(scope.status());
  absl::StatusOr<int64_t> value = rendezvous_.Add(*scope, request->key(), request->delta());
  if (!value.ok()) return rpc::ToGrpcStatus(value.status());
  response->set_value(*value);
  return grpc::Status::OK;
}

}  // namespace muonmesh::coordinator

#include "worker/comm/grpc_store.h"

#include <chrono>

#include "absl/strings/str_cat.h"
#include "grpcpp/client_context.h"
#include "core/base/status_macros.h"

namespace muonmesh::comm {
namespace {

// gRPC's codes are absl's codes, number for number.
absl::Status FromGrpc(const grpc::Status& s, absl::string_view what) {
  if (s.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(s.error_code()),
                      absl::StrCat("coordinator store, ", what, ": ", s.error_message()));
}

void SetDeadline(grpc::ClientContext& context, absl::Duration d) {
  context.set_deadline(std::chrono::system_clock::now() + absl::ToChronoMilliseconds(d));
}

}  // namespace

GrpcStore::GrpcStore(std::shared_ptr<grpc::Channel> channel, std::string job_id, int attempt)
    : stub_(v1::Store::NewStub(std::move(channel))) {
  scope_.set_job_id(std::move(job_id));
  scope_.set_attempt(attempt);
}

absl::Status GrpcStore::Set(absl::string_view key, absl::string_view value) {
  v1::StoreSetRequest request;
  *request.mutable_scope() = scope_;
  request.set_key(std::string(key));
  request.set_value(std::string(value));
  v1::StoreSetResponse response;
  grpc::ClientContext context;
  SetDeadline(context, kRpcSlack);
  return FromGrpc(stub_->Set(&context, request, &response), "set");
}

absl::StatusOr<std::string> GrpcStore::Get(absl::string_view key, absl::Duration timeout) {
  v1::StoreGetRequest request;
  *request.mutable_scope() = scope_;
  request.set_key(std::string(key));
  request.set_timeout_ms(std::max<int64_t>(1, absl::ToInt64Milliseconds(timeout)));
  v1::StoreGetResponse response;
  grpc::ClientContext context;
  SetDeadline(context, timeout + kRpcSlack);
  MUONMESH_RETURN_IF_ERROR(FromGrpc(stub_->Get(&context, request, &response), "get"));
  return std::move(*response.mutable_value());
}

absl::Status GrpcStore::Wait(absl::Span<const std::string> keys, absl::Duration timeout) {
  v1::StoreWaitRequest request;
  *request.mutable_scope() = scope_;
  for (const std::string& k : keys) request.add_keys(k);
  request.set_timeout_ms(std::max<int64_t>(1, absl::ToInt64Milliseconds(timeout)));
  v1::StoreWaitResponse response;
  grpc::ClientContext context;
  SetDeadline(context, timeout + kRpcSlack);
  return FromGrpc(stub_->Wait(&context, request, &response), "wait");
}

}  // namespace muonmesh::comm

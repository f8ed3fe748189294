#include "client/planner_client.h"

#include <algorithm>
#include <chrono>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "grpcpp/client_context.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/support/channel_arguments.h"
#include "proto/rpc/rpc_status.h"
#include "core/base/status_macros.h"

namespace muonmesh::client {
namespace {

// Plans of big worlds exceed gRPC's 4 MiB default; the server sends up to
// this much (server/planner_service.h), so accept as much.
constexpr int kMaxReceiveBytes = 1 << 30;

template <typename Response>
absl::StatusOr<Response> Finish(const grpc::Status& status, const std::string& address,
                                Response response) {
  if (status.ok()) return response;
  absl::Status error = rpc::FromGrpcStatus(status);
  // A bad config is about the input, not the server: its message is the
  // violations alone. Everything else says which coordinator failed.
  if (error.code() == absl::StatusCode::kInvalidArgument &&
      !rpc::ViolationsFromGrpcStatus(status).empty()) {
    return error;
  }
  return AnnotateStatus(error, absl::StrCat("coordinator ", address));
}


}  // namespace

PlannerClient::PlannerClient(std::string address, PlannerClientOptions options)
    : address_(std::move(address)), options_(options) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(kMaxReceiveBytes);
  stub_ = v1::Planner::NewStub(credentials::CreateChannel(address_, options_.security, args));
}

absl::StatusOr<v1::ValidateConfigResponse> PlannerClient::Validate(
    const v1::ValidateConfigRequest& request) {
  grpc::ClientContext context;
  rpc::SetDeadline(context, options_.timeout);
  v1::ValidateConfigResponse response;
  const grpc::Status status = stub_->ValidateConfig(&context, request, &response);
  return Finish(status, address_, std::move(response));
}

absl::StatusOr<v1::PlanLayoutResponse> PlannerClient::Plan(const v1::PlanLayoutRequest& request) {
  grpc::ClientContext context;
  rpc::SetDeadline(context, options_.timeout);
  v1::PlanLayoutResponse response;
  const grpc::Status status = stub_->PlanLayout(&context, request, &response);
  return Finish(status, address_, std::move(response));
}

}  // namespace muonmesh::client

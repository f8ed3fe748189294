#pragma once

// A client of the coordinator's Planner service: muonmeshctl's `validate`
// and `plan`, and anything else that wants a plan without speaking gRPC.
//
// Thread-safe: one client may be shared; each call is independent.

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "muonmesh/v1/planner.grpc.pb.h"
#include "proto/credentials/credentials.h"

namespace muonmesh::client {

struct PlannerClientOptions {
  // Deadline of each call. A coordinator that cannot be reached fails the
  // call with UNAVAILABLE or DEADLINE_EXCEEDED within it.
  absl::Duration timeout = absl::Seconds(60);
  // TLS, client certificate and token (credentials::LoadChannelSecurity); default:
  // plaintext.
  credentials::ChannelSecurity security;
};

class PlannerClient {
 public:
  // Does not connect yet (gRPC connects on the first call), so it cannot
  // fail; an unreachable `address` shows up as the first call's error.
  explicit PlannerClient(std::string address, PlannerClientOptions options = {});

  const std::string& address() const { return address_; }

  // The violations of the request (empty when valid). Errors: the RPC's
  // status, with a message naming the coordinator's address.
  absl::StatusOr<v1::ValidateConfigResponse> Validate(const v1::ValidateConfigRequest& request);

  // The plan. An invalid config gives InvalidArgument whose message is the
  // field violations, one per line as "field: description"; other errors
  // (unreachable, deadline, too large) have a message naming the address.
  absl::StatusOr<v1::PlanLayoutResponse> Plan(const v1::PlanLayoutRequest& request);

 private:
  std::string address_;
  PlannerClientOptions options_;
  std::unique_ptr<v1::Planner::Stub> stub_;
};

}  // namespace muonmesh::client

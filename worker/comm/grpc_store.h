#pragma once

// A rendezvous Store over the coordinator's Store service (muonmesh.v1.Store):
// how the ranks of a job attempt scheduled by the coordinator find each
// other. Keys live in the attempt's scope (job id and attempt), so attempts
// never see each other's keys.
//
// Each call is one RPC with a deadline: the wait's timeout plus
// kRpcSlack for Get and Wait, kRpcSlack alone for Set. A coordinator that
// cannot be reached is Unavailable; the server's other codes pass through.
//
// Thread-safe (gRPC stubs are); the channel is shared and must outlive it.

#include <memory>
#include <string>

#include "absl/time/time.h"
#include "grpcpp/channel.h"
#include "muonmesh/v1/store.grpc.pb.h"
#include "worker/comm/store.h"

namespace muonmesh::comm {

class GrpcStore final : public Store {
 public:
  static constexpr absl::Duration kRpcSlack = absl::Seconds(10);

  GrpcStore(std::shared_ptr<grpc::Channel> channel, std::string job_id, int attempt);

  absl::Status Set(absl::string_view key, absl::string_view value) override;
  absl::StatusOr<std::string> Get(absl::string_view key, absl::Duration timeout) override;
  absl::Status Wait(absl::Span<const std::string> keys, absl::Duration timeout) override;

 private:
  std::unique_ptr<v1::Store::Stub> stub_;
  v1::StoreScope scope_;
};

}  // namespace muonmesh::comm

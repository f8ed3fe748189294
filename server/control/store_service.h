#pragma once

// The Store gRPC service (muonmesh.v1.Store): the edge of the coordinator's
// Rendezvous. Waits end at the request's timeout, the call's deadline or
// when the client goes away, whichever is first.
//
// Stateless over a Rendezvous it does not own (the coordinator's); gRPC
// calls it from many threads.

#include <functional>
#include <string>

#include "absl/status/statusor.h"
#include "grpcpp/server_context.h"
#include "muonmesh/v1/store.grpc.pb.h"
#include "server/control/rendezvous.h"

namespace muonmesh::coordinator {

// The longest a Get or Wait may block (a client asking for longer gets this).
inline constexpr absl::Duration kMaxStoreWait = absl::Minutes(10);

class StoreService final : public v1::Store::Service {
 public:
  // Whether (job id, attempt) names an attempt that runs now.
  using LiveAttempt = std::function<bool(const std::string& job_id, int32_t attempt)>;
  // With `live` (the coordinator's), a call on a scope whose attempt does
  // not run is refused with FAILED_PRECONDITION: rendezvous keys exist only
  // for live attempts (a client cannot fill scopes of made-up or ended
  // jobs). Without it (tests of the Store alone), every scope is served.
  explicit StoreService(Rendezvous* rendezvous, LiveAttempt live = nullptr)
      : rendezvous_(*rendezvous), live_(std::move(live)) {}

  grpc::Status Set(grpc::ServerContext* context, const v1::StoreSetRequest* request,
                   v1::StoreSetResponse* response) override;
  grpc::Status Get(grpc::ServerContext* context, const v1::StoreGetRequest* request,
                   v1::StoreGetResponse* response) override;
  grpc::Status Wait(grpc::ServerContext* context, const v1::StoreWaitRequest* request,
                    v1::StoreWaitResponse* response) override;
  grpc::Status Add(grpc::ServerContext* context, const v1::StoreAddRequest* request,
                   v1::StoreAddResponse* response) override;

 private:
  // The scope of a request, when its attempt runs (or there is no check).
  absl::StatusOr<RendezvousScope> LiveScope(const v1::StoreScope& scope) const;

  Rendezvous& rendezvous_;
  const LiveAttempt live_;
};

}  // namespace muonmesh::coordinator

#pragma once

// The Store gRPC service (muonmesh.v1.Store): the edge of the coordinator's
// Rendezvous. Waits end at the request's timeout, the call's deadline or
// when the client goes away, whichever is first.
//
// Stateless over a Rendezvous it does not own (the coordinator's); gRPC
// calls it from many threads.

#include "grpcpp/server_context.h"
#include "muonmesh/v1/store.grpc.pb.h"
#include "server/control/rendezvous.h"

namespace muonmesh::coordinator {

// The longest a Get or Wait may block (a client asking for longer gets this).
inline constexpr absl::Duration kMaxStoreWait = absl::Minutes(10);

class StoreService final : public v1::Store::Service {
 public:
  explicit StoreService(Rendezvous* rendezvous) : rendezvous_(*rendezvous) {}

  grpc::Status Set(grpc::ServerContext* context, const v1::StoreSetRequest* request,
                   v1::StoreSetResponse* response) override;
  grpc::Status Get(grpc::ServerContext* context, const v1::StoreGetRequest* request,
                   v1::StoreGetResponse* response) override;
  grpc::Status Wait(grpc::ServerContext* context, const v1::StoreWaitRequest* request,
                    v1::StoreWaitResponse* response) override;
  grpc::Status Add(grpc::ServerContext* context, const v1::StoreAddRequest* request,
                   v1::StoreAddResponse* response) override;

 private:
  Rendezvous& rendezvous_;
};

}  // namespace muonmesh::coordinator

#pragma once

// The Planner gRPC service (muonmesh.v1.Planner): a thin edge over the pure
// planner in server/plan/. It translates messages, adds the limits that only
// matter to a server (how big an answer it will build and send), and turns
// planner violations into INVALID_ARGUMENT with google.rpc.BadRequest details.
//
// Stateless: gRPC's sync server calls it from many threads at once.

#include <cstdint>

#include "grpcpp/server_context.h"
#include "grpcpp/support/status.h"
#include "muonmesh/v1/planner.grpc.pb.h"

namespace muonmesh {

// Largest request the server reads. The largest real model spec is ~130 KiB;
// this leaves room for generated specs while bounding what one call can make
// the server allocate.
inline constexpr int kMaxRequestBytes = 64 << 20;
// Largest message the server sends: plans with every shard of a big world
// are large, and gRPC's 4 MiB default would fail them late and obscurely.
inline constexpr int kMaxResponseBytes = 1 << 30;

// Estimated serialized size of a PlanLayout answer above which the server
// refuses to build it (RESOURCE_EXHAUSTED). Building takes a few times this
// in memory; DDP over a huge world repeats every matrix per rank.
inline constexpr int64_t kMaxPlanResponseBytes = int64_t{256} << 20;

class PlannerService final : public v1::Planner::Service {
 public:
  // Always OK: the answer lists every violation, empty when the config is
  // valid (including the server's own size limits).
  grpc::Status ValidateConfig(grpc::ServerContext* context,
                              const v1::ValidateConfigRequest* request,
                              v1::ValidateConfigResponse* response) override;

  // INVALID_ARGUMENT with BadRequest field violations when ValidateConfig
  // would list any; RESOURCE_EXHAUSTED when the answer would exceed
  // kMaxPlanResponseBytes; otherwise OK with the plan and
  // summary.plan_seconds set.
  grpc::Status PlanLayout(grpc::ServerContext* context, const v1::PlanLayoutRequest* request,
                          v1::PlanLayoutResponse* response) override;
};

}  // namespace muonmesh

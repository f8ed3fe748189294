#pragma once

// The Planner gRPC service (muonmesh.v1.Planner): a thin edge over the pure
// planner in core/plan/. It translates messages, adds the limits that only
// matter to a server (how big an answer it will build and send, how many
// plans and how much memory it computes at once), turns planner violations
// into INVALID_ARGUMENT with google.rpc.BadRequest details, and stops a plan
// whose caller has gone.
//
// gRPC's sync server calls it from many threads at once; every method is
// thread-safe. Owned by the CoordinatorServer, which calls CancelAll() when
// it stops.

#include <atomic>
#include <cstdint>

#include "grpcpp/server_context.h"
#include "grpcpp/support/status.h"
#include "muonmesh/v1/planner.grpc.pb.h"
#include "core/plan/plan_size.h"
#include "core/plan/types.h"
#include "server/plan_admission.h"

namespace muonmesh::coordinator {

// Largest request the server reads. The largest real model spec is ~130 KiB;
// this leaves room for generated specs while bounding what one call can make
// the server allocate.
inline constexpr int kMaxRequestBytes = 64 << 20;
// Largest message the server sends: plans with every shard of a big world
// are large, and gRPC's 4 MiB default would fail them late and obscurely.
inline constexpr int kMaxResponseBytes = 1 << 30;

// Bound of the serialized size of a PlanLayout answer (ResponseBytesBound)
// above which the server refuses to plan (RESOURCE_EXHAUSTED). Building
// takes a few times this in memory; DDP over a huge world repeats every
// matrix per rank.
inline constexpr int64_t kMaxPlanResponseBytes = int64_t{256} << 20;

// Serialized size of the PlanLayout answer, from the plan's size (so that an
// answer too large to build is refused before planning). Errs high:
// per-field overheads are upper bounds for realistic values.
double ResponseBytesBound(const plan::PlanInput& input, const plan::PlanSize& size,
                          bool include_shards);

// What a PlanLayout call may hold in memory at its peak: the request and its
// copy, the planner's working set, and the answer as a message and as bytes.
double PlanCallBytes(const plan::PlanSize& size, double request_bytes, double response_bytes);

struct PlannerServiceOptions {
  PlanAdmissionLimits admission;
};

class PlannerService final : public v1::Planner::Service {
 public:
  explicit PlannerService(PlannerServiceOptions options = {});

  // Always OK: the answer lists every violation, empty when the config is
  // valid (including the server's own size limits).
  grpc::Status ValidateConfig(grpc::ServerContext* context,
                              const v1::ValidateConfigRequest* request,
                              v1::ValidateConfigResponse* response) override;

  // INVALID_ARGUMENT with BadRequest field violations when ValidateConfig
  // would list any; RESOURCE_EXHAUSTED, before planning, when the answer
  // would exceed kMaxPlanResponseBytes or the call would pass the admission
  // limits; CANCELLED when the client gave up (deadline, hang-up) while it
  // planned; UNAVAILABLE when the server is stopping (CancelAll); otherwise
  // OK with the plan and summary.plan_seconds set.
  grpc::Status PlanLayout(grpc::ServerContext* context, const v1::PlanLayoutRequest* request,
                          v1::PlanLayoutResponse* response) override;

  // Stops the plans being computed (they answer UNAVAILABLE within about a
  // millisecond of planner work) and refuses new ones. Plans are pure
  // computations that a client can retry elsewhere; letting one run on
  // would hold a stopping server for as long as it takes. Idempotent.
  void CancelAll() { stopping_.store(true); }

  // Plan calls admitted and not yet finished.
  int64_t plans_in_flight() const { return admission_.calls(); }

 private:
  PlanAdmission admission_;
  std::atomic<bool> stopping_{false};
};

}  // namespace muonmesh::coordinator

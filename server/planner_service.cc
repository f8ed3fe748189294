#include "server/planner_service.h"

#include <chrono>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "core/plan/cancel.h"
#include "core/plan/planner.h"
#include "core/plan/validate.h"
#include "proto/convert/plan_convert.h"
#include "proto/rpc/rpc_status.h"
#include "core/base/status_macros.h"

namespace muonmesh::coordinator {
namespace {

// Serialized bytes per element of the answer, upper bounds for realistic
// values (field tags, varints of plausible size).
constexpr double kMatrixBytes = 80;  // a Matrix without its name and holders
constexpr double kHolderBytes = 24;
constexpr double kRankBytes = 64;
constexpr double kDomainBytes = 64;
constexpr double kDomainRankBytes = 6;
constexpr double kLayoutTensorBytes = 32;  // without the parameter's name
constexpr double kShardBytes = 4;
constexpr double kSegmentBytes = 40;

// Everything wrong with `input`, as the planner's validation sees it, its
// size limits included; `size` is set when there is nothing wrong. Sizing
// lays out each distinct unit once (`cancel` may stop it).
absl::StatusOr<std::vector<rpc::FieldViolation>> CheckInput(const plan::PlanInput& input,
                                                            plan::CancelToken* cancel,
                                                            plan::PlanSize* size) {
  std::vector<plan::FieldViolation> found = plan::Validate(input);
  if (found.empty()) {
    MUONMESH_ASSIGN_OR_RETURN(plan::PlanSize sized, plan::EstimatePlanSize(input, cancel));
    *size = sized;
    found = plan::PlanSizeViolations(*size);
  }
  return found;
}

grpc::Status InvalidConfig(const std::vector<rpc::FieldViolation>& violations) {
  std::vector<std::string> parts;
  parts.reserve(violations.size());
  for (const rpc::FieldViolation& v : violations) {
    parts.push_back(absl::StrCat(v.field, ": ", v.description));
  }
  // ToGrpcStatus cuts this to what fits in a trailer; the details carry
  // the violations one by one.
  return rpc::ToGrpcStatus(
      absl::InvalidArgumentError(absl::StrCat("invalid config (", violations.size(),
                                              " violation(s)): ", absl::StrJoin(parts, "; "))),
      violations);
}

// RESOURCE_EXHAUSTED when the answer would be too large to send.
absl::Status CheckResponseSize(double response_bytes, bool include_shards) {
  if (response_bytes <= static_cast<double>(kMaxPlanResponseBytes)) return absl::OkStatus();
  return absl::ResourceExhaustedError(absl::StrFormat(
      "the plan could take up to %.0f MiB (server limit %d MiB): %s", response_bytes / (1 << 20),
      kMaxPlanResponseBytes >> 20,
      include_shards ? "omit include_shards, or use fewer ranks"
                     : "use a strategy that shards the optimizer state, or fewer ranks"));
}

// Why a plan stopped early: the server is stopping, or the client left.
grpc::Status Stopped(bool stopping) {
  return stopping ? grpc::Status(grpc::StatusCode::UNAVAILABLE,
                                 "the coordinator is shutting down; plan again elsewhere")
                  : grpc::Status(grpc::StatusCode::CANCELLED,
                                 "the call was cancelled or its deadline expired");
}

}  // namespace

double ResponseBytesBound(const plan::PlanInput& input, const plan::PlanSize& size,
                          bool include_shards) {
  double layouts = 0;
  for (const plan::UnitSpec& unit : input.model.units) {
    for (const plan::ParamSpec& p : unit.params) {
      layouts += kLayoutTensorBytes + static_cast<double>(p.name.size());
    }
  }
  const double world = static_cast<double>(input.world_size);
  double bytes = size.listed_name_bytes + kMatrixBytes * size.listed_matrices +
                 kHolderBytes * size.listed_holders + kRankBytes * world +
                 kDomainBytes * size.domains + kDomainRankBytes * 2 * world + layouts;
  if (include_shards) bytes += kShardBytes * size.layout_shards + kSegmentBytes * size.segments;
  return bytes;
}

double PlanCallBytes(const plan::PlanSize& size, double request_bytes, double response_bytes) {
  // A request parsed into a message, then copied into the planner's input,
  // takes several times its wire size (string and vector headers); the
  // answer is held as a message and then as bytes.
  return size.planner_bytes + 8 * request_bytes + 3 * response_bytes;
}

PlannerService::PlannerService(PlannerServiceOptions options) : admission_(options.admission) {}

grpc::Status PlannerService::ValidateConfig(grpc::ServerContext* context,
                                            const v1::ValidateConfigRequest* request,
                                            v1::ValidateConfigResponse* response) {
  plan::CancelToken cancel([context] { return context->IsCancelled(); });
  plan::PlanSize size;
  absl::StatusOr<std::vector<rpc::FieldViolation>> violations =
      CheckInput(convert::PlanInputFromProto(*request), &cancel, &size);
  if (!violations.ok()) {
    return cancel.cancelled() ? Stopped(/*stopping=*/false)
                              : rpc::ToGrpcStatus(violations.status());
  }
  for (const rpc::FieldViolation& v : *violations) {
    v1::FieldViolation* out = response->add_violations();
    out->set_field(v.field);
    out->set_description(v.description);
  }
  return grpc::Status::OK;
}

grpc::Status PlannerService::PlanLayout(grpc::ServerContext* context,
                                        const v1::PlanLayoutRequest* request,
                                        v1::PlanLayoutResponse* response) {
  // Steady clock: plan_seconds is a duration and must not jump with NTP.
  const auto start = std::chrono::steady_clock::now();
  // Polled by work done, a few thousand planner steps apart (CancelToken).
  plan::CancelToken cancel([&] { return stopping_.load() || context->IsCancelled(); });
  if (cancel.Poll()) return Stopped(stopping_.load());
  const plan::PlanInput input = convert::PlanInputFromProto(*request);
  // Sizes first: a plan too big to build, to answer or to afford is refused
  // before any of it is built.
  plan::PlanSize size;
  absl::StatusOr<std::vector<rpc::FieldViolation>> violations =
      CheckInput(input, &cancel, &size);
  if (!violations.ok()) {
    return cancel.cancelled() ? Stopped(stopping_.load()) : rpc::ToGrpcStatus(violations.status());
  }
  if (!violations->empty()) return InvalidConfig(*violations);
  const double response_bytes = ResponseBytesBound(input, size, request->include_shards());
  if (absl::Status st = CheckResponseSize(response_bytes, request->include_shards()); !st.ok()) {
    return rpc::ToGrpcStatus(st);
  }
  absl::StatusOr<PlanAdmission::Ticket> ticket = admission_.Admit(static_cast<int64_t>(
      PlanCallBytes(size, static_cast<double>(request->ByteSizeLong()), response_bytes)));
  if (!ticket.ok()) return rpc::ToGrpcStatus(ticket.status());
  if (cancel.Poll()) return Stopped(stopping_.load());

  absl::StatusOr<plan::Plan> plan = plan::ComputePlan(input, &cancel);
  // Building the answer of a big plan takes a while too: not for nobody.
  if (cancel.Poll()) return Stopped(stopping_.load());
  if (!plan.ok()) return rpc::ToGrpcStatus(plan.status());

  v1::Plan* out = response->mutable_plan();
  convert::PlanToProto(input, *plan, request->include_shards(), out, !request->omit_holders());
  out->mutable_summary()->set_plan_seconds(
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  return grpc::Status::OK;
}

}  // namespace muonmesh::coordinator

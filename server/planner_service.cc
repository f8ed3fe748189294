#include "server/planner_service.h"

#include <chrono>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "server/plan/mesh.h"
#include "server/plan/planner.h"
#include "server/plan/validate.h"
#include "server/plan_convert.h"
#include "server/rpc_status.h"

namespace muonmesh {
namespace {

// Everything wrong with `input`, as the planner's validation sees it.
std::vector<rpc::FieldViolation> CheckInput(const plan::PlanInput& input) {
  std::vector<rpc::FieldViolation> out;
  for (plan::FieldViolation& v : plan::Validate(input)) {
    out.push_back({std::move(v.field), std::move(v.description)});
  }
  return out;
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

// Rough serialized size of the PlanLayout answer, computed from the plan
// alone so that an answer too large to build is refused before it is built.
// Errs high: per-field overheads are upper bounds for realistic values.
double EstimateResponseBytes(const plan::PlanInput& input, const plan::Plan& p,
                             bool include_shards) {
  // Matrices are listed once per domain; domains of one mesh share a plan.
  auto class_bytes = [&](const plan::DomainPlan& dp) {
    double bytes = 0;
    for (const plan::MatrixPlan& m : dp.matrices) {
      bytes += static_cast<double>(input.model.units[m.unit].params[m.param].name.size()) + 80 +
               24.0 * static_cast<double>(m.holders.size());
    }
    return bytes;
  };
  double dense_domains = 0;
  double expert_domains = 0;
  double domain_ranks = 0;
  for (const plan::Domain& d : p.domains) {
    (d.mesh == plan::MeshKind::kDense ? dense_domains : expert_domains) += 1;
    domain_ranks += static_cast<double>(d.ranks.size());
  }
  double bytes = class_bytes(p.dense) * dense_domains;
  if (p.has_experts) bytes += class_bytes(p.expert) * expert_domains;
  bytes += 64.0 * static_cast<double>(p.ranks.size()) + 6.0 * domain_ranks +
           64.0 * static_cast<double>(p.domains.size());
  for (const plan::UnitPlan& unit : p.units) {
    for (const plan::UnitLayout* layout : {&unit.dense, &unit.expert}) {
      bytes += 32.0 * static_cast<double>(layout->tensors.size());
      if (include_shards) {
        bytes += 4.0 * static_cast<double>(layout->num_shards) +
                 40.0 * static_cast<double>(layout->segments.size());
      }
    }
  }
  return bytes;
}

}  // namespace

grpc::Status PlannerService::ValidateConfig(grpc::ServerContext* /*context*/,
                                            const v1::ValidateConfigRequest* request,
                                            v1::ValidateConfigResponse* response) {
  for (const rpc::FieldViolation& v : CheckInput(PlanInputFromProto(*request))) {
    v1::FieldViolation* out = response->add_violations();
    out->set_field(v.field);
    out->set_description(v.description);
  }
  return grpc::Status::OK;
}

grpc::Status PlannerService::PlanLayout(grpc::ServerContext* /*context*/,
                                        const v1::PlanLayoutRequest* request,
                                        v1::PlanLayoutResponse* response) {
  // Steady clock: plan_seconds is a duration and must not jump with NTP.
  const auto start = std::chrono::steady_clock::now();
  const plan::PlanInput input = PlanInputFromProto(*request);
  const std::vector<rpc::FieldViolation> violations = CheckInput(input);
  if (!violations.empty()) return InvalidConfig(violations);

  absl::StatusOr<plan::Plan> plan = plan::ComputePlan(input);
  if (!plan.ok()) return rpc::ToGrpcStatus(plan.status());

  const double estimate = EstimateResponseBytes(input, *plan, request->include_shards());
  if (estimate > static_cast<double>(kMaxPlanResponseBytes)) {
    return rpc::ToGrpcStatus(absl::ResourceExhaustedError(
        absl::StrFormat("the plan would take about %.0f MiB (server limit %d MiB): %s",
                        estimate / (1 << 20), kMaxPlanResponseBytes >> 20,
                        request->include_shards()
                            ? "omit include_shards, or use fewer ranks"
                            : "use a strategy that shards the optimizer state, or fewer ranks")));
  }

  v1::Plan* out = response->mutable_plan();
  PlanToProto(input, *plan, request->include_shards(), out);
  out->mutable_summary()->set_plan_seconds(
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  return grpc::Status::OK;
}

}  // namespace muonmesh

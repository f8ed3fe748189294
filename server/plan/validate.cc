#include "server/plan/validate.h"

#include <cmath>
#include <limits>
#include <string>
#include <unordered_set>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "server/plan/mesh.h"

namespace muonmesh::plan {
namespace internal {
ResolvedConfig ResolveUnchecked(const PlanInput& in);
}  // namespace internal
namespace {

constexpr const char* kStrategyNames =
    "no_shard, optim, optim_grads, optim_grads_params";

class Violations {
 public:
  void Add(std::string field, std::string description) {
    list_.push_back({std::move(field), std::move(description)});
  }
  std::vector<FieldViolation> Take() { return std::move(list_); }

 private:
  std::vector<FieldViolation> list_;
};

// a * b, or -1 when it would exceed `limit`.
int64_t MulCapped(int64_t a, int64_t b, int64_t limit) {
  if (a < 0 || b < 0) return -1;
  if (a != 0 && b > limit / a) return -1;
  return a * b;
}

// Validates a parallel size that must be 1 (unsupported). 0 means unset.
void CheckUnsupported(Violations& v, const char* field, const char* what,
                      int64_t value) {
  if (value < 0) {
    v.Add(absl::StrCat("parallelism.", field), absl::StrCat("must be >= 1, got ", value));
  } else if (value > 1) {
    v.Add(absl::StrCat("parallelism.", field),
          absl::StrCat(what, " is not supported yet (got ", value,
                       "); muonmesh shards over data-parallel ranks only: use 1"));
  }
}

struct ModelCounts {
  int64_t dense_matrices = 0;
  int64_t expert_matrices = 0;  // all experts of all stacks
  int64_t dense_units = 0;      // units with dense parameters
  int64_t expert_units = 0;     // units with expert parameters
};

ModelCounts CheckModel(const ModelSpec& model, int64_t ep, Violations& v) {
  ModelCounts counts;
  if (model.units.empty()) {
    v.Add("model.units", "the model has no units");
    return counts;
  }
  if (static_cast<int64_t>(model.units.size()) > kMaxUnits) {
    v.Add("model.units", absl::StrCat(model.units.size(), " units exceed the limit of ",
                                      kMaxUnits));
    return counts;
  }
  std::unordered_set<std::string> unit_names;
  std::unordered_set<std::string> param_names;
  int64_t tensors = 0;
  int64_t elements = 0;
  bool elements_overflow = false;
  for (size_t u = 0; u < model.units.size(); ++u) {
    const UnitSpec& unit = model.units[u];
    const std::string upath = absl::StrCat("model.units[", u, "]");
    if (unit.name.empty()) {
      v.Add(upath + ".name", "empty unit name");
    } else if (!unit_names.insert(unit.name).second) {
      v.Add(upath + ".name", absl::StrCat("duplicate unit name '", unit.name, "'"));
    }
    if (unit.params.empty()) v.Add(upath + ".params", "the unit has no parameters");
    if (unit.gathers_per_step < 0 || unit.gathers_per_step > kMaxGathersPerStep) {
      v.Add(upath + ".gathers_per_step",
            absl::StrCat(unit.gathers_per_step, " is not in [0, ", kMaxGathersPerStep,
                         "] (0 means 1)"));
    }
    bool has_dense = false;
    bool has_expert = false;
    for (const ParamSpec& p : unit.params) (p.expert ? has_expert : has_dense) = true;
    counts.dense_units += has_dense;
    counts.expert_units += has_expert;
    tensors += static_cast<int64_t>(unit.params.size());
    if (tensors > kMaxTensors) {
      v.Add(upath + ".params",
            absl::StrCat("the model has more than ", kMaxTensors, " tensors (the limit)"));
      return counts;
    }
    for (size_t i = 0; i < unit.params.size(); ++i) {
      const ParamSpec& p = unit.params[i];
      const std::string path = absl::StrCat(upath, ".params[", i, "]");
      if (p.name.empty()) {
        v.Add(path + ".name", "empty parameter name");
      } else if (static_cast<int64_t>(p.name.size()) > kMaxNameLength) {
        v.Add(path + ".name", absl::StrCat("name of ", p.name.size(),
                                           " bytes exceeds the limit of ", kMaxNameLength));
      } else if (!param_names.insert(p.name).second) {
        v.Add(path + ".name", absl::StrCat("duplicate parameter name '", p.name, "'"));
      }
      const bool muon = p.optimizer == "muon";
      if (!muon && p.optimizer != "adamw") {
        v.Add(path + ".optimizer",
              absl::StrCat("unknown optimizer '", p.optimizer, "' (expected muon or adamw)"));
      }
      if (p.shape.empty()) {
        v.Add(path + ".shape", "empty shape: give at least one dimension");
        continue;
      }
      if (static_cast<int64_t>(p.shape.size()) > kMaxDims) {
        v.Add(path + ".shape", absl::StrCat(p.shape.size(), " dimensions exceed the limit of ",
                                            kMaxDims));
        continue;
      }
      bool dims_ok = true;
      int64_t numel = 1;
      for (size_t d = 0; d < p.shape.size(); ++d) {
        if (p.shape[d] <= 0) {
          v.Add(absl::StrCat(path, ".shape[", d, "]"),
                absl::StrCat("dimension must be positive, got ", p.shape[d]));
          dims_ok = false;
        } else if (numel >= 0) {
          numel = MulCapped(numel, p.shape[d], kMaxModelElements);
        }
      }
      if (!dims_ok) continue;
      if (numel < 0) {
        v.Add(path + ".shape",
              absl::StrCat("more than ", kMaxModelElements, " elements (the limit)"));
        continue;
      }
      elements += numel;
      if (elements > kMaxModelElements) elements_overflow = true;
      const size_t min_dims = (muon ? 2 : 1) + (p.expert ? 1 : 0);
      if (p.shape.size() < min_dims) {
        v.Add(path + ".shape",
              muon ? absl::StrCat("Muon needs a matrix: a ", p.expert ? "stack [E, rows, cols]"
                                                                       : "tensor of >= 2 dims",
                                  ", got ", p.shape.size(), " dim(s); use adamw")
                   : "an expert stack needs [E, ...] with at least 2 dims");
        continue;
      }
      if (p.expert) {
        if (ep > 0 && p.shape[0] % ep != 0) {
          v.Add(path + ".shape[0]",
                absl::StrCat(p.shape[0], " experts do not divide over expert_model_parallel_size ",
                             ep));
        }
        if (muon) counts.expert_matrices += p.shape[0];
      } else if (muon) {
        counts.dense_matrices += 1;
      }
    }
  }
  if (elements_overflow) {
    v.Add("model", absl::StrCat("more than ", kMaxModelElements, " parameters (the limit)"));
  }
  return counts;
}

}  // namespace

int64_t NumElements(const ParamSpec& p) {
  int64_t n = 1;
  for (int64_t d : p.shape) n *= d;
  return n;
}

MatrixView AsMatrix(const ParamSpec& p) {
  const size_t first = p.expert ? 1 : 0;
  int64_t cols = 1;
  for (size_t d = first + 1; d < p.shape.size(); ++d) cols *= p.shape[d];
  return {p.shape[first], cols};
}

std::vector<FieldViolation> Validate(const PlanInput& in) {
  Violations v;
  const int64_t w = in.world_size;
  const bool w_ok = w >= 1 && w <= kMaxWorldSize;
  if (w < 1) {
    v.Add("world_size", absl::StrCat("must be >= 1, got ", w));
  } else if (w > kMaxWorldSize) {
    v.Add("world_size", absl::StrCat(w, " exceeds the limit of ", kMaxWorldSize, " ranks"));
  }

  const ParallelismConfig& par = in.parallelism;
  std::optional<Strategy> inner = Strategy::kOptimGradsParams;
  if (!par.data_parallel_sharding_strategy.empty()) {
    inner = ParseStrategy(par.data_parallel_sharding_strategy);
    if (!inner) {
      v.Add("parallelism.data_parallel_sharding_strategy",
            absl::StrCat("unknown strategy '", par.data_parallel_sharding_strategy,
                         "' (expected one of ", kStrategyNames, ")"));
    }
  }
  const int64_t instances =
      par.num_distributed_optimizer_instances == 0 ? 1 : par.num_distributed_optimizer_instances;
  if (instances < 1) {
    v.Add("parallelism.num_distributed_optimizer_instances",
          absl::StrCat("must be >= 1, got ", instances));
  } else if (w_ok && w % instances != 0) {
    v.Add("parallelism.num_distributed_optimizer_instances",
          absl::StrCat(instances, " does not divide world_size ", w));
  }
  if (!par.outer_dp_sharding_strategy.empty()) {
    if (!ParseStrategy(par.outer_dp_sharding_strategy)) {
      v.Add("parallelism.outer_dp_sharding_strategy",
            absl::StrCat("unknown strategy '", par.outer_dp_sharding_strategy,
                         "' (expected one of ", kStrategyNames, ")"));
    } else if (instances == 1) {
      v.Add("parallelism.outer_dp_sharding_strategy",
            absl::StrCat("set to '", par.outer_dp_sharding_strategy,
                         "' but num_distributed_optimizer_instances is 1: the outer axis "
                         "exists only when it is > 1"));
    }
  }
  const int64_t ep = par.expert_model_parallel_size == 0 ? 1 : par.expert_model_parallel_size;
  if (ep < 1) {
    v.Add("parallelism.expert_model_parallel_size", absl::StrCat("must be >= 1, got ", ep));
  } else if (w_ok && w % ep != 0) {
    v.Add("parallelism.expert_model_parallel_size",
          absl::StrCat(ep, " does not divide world_size ", w));
  }
  CheckUnsupported(v, "tensor_model_parallel_size", "tensor parallelism",
                   par.tensor_model_parallel_size);
  CheckUnsupported(v, "pipeline_model_parallel_size", "pipeline parallelism",
                   par.pipeline_model_parallel_size);
  CheckUnsupported(v, "context_parallel_size", "context parallelism", par.context_parallel_size);

  const PlanOptions& opt = in.options;
  if (!opt.owner_assignment.empty() && !ParseOwnerRule(opt.owner_assignment)) {
    v.Add("options.owner_assignment",
          absl::StrCat("unknown rule '", opt.owner_assignment,
                       "' (expected lpt, round_robin, allgather or greedy_in_order)"));
  }
  if (opt.ns_steps < 0 || opt.ns_steps > kMaxNsSteps) {
    v.Add("options.ns_steps", absl::StrCat("must be in [1, ", kMaxNsSteps, "], got ",
                                           opt.ns_steps));
  }
  if (!opt.device.empty() && opt.device != "cpu" && opt.device != "cuda") {
    v.Add("options.device", absl::StrCat("unknown device '", opt.device,
                                         "' (expected cpu or cuda)"));
  }
  if (!std::isfinite(opt.comm_flops_per_byte) || opt.comm_flops_per_byte < 0) {
    v.Add("options.comm_flops_per_byte",
          absl::StrCat("must be a finite number >= 0, got ", opt.comm_flops_per_byte));
  }

  const ModelCounts counts = CheckModel(in.model, ep >= 1 ? ep : 0, v);
  std::vector<FieldViolation> out = v.Take();
  if (out.empty()) {
    // The size of the answer: every domain lists its matrices.
    const ResolvedConfig cfg = internal::ResolveUnchecked(in);
    const MeshGeometry dense = MeshGeometry::Dense(cfg);
    const MeshGeometry expert = MeshGeometry::Expert(cfg);
    const int64_t dense_domains = dense.num_domains();
    const int64_t expert_domains_per_group = expert.num_domains() / ep;
    // Both factors are bounded (units <= 1e5, ranks <= 2^20): no overflow.
    const int64_t shards = counts.dense_units * dense.domain_size() +
                           counts.expert_units * expert.domain_size();
    if (shards > kMaxLayoutShards) {
      out.push_back({"world_size",
                     absl::StrCat("the layout would cut ", in.model.units.size(), " units into ",
                                  shards, " shards in all (limit ", kMaxLayoutShards,
                                  "): use fewer ranks per optimizer domain or fewer units")});
    }
    const double entries = static_cast<double>(counts.dense_matrices) * dense_domains +
                           static_cast<double>(counts.expert_matrices) * expert_domains_per_group;
    if (entries > static_cast<double>(kMaxPlanMatrixEntries)) {
      out.push_back({"world_size",
                     absl::StrCat("the plan would list ", static_cast<int64_t>(entries),
                                  " matrix copies (limit ", kMaxPlanMatrixEntries,
                                  "): replicated optimizer state on this many ranks; use a "
                                  "sharded strategy or fewer ranks")});
    }
  }
  return out;
}

absl::StatusOr<ResolvedConfig> Resolve(const PlanInput& in) {
  std::vector<FieldViolation> violations = Validate(in);
  if (!violations.empty()) {
    std::vector<std::string> parts;
    for (const FieldViolation& f : violations) parts.push_back(f.field + ": " + f.description);
    return absl::InvalidArgumentError(absl::StrJoin(parts, "; "));
  }
  return internal::ResolveUnchecked(in);
}

namespace internal {

ResolvedConfig ResolveUnchecked(const PlanInput& in) {
  const ParallelismConfig& par = in.parallelism;
  ResolvedConfig cfg;
  cfg.world_size = in.world_size;
  cfg.instances =
      par.num_distributed_optimizer_instances == 0 ? 1 : par.num_distributed_optimizer_instances;
  cfg.ep = par.expert_model_parallel_size == 0 ? 1 : par.expert_model_parallel_size;
  if (!par.data_parallel_sharding_strategy.empty()) {
    cfg.inner = *ParseStrategy(par.data_parallel_sharding_strategy);
  }
  cfg.outer = Strategy::kNoShard;
  if (cfg.instances > 1) {
    cfg.outer = par.outer_dp_sharding_strategy.empty()
                    ? Strategy::kOptim
                    : *ParseStrategy(par.outer_dp_sharding_strategy);
  }
  const PlanOptions& opt = in.options;
  if (!opt.owner_assignment.empty()) cfg.owner_rule = *ParseOwnerRule(opt.owner_assignment);
  cfg.ns_steps = opt.ns_steps == 0 ? 5 : opt.ns_steps;
  // FLOPs one byte of owner traffic is worth: Newton-Schulz throughput over
  // link bandwidth. H200 (~500 TFLOP/s bf16 effective) over a 400 Gb/s NIC
  // (50 GB/s) is ~1e4; a CPU core with OpenBLAS (~50 GFLOP/s) over Gloo on
  // loopback (~2 GB/s) is ~25.
  if (opt.comm_flops_per_byte > 0) {
    cfg.comm_flops_per_byte = opt.comm_flops_per_byte;
  } else {
    cfg.comm_flops_per_byte = opt.device == "cpu" ? 25.0 : 1.0e4;
  }
  return cfg;
}

}  // namespace internal
}  // namespace muonmesh::plan

#include "core/plan/validate.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>

#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "core/plan/mesh.h"

namespace muonmesh::plan {
namespace {

constexpr const char* kStrategyNames =
    "no_shard, optim, optim_grads, optim_grads_params";

// a * b, or -1 when it would exceed `limit`.
int64_t MulCapped(int64_t a, int64_t b, int64_t limit) {
  if (a < 0 || b < 0) return -1;
  if (a != 0 && b > limit / a) return -1;
  return a * b;
}

// Names seen so far, viewing the input's strings (no copies: specs may
// hold a million of them).
using NameSet = absl::flat_hash_set<absl::string_view>;

// A name: non-empty, at most kMaxNameLength bytes, and, when `seen` is
// given, not seen before. `what` says whose name it is ("unit"); `path()`
// is the field's path, built only for a violation.
template <typename PathFn>
void CheckName(Violations& v, const PathFn& path, const std::string& name, const char* what,
               NameSet* seen) {
  if (name.empty()) {
    v.Add(path(), absl::StrCat("empty ", what, " name"));
  } else if (static_cast<int64_t>(name.size()) > kMaxNameLength) {
    v.Add(path(), absl::StrCat(what, " name of ", name.size(), " bytes exceeds the limit of ",
                               kMaxNameLength, " bytes: ", Quote(name)));
  } else if (seen != nullptr && !seen->insert(name).second) {
    v.Add(path(), absl::StrCat("duplicate ", what, " name ", Quote(name)));
  }
}

// Validates a parallel size that must be 1 (unsupported). 0 means unset.
void CheckUnsupported(Violations& v, const char* field, const char* what,
                      int64_t value) {
  if (value < 0) {
    v.Add(absl::StrCat("parallelism.", field),
          absl::StrCat("must be >= 1 (0 or unset: 1), got ", value));
  } else if (value > 1) {
    v.Add(absl::StrCat("parallelism.", field),
          absl::StrCat(what, " is not supported yet (got ", value,
                       "); muonmesh shards over data-parallel ranks only: use 1"));
  }
}

// The path of a parameter's field ("model.units[3].params[2]" + field),
// built only when a violation needs it: checking a million parameters must
// not build a million strings.
struct ParamPath {
  size_t unit;
  size_t param;
  std::string operator()(absl::string_view field = "") const {
    return absl::StrCat("model.units[", unit, "].params[", param, "]", field);
  }
};

// The shape of one parameter: its element count, or -1 when it is invalid
// (violations added).
int64_t CheckShape(const ParamSpec& p, const ParamPath& path, int64_t ep, Violations& v) {
  if (p.shape.empty()) {
    v.Add(path(".shape"), "empty shape: give at least one dimension");
    return -1;
  }
  if (static_cast<int64_t>(p.shape.size()) > kMaxDims) {
    v.Add(path(".shape"),
          absl::StrCat(p.shape.size(), " dimensions exceed the limit of ", kMaxDims));
    return -1;
  }
  bool dims_ok = true;
  int64_t numel = 1;
  for (size_t d = 0; d < p.shape.size(); ++d) {
    if (p.shape[d] <= 0) {
      v.Add(path(absl::StrCat(".shape[", d, "]")),
            absl::StrCat("dimension must be positive, got ", p.shape[d]));
      dims_ok = false;
    } else if (numel >= 0) {
      numel = MulCapped(numel, p.shape[d], kMaxModelElements);
    }
  }
  if (!dims_ok) return -1;
  if (numel < 0) {
    v.Add(path(".shape"), absl::StrCat("more than ", kMaxModelElements, " elements (the limit)"));
    return -1;
  }
  const bool muon = p.optimizer == "muon";
  const size_t min_dims = (muon ? 2 : 1) + (p.expert ? 1 : 0);
  if (p.shape.size() < min_dims) {
    v.Add(path(".shape"),
          muon ? absl::StrCat("Muon needs a matrix: a ",
                              p.expert ? "stack [E, rows, cols]" : "tensor of >= 2 dims",
                              ", got ", p.shape.size(), " dim(s); use adamw")
               : "an expert stack needs [E, ...] with at least 2 dims");
  } else if (p.expert && ep > 0 && p.shape[0] % ep != 0) {
    v.Add(path(".shape[0]"),
          absl::StrCat(p.shape[0], " experts do not divide over expert_model_parallel_size ", ep));
  } else if (p.muon_block_rows != 0 &&
             (!muon || p.muon_block_rows < 0 || AsMatrix(p).rows % MuonBlockPeriod(p) != 0)) {
    v.Add(path(".muon_block_rows"),
          !muon ? std::string("only for Muon tensors")
                : absl::StrCat(MuonBlockPeriod(p), " does not divide the matrix's ",
                               AsMatrix(p).rows, " rows"));
  } else if (p.muon_block_rows_next != 0 &&
             (p.muon_block_rows <= 0 || p.muon_block_rows_next < 0)) {
    v.Add(path(".muon_block_rows_next"),
          p.muon_block_rows_next < 0 ? absl::StrCat("must be >= 0, got ", p.muon_block_rows_next)
                                     : std::string("needs muon_block_rows"));
  } else if (p.muon_stack_blocks && p.muon_block_rows_next <= 0) {
    v.Add(path(".muon_stack_blocks"),
          "needs muon_block_rows and muon_block_rows_next (blocks of two sizes to stack)");
  }
  return numel;
}

// One parameter; adds its elements to *elements.
void CheckParam(const ParamSpec& p, const ParamPath& path, int64_t ep, NameSet& names,
                Violations& v, int64_t* elements) {
  CheckName(v, [&] { return path(".name"); }, p.name, "parameter", &names);
  if (p.optimizer != "muon" && p.optimizer != "adamw") {
    v.Add(path(".optimizer"),
          absl::StrCat("unknown optimizer ", Quote(p.optimizer), " (expected muon or adamw)"));
  }
  const int64_t numel = CheckShape(p, path, ep, v);
  // Both below 2^50 (MulCapped): the sum cannot overflow before it is capped.
  if (numel > 0) *elements = std::min(*elements + numel, kMaxModelElements + 1);
}

// The fields of one unit other than its parameters.
void CheckUnitFields(const UnitSpec& unit, size_t u, NameSet& names, Violations& v) {
  auto path = [u](absl::string_view field) { return absl::StrCat("model.units[", u, "]", field); };
  CheckName(v, [&] { return path(".name"); }, unit.name, "unit", &names);
  if (unit.params.empty()) v.Add(path(".params"), "the unit has no parameters");
  if (unit.gathers_per_step < 0 || unit.gathers_per_step > kMaxGathersPerStep) {
    v.Add(path(".gathers_per_step"),
          absl::StrCat("must be in [1, ", kMaxGathersPerStep, "] (0 or unset: 1), got ",
                       unit.gathers_per_step));
  }
}

void CheckModel(const ModelSpec& model, int64_t ep, Violations& v) {
  if (static_cast<int64_t>(model.name.size()) > kMaxNameLength) {
    CheckName(v, [] { return std::string("model.name"); }, model.name, "model", nullptr);
  }
  if (model.units.empty()) {
    v.Add("model.units", "the model has no units");
    return;
  }
  if (static_cast<int64_t>(model.units.size()) > kMaxUnits) {
    v.Add("model.units", absl::StrCat(model.units.size(), " units exceed the limit of ",
                                      kMaxUnits));
    return;
  }
  NameSet unit_names;
  NameSet param_names;
  unit_names.reserve(model.units.size());
  int64_t tensors = 0;
  int64_t elements = 0;
  for (size_t u = 0; u < model.units.size(); ++u) {
    const UnitSpec& unit = model.units[u];
    CheckUnitFields(unit, u, unit_names, v);
    tensors += static_cast<int64_t>(unit.params.size());
    if (tensors > kMaxTensors) {
      v.Add(absl::StrCat("model.units[", u, "].params"),
            absl::StrCat("the model has more than ", kMaxTensors, " tensors (the limit)"));
      return;
    }
    for (size_t i = 0; i < unit.params.size(); ++i) {
      CheckParam(unit.params[i], ParamPath{u, i}, ep, param_names, v, &elements);
    }
  }
  if (elements > kMaxModelElements) {
    v.Add("model", absl::StrCat("more than ", kMaxModelElements, " parameters (the limit)"));
  }
}

// Refuses plans whose layout shards or listed matrices pass the limits,
// counted from the spec (PlanSize, plan_size.h, counts the rest exactly).
void CheckCopies(const PlanInput& in, std::vector<FieldViolation>& out) {
  const ResolvedConfig cfg = internal::ResolveUnchecked(in);
  const MeshGeometry dense = MeshGeometry::Dense(cfg);
  const MeshGeometry expert = MeshGeometry::Expert(cfg);
  int64_t shards = 0;       // units <= 1e5, ranks <= 2^20: no overflow
  double listed = 0;        // matrices once per domain that lists them
  for (const UnitSpec& unit : in.model.units) {
    bool has_dense = false;
    bool has_expert = false;
    for (const ParamSpec& p : unit.params) {
      (p.expert ? has_expert : has_dense) = true;
      if (p.optimizer != "muon") continue;
      // Each EP group's domains list its own experts.
      listed += p.expert ? static_cast<double>(p.shape[0]) * expert.num_domains() / cfg.ep
                         : static_cast<double>(dense.num_domains());
    }
    shards += (has_dense ? dense.domain_size() : 0) + (has_expert ? expert.domain_size() : 0);
  }
  if (shards > kMaxLayoutShards) {
    out.push_back({"world_size",
                   absl::StrCat("the layout would cut ", in.model.units.size(), " units into ",
                                shards, " shards in all (limit ", kMaxLayoutShards,
                                "): use fewer ranks per optimizer domain or fewer units")});
  }
  if (listed > static_cast<double>(kMaxPlanMatrixEntries)) {
    out.push_back({"world_size",
                   absl::StrFormat("the plan would list %.0f matrix copies (limit %d): "
                                   "replicated optimizer state on this many ranks; use a "
                                   "sharded strategy or fewer ranks",
                                   listed, kMaxPlanMatrixEntries)});
  }
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

MatrixView MuonMatrixOf(const ParamSpec& p) {
  MatrixView m = AsMatrix(p);
  if (p.muon_block_rows > 0) m.rows = MuonBlockRows(p, 0).count;
  return m;
}

bool MuonStacksBlocks(const ParamSpec& p) {
  return p.muon_stack_blocks && p.muon_block_rows > 0 && p.muon_block_rows_next > 0;
}

int64_t MuonBlockPeriod(const ParamSpec& p) {
  return p.muon_block_rows + std::max<int64_t>(0, p.muon_block_rows_next);
}

int64_t MuonBlocksOf(const ParamSpec& p) {
  if (p.muon_block_rows <= 0) return 1;
  if (MuonStacksBlocks(p)) return 2;
  const int64_t periods = AsMatrix(p).rows / MuonBlockPeriod(p);
  return p.muon_block_rows_next > 0 ? 2 * periods : periods;
}

MatrixRows MuonBlockRows(const ParamSpec& p, int64_t block) {
  if (p.muon_block_rows <= 0) return {0, AsMatrix(p).rows};
  if (p.muon_block_rows_next <= 0) return {block * p.muon_block_rows, p.muon_block_rows};
  const int64_t period = MuonBlockPeriod(p);
  const int64_t size = block % 2 == 0 ? p.muon_block_rows : p.muon_block_rows_next;
  if (MuonStacksBlocks(p)) {
    // Every period's block of this size, stacked: pieces `period` apart.
    const int64_t periods = AsMatrix(p).rows / period;
    return {block == 0 ? 0 : p.muon_block_rows, periods * size, size, period};
  }
  return {(block / 2) * period + (block % 2) * p.muon_block_rows, size};
}

int64_t MuonBlockOfRow(const ParamSpec& p, int64_t row) {
  if (p.muon_block_rows <= 0) return 0;
  if (p.muon_block_rows_next <= 0) return row / p.muon_block_rows;
  const int64_t period = MuonBlockPeriod(p);
  const int64_t second = row % period >= p.muon_block_rows ? 1 : 0;
  return MuonStacksBlocks(p) ? second : 2 * (row / period) + second;
}

namespace {

// world_size and the parallelism section; returns the expert-parallel size
// (1 when unset, below 1 when invalid).
int64_t CheckParallelism(const PlanInput& in, Violations& v) {
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
            absl::StrCat("unknown strategy ", Quote(par.data_parallel_sharding_strategy),
                         " (expected one of ", kStrategyNames, ")"));
    }
  }
  const int64_t instances =
      par.num_distributed_optimizer_instances == 0 ? 1 : par.num_distributed_optimizer_instances;
  if (instances < 1) {
    v.Add("parallelism.num_distributed_optimizer_instances",
          absl::StrCat("must be >= 1 (0 or unset: 1), got ", instances));
  } else if (w_ok && w % instances != 0) {
    v.Add("parallelism.num_distributed_optimizer_instances",
          absl::StrCat(instances, " does not divide world_size ", w));
  }
  if (!par.outer_dp_sharding_strategy.empty()) {
    if (!ParseStrategy(par.outer_dp_sharding_strategy)) {
      v.Add("parallelism.outer_dp_sharding_strategy",
            absl::StrCat("unknown strategy ", Quote(par.outer_dp_sharding_strategy),
                         " (expected one of ", kStrategyNames, ")"));
    } else if (instances == 1) {
      v.Add("parallelism.outer_dp_sharding_strategy",
            absl::StrCat("set to ", Quote(par.outer_dp_sharding_strategy),
                         " but num_distributed_optimizer_instances is 1: the outer axis "
                         "exists only when it is > 1"));
    }
  }
  const int64_t ep = par.expert_model_parallel_size == 0 ? 1 : par.expert_model_parallel_size;
  if (ep < 1) {
    v.Add("parallelism.expert_model_parallel_size",
          absl::StrCat("must be >= 1 (0 or unset: 1), got ", ep));
  } else if (w_ok && w % ep != 0) {
    v.Add("parallelism.expert_model_parallel_size",
          absl::StrCat(ep, " does not divide world_size ", w));
  }
  CheckUnsupported(v, "tensor_model_parallel_size", "tensor parallelism",
                   par.tensor_model_parallel_size);
  CheckUnsupported(v, "pipeline_model_parallel_size", "pipeline parallelism",
                   par.pipeline_model_parallel_size);
  CheckUnsupported(v, "context_parallel_size", "context parallelism", par.context_parallel_size);
  return ep;
}

void CheckOptions(const PlanOptions& opt, Violations& v) {
  if (!opt.owner_assignment.empty() && !ParseOwnerRule(opt.owner_assignment)) {
    v.Add("options.owner_assignment",
          absl::StrCat("unknown rule ", Quote(opt.owner_assignment),
                       " (expected lpt, round_robin, allgather or greedy_in_order)"));
  }
  if (!opt.muon_replica_split.empty() && !ParseReplicaSplit(opt.muon_replica_split)) {
    v.Add("options.muon_replica_split",
          absl::StrCat("unknown value ", Quote(opt.muon_replica_split),
                       " (expected auto, on or off; empty or unset: auto)"));
  }
  if (opt.ns_steps < 0 || opt.ns_steps > kMaxNsSteps) {
    v.Add("options.ns_steps", absl::StrCat("must be in [1, ", kMaxNsSteps,
                                           "] (0 or unset: ", kDefaultNsSteps, "), got ", opt.ns_steps));
  }
  if (!opt.device.empty() && opt.device != "cpu" && opt.device != "cuda") {
    v.Add("options.device", absl::StrCat("unknown device ", Quote(opt.device),
                                         " (expected cpu or cuda; empty or unset: cuda)"));
  }
  if (NsTable table; !ParseNsTable(opt.ns_coefficients, &table)) {
    v.Add("options.ns_coefficients",
          absl::StrCat("unknown coefficients ", Quote(opt.ns_coefficients),
                       " (expected quintic or polar_express; empty or unset: quintic)"));
  }
  NsAlgorithm algorithm;
  if (!ParseNsAlgorithm(opt.ns_algorithm, &algorithm)) {
    v.Add("options.ns_algorithm",
          absl::StrCat("unknown form ", Quote(opt.ns_algorithm),
                       " (expected auto, standard, gram or spectral; empty or unset: auto)"));
  } else if (const char* why =
                 NsFormUnavailable(algorithm, opt.device.empty() ? "cuda" : opt.device)) {
    v.Add("options.ns_algorithm", why);
  } else if (NsTable table; algorithm == NsAlgorithm::kSpectral &&
                            ParseNsTable(opt.ns_coefficients, &table)) {
    const std::string gain = SpectralGainProblem(opt.ns_steps == 0 ? kDefaultNsSteps : opt.ns_steps, table);
    if (!gain.empty()) v.Add("options.ns_algorithm", gain);
  }
  if (opt.threads_per_rank < 0 || opt.threads_per_rank > kMaxThreadsPerRank) {
    v.Add("options.threads_per_rank",
          absl::StrCat("must be in [0, ", kMaxThreadsPerRank, "] (0 or unset: 1), got ",
                       opt.threads_per_rank));
  }
  if (opt.muon_wave_budget_bytes < 0) {
    v.Add("options.muon_wave_budget_bytes",
          absl::StrCat("must be >= 0 (0: one wave), got ", opt.muon_wave_budget_bytes));
  }
  if (!std::isfinite(opt.comm_flops_per_byte) || opt.comm_flops_per_byte < 0) {
    v.Add("options.comm_flops_per_byte",
          absl::StrCat("must be a finite number >= 0 (0 or unset: the device's default), got ",
                       opt.comm_flops_per_byte));
  }
}

// An explicit spectral form on a Muon matrix past LAPACK's size limit
// (kSpectralMaxShortSide; auto never picks it there): refused here, with the
// first such matrix named, rather than at the first optimizer step.
void CheckSpectralShapes(const PlanInput& in, std::vector<FieldViolation>& out) {
  NsAlgorithm algorithm;
  if (!ParseNsAlgorithm(in.options.ns_algorithm, &algorithm) ||
      algorithm != NsAlgorithm::kSpectral) {
    return;
  }
  int64_t too_large = 0;
  std::string first;
  for (size_t u = 0; u < in.model.units.size(); ++u) {
    const std::vector<ParamSpec>& params = in.model.units[u].params;
    for (size_t i = 0; i < params.size(); ++i) {
      if (params[i].optimizer != "muon") continue;
      const MatrixView mv = AsMatrix(params[i]);
      if (std::min(mv.rows, mv.cols) <= kSpectralMaxShortSide) continue;
      if (too_large++ == 0) {
        first = absl::StrCat(ParamPath{u, i}(), " (", Quote(params[i].name), ") is ", mv.rows,
                             " x ", mv.cols);
      }
    }
  }
  if (too_large == 0) return;
  out.push_back({"options.ns_algorithm",
                 absl::StrCat("spectral takes matrices whose short side is at most ",
                              kSpectralMaxShortSide, " (LAPACK's work size); ", first,
                              too_large > 1 ? absl::StrCat(" (and ", too_large - 1, " more)") : "",
                              ": use gram, standard or auto")});
}

}  // namespace

std::vector<FieldViolation> Validate(const PlanInput& in) {
  Violations v;
  const int64_t ep = CheckParallelism(in, v);
  CheckOptions(in.options, v);
  CheckModel(in.model, ep >= 1 ? ep : 0, v);
  std::vector<FieldViolation> out = v.Take();
  if (out.empty()) CheckSpectralShapes(in, out);
  if (out.empty()) CheckCopies(in, out);
  return out;
}

std::string Quote(absl::string_view text) {
  if (static_cast<int64_t>(text.size()) <= kMaxQuotedBytes) return absl::StrCat("'", text, "'");
  size_t cut = kMaxQuotedBytes;
  // Back up to the start of a UTF-8 sequence (never inside a character).
  while (cut > 0 && (static_cast<unsigned char>(text[cut]) & 0xC0) == 0x80) --cut;
  return absl::StrCat("'", text.substr(0, cut), "...' (", text.size(), " bytes)");
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
  if (!opt.muon_replica_split.empty()) {
    cfg.replica_split = *ParseReplicaSplit(opt.muon_replica_split);
  }
  cfg.ns_steps = opt.ns_steps == 0 ? kDefaultNsSteps : opt.ns_steps;
  ParseNsAlgorithm(opt.ns_algorithm, &cfg.ns_algorithm);
  ParseNsTable(opt.ns_coefficients, &cfg.ns_table);
  cfg.muon_wave_budget_bytes = opt.muon_wave_budget_bytes;
  cfg.threads_per_rank = std::max<int64_t>(1, opt.threads_per_rank);
  cfg.reshard_after_forward = opt.reshard_after_forward;
  // The Gram forms run on the CPU only (NsFormUnavailable): auto means
  // standard elsewhere.
  if (opt.device != "cpu") cfg.ns_algorithm = NsAlgorithm::kStandard;
  // FLOPs one byte of owner traffic is worth: Newton-Schulz throughput over
  // link bandwidth. H200 (~500 TFLOP/s bf16 effective) over a 400 Gb/s NIC
  // (50 GB/s) is ~1e4; a CPU core with OpenBLAS (~50 GFLOP/s) over Gloo on
  // loopback (~2 GB/s) is ~25, and a rank of T threads computes about T
  // times as fast (the products scale; ns_cost.h charges the spectral
  // form's eigensolver for not scaling) over the same link: 25 T.
  if (opt.comm_flops_per_byte > 0) {
    cfg.comm_flops_per_byte = opt.comm_flops_per_byte;
  } else {
    cfg.comm_flops_per_byte =
        opt.device == "cpu" ? 25.0 * static_cast<double>(cfg.threads_per_rank) : 1.0e4;
  }
  return cfg;
}

}  // namespace internal
}  // namespace muonmesh::plan

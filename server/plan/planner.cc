#include "server/plan/planner.h"

#include <algorithm>
#include <map>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "server/plan/layout.h"
#include "server/plan/mesh.h"
#include "server/plan/owners.h"
#include "server/plan/validate.h"

namespace muonmesh::plan {
namespace {

// The tensors of one unit as each mesh lays them out.
struct UnitTensors {
  std::vector<LayoutTensor> dense;
  std::vector<LayoutTensor> expert;
};

UnitTensors SplitUnit(const UnitSpec& unit, int64_t ep) {
  UnitTensors out;
  for (size_t i = 0; i < unit.params.size(); ++i) {
    const ParamSpec& p = unit.params[i];
    LayoutTensor t;
    t.param = static_cast<int32_t>(i);
    // An expert stack contributes its E/EP local experts, one after another.
    const int64_t copies = p.expert ? p.shape[0] / ep : 1;
    const int64_t numel = NumElements(p) / (p.expert ? p.shape[0] : 1);
    if (p.optimizer == "muon") {
      const MatrixView mv = AsMatrix(p);
      t.rows = copies * mv.rows;
      t.row_len = mv.cols;
    } else {
      t.rows = copies * numel;
      t.row_len = 1;
    }
    (p.expert ? out.expert : out.dense).push_back(t);
  }
  return out;
}

// Units of the same shapes (a model's repeated layers) share one layout.
class LayoutCache {
 public:
  const UnitLayout& Get(const std::vector<LayoutTensor>& tensors, int64_t num_shards) {
    std::vector<int64_t> key = {num_shards};
    for (const LayoutTensor& t : tensors) {
      key.insert(key.end(), {t.param, t.rows, t.row_len});
    }
    auto it = cache_.find(key);
    if (it == cache_.end()) {
      // Validated input: LayoutUnit cannot fail here.
      it = cache_.emplace(std::move(key), *LayoutUnit(tensors, num_shards)).first;
    }
    return it->second;
  }

 private:
  std::map<std::vector<int64_t>, UnitLayout> cache_;
};

// The Muon matrices of one unit's layout with their holders, positions in
// layout-shard order (before rotation).
std::vector<MatrixPlan> UnitMatrices(const UnitSpec& unit, int32_t u, const UnitLayout& layout,
                                     int64_t ns_steps, int64_t ep) {
  std::vector<std::vector<Holder>> held(layout.tensors.size());
  for (int64_t pos = 0; pos < layout.num_shards; ++pos) {
    for (int64_t s = layout.shard_begin[pos]; s < layout.shard_begin[pos + 1]; ++s) {
      const Segment& seg = layout.segments[s];
      held[seg.tensor].push_back(
          Holder{static_cast<int32_t>(pos), seg.row_start, seg.row_count});
    }
  }
  std::vector<MatrixPlan> out;
  for (size_t t = 0; t < layout.tensors.size(); ++t) {
    const ParamSpec& p = unit.params[layout.tensors[t].param];
    if (p.optimizer != "muon") continue;
    const MatrixView mv = AsMatrix(p);
    const int64_t experts = p.expert ? p.shape[0] / ep : 1;
    for (int64_t e = 0; e < experts; ++e) {
      MatrixPlan m;
      m.unit = u;
      m.param = layout.tensors[t].param;
      m.expert = p.expert ? static_cast<int32_t>(e) : -1;
      m.rows = mv.rows;
      m.cols = mv.cols;
      m.cost_flops = NewtonSchulzFlops(mv.rows, mv.cols, ns_steps);
      const int64_t lo = e * mv.rows;
      const int64_t hi = lo + mv.rows;
      for (const Holder& h : held[t]) {
        const int64_t a = std::max(lo, h.row_start);
        const int64_t b = std::min(hi, h.row_start + h.row_count);
        if (a < b) m.holders.push_back(Holder{h.position, a - lo, b - a});
      }
      out.push_back(std::move(m));
    }
  }
  return out;
}

// Picks each unit's rotation so that the Newton-Schulz work of repeated
// layers spreads over the domain instead of landing on the same positions
// layer after layer. Greedy over units in order: each matrix is charged to
// the shard holding most of its rows, and the rotation that keeps the busiest
// position lowest wins; ties go to the smallest rotation. Deterministic.
class RotationChooser {
 public:
  // `bytes_weight` is FLOPs per element of owner traffic charged with each
  // matrix (0: Newton-Schulz FLOPs only).
  RotationChooser(int64_t domain_size, double bytes_weight)
      : load_(domain_size, 0.0), bytes_weight_(bytes_weight) {}

  int64_t Choose(const std::vector<MatrixPlan>& matrices) {
    const int64_t d = static_cast<int64_t>(load_.size());
    std::vector<std::pair<int64_t, double>> charges;
    for (const MatrixPlan& m : matrices) {
      const Holder* best = nullptr;
      for (const Holder& h : m.holders) {
        if (best == nullptr || h.row_count > best->row_count) best = &h;
      }
      if (best == nullptr) continue;
      // The cost at the best holder: its Newton-Schulz work plus the rows
      // it must gather and scatter.
      const double traffic = 2.0 * static_cast<double>((m.rows - best->row_count) * m.cols);
      charges.push_back({best->position, m.cost_flops + bytes_weight_ * traffic});
    }
    if (charges.empty() || d == 1) return 0;
    const int64_t tried = std::min<int64_t>(d, kMaxCandidates);
    int64_t best_rotation = 0;
    double best_peak = 0;
    for (int64_t i = 0; i < tried; ++i) {
      const int64_t rotation = i * d / tried;
      double peak = 0;
      for (const auto& [shard, cost] : charges) {
        peak = std::max(peak, load_[(shard + rotation) % d] + cost);
      }
      if (i == 0 || peak < best_peak) {
        best_peak = peak;
        best_rotation = rotation;
      }
    }
    for (const auto& [shard, cost] : charges) load_[(shard + best_rotation) % d] += cost;
    return best_rotation;
  }

 private:
  static constexpr int64_t kMaxCandidates = 64;
  std::vector<double> load_;
  double bytes_weight_;
};

// Moves the matrices of a rotated layout into the domain, holders at their
// rotated positions (ascending).
void AppendRotated(std::vector<MatrixPlan> matrices, int64_t rotation, DomainPlan* d) {
  for (MatrixPlan& m : matrices) {
    for (Holder& h : m.holders) h.position = static_cast<int32_t>((h.position + rotation) % d->size);
    std::sort(m.holders.begin(), m.holders.end(),
              [](const Holder& a, const Holder& b) { return a.position < b.position; });
    d->matrices.push_back(std::move(m));
  }
}

// The owner plan of one mesh. Rotations come from a small portfolio of
// policies (charge Newton-Schulz FLOPs only; FLOPs plus the best holder's
// traffic; no rotation) and the plan with the lowest makespan wins, ties to
// the earlier policy. Sets each unit's rotation for that mesh.
DomainPlan PlanDomain(const ResolvedConfig& cfg, MeshKind mesh, int64_t domain_size,
                      const std::vector<std::vector<MatrixPlan>>& unit_matrices,
                      std::vector<UnitPlan>* units) {
  const double traffic_weight =
      cfg.comm_flops_per_byte * static_cast<double>(cfg.bytes_per_element);
  const std::vector<double> policies = {0.0, traffic_weight, -1.0};  // -1: no rotation
  DomainPlan best;
  std::vector<int64_t> best_rotations;
  for (size_t i = 0; i < policies.size(); ++i) {
    DomainPlan d;
    d.mesh = mesh;
    d.size = domain_size;
    std::vector<int64_t> rotations(unit_matrices.size(), 0);
    RotationChooser chooser(domain_size, std::max(0.0, policies[i]));
    for (size_t u = 0; u < unit_matrices.size(); ++u) {
      if (unit_matrices[u].empty()) continue;
      if (policies[i] >= 0) rotations[u] = chooser.Choose(unit_matrices[u]);
      AppendRotated(unit_matrices[u], rotations[u], &d);
    }
    AssignOwners(cfg.owner_rule, cfg.comm_flops_per_byte, cfg.bytes_per_element, &d);
    if (i == 0 || d.makespan < best.makespan) {
      best = std::move(d);
      best_rotations = std::move(rotations);
    }
    if (best.makespan <= best.lower_bound) break;  // cannot do better
  }
  for (size_t u = 0; u < units->size(); ++u) {
    UnitLayout& layout = mesh == MeshKind::kDense ? (*units)[u].dense : (*units)[u].expert;
    layout.rotation = best_rotations[u];
  }
  return best;
}

std::string AxisLabel(const MeshGeometry& g, const std::vector<int>& axes) {
  std::vector<std::string> names;
  for (int a : axes) names.push_back(g.axes()[a].name);
  return names.empty() ? "-" : absl::StrJoin(names, "+");
}

// Per-step bytes of the uniform collectives of one mesh. `buffer` is the
// padded flat buffer of all units (D * S summed), the same on every rank.
// `buffer`: the padded unit buffers of this mesh, summed; `regather`: the
// same weighted by each unit's gathers beyond the first.
void AddMeshCollectives(const MeshGeometry& g, int64_t buffer, int64_t regather, int64_t bpe,
                        std::vector<CollectiveBytes>* out) {
  const int64_t world = g.world_size();
  // `total_elems`: all ranks together, when per_rank_elems * world is not
  // exact (uneven chunks).
  auto add = [&](std::string name, std::string axis, int64_t per_rank_elems,
                 int64_t total_elems = -1) {
    if (per_rank_elems <= 0) return;
    CollectiveBytes c;
    c.name = std::move(name);
    c.mesh = g.kind();
    c.axis = std::move(axis);
    c.max_rank_bytes = per_rank_elems * bpe;
    c.bytes_per_step = (total_elems < 0 ? per_rank_elems * world : total_elems) * bpe;
    out->push_back(std::move(c));
  };
  const std::vector<int>& order = g.shard_order();
  std::vector<int> param_axes;
  std::vector<int> minor_axes;  // optimizer sharded, parameters replicated
  for (int a : order) {
    (g.axes()[a].placements.param == Placement::kShard ? param_axes : minor_axes).push_back(a);
  }
  const int64_t dp = g.param_shards();
  // Forward: gather parameters from their shards.
  add("param_allgather", AxisLabel(g, param_axes), (dp - 1) * (buffer / dp));
  // Backward, for units gathered again (FSDP's reshard after forward).
  add("param_allgather_backward", AxisLabel(g, param_axes), (dp - 1) * (regather / dp));
  // Backward: reduce-scatter down the shard order, all-reduce the replicas.
  int64_t m = buffer;
  for (int a : order) {
    const int64_t n = g.axes()[a].size;
    add("grad_reduce_scatter", g.axes()[a].name, (n - 1) * (m / n));
    m /= n;
  }
  for (size_t a = 0; a < g.axes().size(); ++a) {
    const MeshAxis& axis = g.axes()[a];
    if (axis.size > 1 && axis.placements.optimizer != Placement::kShard) {
      // Reduce-scatter then all-gather of n chunks, the chunks of a count
      // that n does not divide differing by one: 2 (n-1) m per group exactly;
      // a rank with a larger chunk sends up to n-2 more.
      const int64_t n = axis.size;
      add("grad_allreduce", axis.name, 2 * (n - 1) * m / n + (m % n == 0 ? 0 : n - 2),
          world / n * 2 * (n - 1) * m);
    }
  }
  // After the step: gather updated shards where parameters are replicated.
  const int64_t k = g.domain_size() / dp;
  add("param_allgather_after_step", AxisLabel(g, minor_axes), (k - 1) * m);
}

void AddMuonCollectives(const DomainPlan& d, int64_t domains, OwnerRule rule,
                        std::vector<CollectiveBytes>* out) {
  if (d.matrices.empty() || d.exchange_bytes == 0) return;
  const int64_t max_rank = *std::max_element(d.gather_bytes.begin(), d.gather_bytes.end());
  if (rule == OwnerRule::kAllGather) {
    out->push_back({"muon_allgather", d.mesh, "domain", d.exchange_bytes * domains, max_rank});
    return;
  }
  out->push_back({"muon_gather", d.mesh, "domain", d.exchange_bytes / 2 * domains, max_rank / 2});
  out->push_back({"muon_scatter", d.mesh, "domain", d.exchange_bytes / 2 * domains, max_rank / 2});
}

std::string DomainName(const MeshGeometry& g, int32_t first_rank, int64_t ep) {
  std::vector<std::string> fixed;
  if (g.kind() == MeshKind::kExpert && ep > 1) fixed.push_back(absl::StrCat("ep=", first_rank % ep));
  const std::vector<int>& order = g.shard_order();
  for (size_t a = 0; a < g.axes().size(); ++a) {
    const MeshAxis& axis = g.axes()[a];
    if (axis.size == 1 || std::find(order.begin(), order.end(), a) != order.end()) continue;
    int64_t coord;
    if (g.kind() == MeshKind::kExpert) {
      coord = first_rank / ep;
    } else {
      const int64_t inner = g.axes()[1].size;
      coord = a == 0 ? first_rank / inner : first_rank % inner;
    }
    fixed.push_back(absl::StrCat(axis.name, "=", coord));
  }
  return absl::StrCat(MeshName(g.kind()), fixed.empty() ? "" : "[",
                      absl::StrJoin(fixed, ","), fixed.empty() ? "" : "]");
}

}  // namespace

absl::StatusOr<Plan> ComputePlan(const PlanInput& input) {
  absl::StatusOr<ResolvedConfig> resolved = Resolve(input);
  if (!resolved.ok()) return resolved.status();
  Plan plan;
  plan.config = *resolved;
  const ResolvedConfig& cfg = plan.config;
  const MeshGeometry dense_g = MeshGeometry::Dense(cfg);
  const MeshGeometry expert_g = MeshGeometry::Expert(cfg);
  plan.dense_axes = dense_g.axes();
  plan.dense.mesh = MeshKind::kDense;
  plan.dense.size = dense_g.domain_size();
  plan.expert.mesh = MeshKind::kExpert;
  plan.expert.size = expert_g.domain_size();

  LayoutCache cache;
  // Matrices of each unit before rotation, per mesh.
  std::vector<std::vector<MatrixPlan>> dense_matrices(input.model.units.size());
  std::vector<std::vector<MatrixPlan>> expert_matrices(input.model.units.size());
  int64_t dense_buffer = 0;
  int64_t expert_buffer = 0;
  int64_t dense_regather = 0;
  int64_t expert_regather = 0;
  int64_t dense_shard = 0;
  int64_t expert_shard = 0;
  int64_t dense_padding = 0;
  int64_t expert_padding = 0;
  for (size_t u = 0; u < input.model.units.size(); ++u) {
    const UnitSpec& spec = input.model.units[u];
    for (const ParamSpec& p : spec.params) plan.parameters += NumElements(p);
    const UnitTensors tensors = SplitUnit(spec, cfg.ep);
    const int64_t regathers = std::max<int64_t>(spec.gathers_per_step, 1) - 1;
    UnitPlan unit;
    unit.name = spec.name;
    if (!tensors.dense.empty()) {
      unit.has_dense = true;
      unit.dense = cache.Get(tensors.dense, dense_g.domain_size());
      dense_matrices[u] =
          UnitMatrices(spec, static_cast<int32_t>(u), unit.dense, cfg.ns_steps, cfg.ep);
      dense_shard += unit.dense.shard_elements;
      dense_buffer += unit.dense.shard_elements * unit.dense.num_shards;
      dense_regather += regathers * unit.dense.shard_elements * unit.dense.num_shards;
      dense_padding += unit.dense.padding_elements;
    }
    if (!tensors.expert.empty()) {
      unit.has_expert = true;
      plan.has_experts = true;
      unit.expert = cache.Get(tensors.expert, expert_g.domain_size());
      expert_matrices[u] =
          UnitMatrices(spec, static_cast<int32_t>(u), unit.expert, cfg.ns_steps, cfg.ep);
      expert_shard += unit.expert.shard_elements;
      expert_buffer += unit.expert.shard_elements * unit.expert.num_shards;
      expert_regather += regathers * unit.expert.shard_elements * unit.expert.num_shards;
      // Every EP group lays out its own experts the same way.
      expert_padding += unit.expert.padding_elements * cfg.ep;
    }
    plan.units.push_back(std::move(unit));
  }
  plan.padding_elements = dense_padding + expert_padding;
  if (plan.has_experts) plan.expert_axes = expert_g.axes();

  const int64_t bpe = cfg.bytes_per_element;
  plan.dense = PlanDomain(cfg, MeshKind::kDense, dense_g.domain_size(), dense_matrices,
                          &plan.units);
  if (plan.has_experts) {
    plan.expert = PlanDomain(cfg, MeshKind::kExpert, expert_g.domain_size(), expert_matrices,
                             &plan.units);
  }

  // Domains: dense first, then expert.
  const int64_t world = cfg.world_size;
  const int64_t n_dense = dense_g.num_domains();
  const int64_t n_expert = plan.has_experts ? expert_g.num_domains() : 0;
  plan.domains.resize(n_dense + n_expert);
  for (int64_t i = 0; i < n_dense + n_expert; ++i) {
    Domain& dom = plan.domains[i];
    dom.id = static_cast<int32_t>(i);
    dom.mesh = i < n_dense ? MeshKind::kDense : MeshKind::kExpert;
    dom.ranks.assign(i < n_dense ? dense_g.domain_size() : expert_g.domain_size(), -1);
  }
  plan.ranks.resize(world);
  const int64_t dense_k_param = dense_g.domain_size() / dense_g.param_shards();
  const int64_t dense_k_grad = dense_g.domain_size() / dense_g.grad_shards();
  const int64_t expert_k_param = expert_g.domain_size() / expert_g.param_shards();
  const int64_t expert_k_grad = expert_g.domain_size() / expert_g.grad_shards();
  for (int32_t r = 0; r < world; ++r) {
    RankSummary& rs = plan.ranks[r];
    rs.rank = r;
    const int32_t dpos = dense_g.PositionOf(r);
    plan.domains[dense_g.DomainOf(r)].ranks[dpos] = r;
    rs.load_flops = plan.dense.load[dpos];
    rs.ns_flops = plan.dense.ns_flops[dpos];
    rs.gather_bytes = plan.dense.gather_bytes[dpos];
    rs.owned_matrices = plan.dense.owned[dpos];
    rs.shard_elements = dense_shard;
    rs.param_shard_elements = dense_shard * dense_k_param;
    rs.grad_shard_elements = dense_shard * dense_k_grad;
    if (plan.has_experts) {
      const int32_t epos = expert_g.PositionOf(r);
      plan.domains[n_dense + expert_g.DomainOf(r)].ranks[epos] = r;
      rs.load_flops += plan.expert.load[epos];
      rs.ns_flops += plan.expert.ns_flops[epos];
      rs.gather_bytes += plan.expert.gather_bytes[epos];
      rs.owned_matrices += plan.expert.owned[epos];
      rs.shard_elements += expert_shard;
      rs.param_shard_elements += expert_shard * expert_k_param;
      rs.grad_shard_elements += expert_shard * expert_k_grad;
    }
  }
  for (Domain& dom : plan.domains) {
    dom.name = DomainName(dom.mesh == MeshKind::kDense ? dense_g : expert_g, dom.ranks[0], cfg.ep);
  }

  AddMeshCollectives(dense_g, dense_buffer, dense_regather, bpe, &plan.collectives);
  AddMuonCollectives(plan.dense, n_dense, cfg.owner_rule, &plan.collectives);
  if (plan.has_experts) {
    AddMeshCollectives(expert_g, expert_buffer, expert_regather, bpe, &plan.collectives);
    AddMuonCollectives(plan.expert, n_expert, cfg.owner_rule, &plan.collectives);
  }
  return plan;
}

int64_t MegatronPaddingElements(const PlanInput& input) {
  absl::StatusOr<ResolvedConfig> cfg = Resolve(input);
  if (!cfg.ok()) return -1;
  const int64_t dense_d = MeshGeometry::Dense(*cfg).domain_size();
  const int64_t expert_d = MeshGeometry::Expert(*cfg).domain_size();
  int64_t padding = 0;
  for (const UnitSpec& unit : input.model.units) {
    const UnitTensors t = SplitUnit(unit, cfg->ep);
    if (!t.dense.empty()) padding += MegatronLcmPadding(t.dense, dense_d);
    if (!t.expert.empty()) padding += MegatronLcmPadding(t.expert, expert_d) * cfg->ep;
  }
  return padding;
}

}  // namespace muonmesh::plan

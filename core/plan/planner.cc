#include "core/plan/planner.h"

#include <algorithm>
#include <map>
#include <optional>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/plan/layout.h"
#include "core/plan/mesh.h"
#include "core/plan/owners.h"
#include "core/plan/plan_size.h"
#include "core/plan/validate.h"
#include "core/plan/waves.h"
#include "core/base/status_macros.h"

namespace muonmesh::plan {
namespace {

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
                                     const ResolvedConfig& cfg) {
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
    const MatrixView whole = AsMatrix(p);
    const int64_t blocks = MuonBlocksOf(p);
    const int64_t matrices = (p.expert ? p.shape[0] / cfg.ep : 1) * blocks;
    for (int64_t e = 0; e < matrices; ++e) {
      // Block e % blocks of expert e / blocks (blocks may alternate sizes).
      const MatrixRows block = MuonBlockRows(p, e % blocks);
      MatrixPlan m;
      m.unit = u;
      m.param = layout.tensors[t].param;
      m.expert = p.expert ? static_cast<int32_t>(e / blocks) : -1;
      m.row_offset = (e / blocks) * whole.rows + block.start;
      if (block.Strided()) {
        m.row_piece = block.piece;
        m.row_stride = block.stride;
      }
      m.rows = block.count;
      m.cols = whole.cols;
      m.ns_form = ChooseNsForm(cfg.ns_algorithm, m.rows, m.cols, cfg.ns_steps, cfg.ns_table,
                               cfg.threads_per_rank);
      m.cost_flops = NsFlops(m.ns_form, m.rows, m.cols, cfg.ns_steps, cfg.ns_table,
                             cfg.threads_per_rank);
      // A holder's tensor rows are one run of the matrix's rows, stacked
      // blocks included (MatrixRows::Among).
      const MatrixRows rows = m.TensorRows();
      for (const Holder& h : held[t]) {
        const RowRange r = rows.Among(h.row_start, h.row_start + h.row_count);
        if (r.count > 0) m.holders.push_back(Holder{h.position, r.start, r.count});
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

// The matrices of every unit of one mesh rotated by one policy of
// RotationChooser (`bytes_weight` < 0: no rotation), with the rotations.
// False when cancelled.
bool RotateUnits(const std::vector<std::vector<MatrixPlan>>& unit_matrices, double bytes_weight,
                 CancelToken* cancel, DomainPlan* d, std::vector<int64_t>* rotations) {
  rotations->assign(unit_matrices.size(), 0);
  RotationChooser chooser(d->size, std::max(0.0, bytes_weight));
  for (size_t u = 0; u < unit_matrices.size(); ++u) {
    if (unit_matrices[u].empty()) continue;
    if (bytes_weight >= 0) (*rotations)[u] = chooser.Choose(unit_matrices[u]);
    AppendRotated(unit_matrices[u], (*rotations)[u], d);
    if (cancel != nullptr && cancel->Tick(static_cast<int64_t>(unit_matrices[u].size()))) {
      return false;
    }
  }
  return true;
}

// Per position of one mesh's domains, the ranks at that position (one per
// domain, ascending).
std::vector<std::vector<int32_t>> RanksByPosition(const MeshGeometry& g) {
  std::vector<std::vector<int32_t>> out(g.domain_size());
  for (int32_t r = 0; r < g.world_size(); ++r) out[g.PositionOf(r)].push_back(r);
  return out;
}

// Whether the replicas of dp_outer can split the dense Muon work (types.h,
// ReplicaSplit): several optimizer instances on an outer axis that
// replicates the optimizer state (HSDP), and an owner rule (the allgather
// baseline orthogonalizes everything everywhere by definition).
bool SplitCanRun(const ResolvedConfig& cfg) {
  return cfg.instances > 1 && PlacementsOf(cfg.outer).optimizer == Placement::kReplicate &&
         cfg.owner_rule != OwnerRule::kAllGather;
}

// The index of a rank's entry in a dense domain plan's per-position vectors:
// its position, and with the replica split its replica's block before it.
int64_t DenseIndex(const DomainPlan& d, const MeshGeometry& g, int32_t rank) {
  const int64_t replica = d.replicas > 1 ? g.Coords(rank)[0] : 0;
  return replica * d.size + g.PositionOf(rank);
}

// The dense class of the replica split (types.h, DomainPlan): the I replica
// domains of one set of replicas as one class of I x D positions, position
// o * D + p standing for position p of replica o and run by the ranks there
// (one per set of replicas). A matrix is held at its positions in every
// replica (the replicas hold the same rows), so its owner cost at o * D + p
// is its cost at p, and it is assigned once per set: its owner's replica
// orthogonalizes it for all of them. Owners carry over from `dense` where it
// is split already (for the stronger bound).
struct SplitClass {
  DomainPlan plan;
  std::vector<std::vector<int32_t>> ranks;
};

SplitClass MakeSplitClass(const DomainPlan& dense, const MeshGeometry& g, int64_t instances) {
  const int64_t d = dense.size;
  SplitClass s;
  s.plan.mesh = MeshKind::kDense;
  s.plan.size = d * instances;
  s.plan.matrices.reserve(dense.matrices.size());
  for (const MatrixPlan& m : dense.matrices) {
    MatrixPlan x = m;
    x.holders.clear();
    for (int64_t o = 0; o < instances; ++o) {
      for (const Holder& h : m.holders) {
        x.holders.push_back({static_cast<int32_t>(o * d + h.position), h.row_start, h.row_count});
      }
    }
    x.owner = m.replica >= 0 ? static_cast<int32_t>(m.replica * d + m.owner) : -1;
    x.replica = -1;
    s.plan.matrices.push_back(std::move(x));
  }
  if (dense.replicas == instances) {
    s.plan.load = dense.load;
    s.plan.ns_flops = dense.ns_flops;
    s.plan.gather_bytes = dense.gather_bytes;
    s.plan.owned = dense.owned;
    s.plan.makespan = dense.makespan;
    s.plan.lower_bound = dense.lower_bound;
  }
  s.ranks.resize(s.plan.size);
  for (int32_t r = 0; r < g.world_size(); ++r) {
    s.ranks[g.Coords(r)[0] * d + g.PositionOf(r)].push_back(r);
  }
  return s;
}

// Folds the split class's assignment into the dense plan (holders at their
// positions in one replica; each matrix's owner position and replica; the
// per-(replica, position) vectors), then adds the replica exchange to the
// loads (ReplicaExchangeBytes times w) and sets the makespan from them.
void FoldSplit(DomainPlan&& split, int64_t instances, double w, int64_t bpe, DomainPlan* dense) {
  const int64_t d = dense->size;
  for (size_t j = 0; j < dense->matrices.size(); ++j) {
    MatrixPlan& m = dense->matrices[j];
    const MatrixPlan& x = split.matrices[j];
    m.owner = static_cast<int32_t>(x.owner % d);
    m.replica = static_cast<int32_t>(x.owner / d);
    m.owner_cost = x.owner_cost;
    m.gather_bytes = x.gather_bytes;
    m.min_cost = x.min_cost;
  }
  dense->replicas = instances;
  dense->load = std::move(split.load);
  dense->ns_flops = std::move(split.ns_flops);
  dense->gather_bytes = std::move(split.gather_bytes);
  dense->owned = std::move(split.owned);
  dense->lower_bound = split.lower_bound;
  dense->exchange_bytes = split.exchange_bytes;
  dense->exchange_lower_bound_bytes = split.exchange_lower_bound_bytes;
  dense->refine_work = split.refine_work;
  dense->refine_budget_spent = split.refine_budget_spent;
  const ReplicaExchange ex = ReplicaExchangeBytes(*dense, bpe);
  for (size_t i = 0; i < dense->load.size(); ++i) {
    dense->load[i] += w * static_cast<double>(ex.sent[i] + ex.recv[i]);
  }
  dense->makespan =
      dense->load.empty() ? 0 : *std::max_element(dense->load.begin(), dense->load.end());
}

// Bytes of the dense Muon matrices' rows each position holds.
std::vector<double> HeldBytes(const DomainPlan& dense, int64_t bpe) {
  std::vector<double> held(dense.size, 0.0);
  for (const MatrixPlan& m : dense.matrices) {
    for (const Holder& h : m.holders) {
      held[h.position] += static_cast<double>(h.row_count * m.cols * bpe);
    }
  }
  return held;
}

// Per rank, its replica exchange under the split as the assignment counts
// it, in flop-equivalents: the I ranks holding one shard send and receive,
// together, 2 (I - 1) x its rows of every dense Muon matrix, whichever
// replica orthogonalizes each (ReplicaExchangeBytes: I - 1 copies out of the
// orthogonalizing replica, one into each other), so each is charged the mean,
// w x 2 (I - 1) / I x its rows: exact for I = 2, and with I > 2 its share of
// an exact total and at most the exchange of the busiest of the I (so as
// lower bounds, the sum and the largest stand).
std::vector<double> SplitBaseLoad(const DomainPlan& dense, const MeshGeometry& g, double w,
                                  int64_t bpe, int64_t instances) {
  const std::vector<double> held = HeldBytes(dense, bpe);
  const double share = 2.0 * static_cast<double>(instances - 1) / static_cast<double>(instances);
  std::vector<double> base(g.world_size());
  for (int32_t r = 0; r < g.world_size(); ++r) base[r] = w * share * held[g.PositionOf(r)];
  return base;
}

// The ratio of joint makespan to joint lower bound above which the planner
// computes the stronger bound, and that bound's work budget.
constexpr double kStrongBoundAbove = 1.05;
constexpr int64_t kStrongBoundWork = int64_t{1} << 22;

// One mesh to plan owners on: its geometry and its units' matrices.
struct OwnerMesh {
  MeshKind kind;
  const MeshGeometry* geometry;
  const std::vector<std::vector<MatrixPlan>>* unit_matrices;
};

// Owner plans of every mesh: the domain plans, each unit's rotations, the
// joint makespan (the busiest rank's load over its domains) and the joint
// lower bound.
struct OwnerPlans {
  std::vector<DomainPlan> domains;
  std::vector<std::vector<int64_t>> rotations;
  double makespan = 0;
  double lower_bound = 0;
};

// The owner plans of every mesh, assigned jointly (AssignOwnersJointly: a
// rank's load is summed over both meshes, as the runtime's one Muon schedule
// runs them), with the dense mesh's replicas split (`split`: its class is
// the SplitClass, then folded back) or not. Rotations come from a small
// portfolio of policies, the same for every mesh (charge Newton-Schulz
// FLOPs only; FLOPs plus the best holder's traffic; no rotation), and the
// plan with the lowest joint makespan wins, ties to the earlier policy.
// Cancelled when `cancel` says so.
absl::StatusOr<OwnerPlans> PlanOwnersOnce(const ResolvedConfig& cfg,
                                          const std::vector<OwnerMesh>& meshes, bool split,
                                          CancelToken* cancel) {
  const double w = cfg.comm_flops_per_byte;
  const double traffic_weight = w * static_cast<double>(cfg.bytes_per_element);
  const std::vector<double> policies = {0.0, traffic_weight, -1.0};  // -1: no rotation
  const size_t n = meshes.size();
  std::vector<std::vector<std::vector<int32_t>>> ranks(n);
  for (size_t m = 0; m < n; ++m) ranks[m] = RanksByPosition(*meshes[m].geometry);
  OwnerPlans best;
  double lower_bound = 0;  // the first policy's, as the joint lower bound
  for (size_t i = 0; i < policies.size(); ++i) {
    OwnerPlans p;
    p.domains.resize(n);
    p.rotations.resize(n);
    std::vector<DomainClass> classes(n);
    std::optional<SplitClass> split_class;
    size_t split_mesh = n;
    for (size_t m = 0; m < n; ++m) {
      DomainPlan& d = p.domains[m];
      d.mesh = meshes[m].kind;
      d.size = meshes[m].geometry->domain_size();
      if (!RotateUnits(*meshes[m].unit_matrices, policies[i], cancel, &d, &p.rotations[m])) {
        return CancelToken::Status();
      }
      if (split && meshes[m].kind == MeshKind::kDense) {
        split_class = MakeSplitClass(d, *meshes[m].geometry, cfg.instances);
        split_mesh = m;
        classes[m] = DomainClass{&split_class->plan, split_class->ranks};
      } else {
        classes[m] = DomainClass{&d, ranks[m]};
      }
    }
    // Under the split every rank carries its replica exchange
    // (SplitBaseLoad): the assignment balances around it, and the bound
    // counts it.
    std::vector<double> base;
    if (split_class.has_value()) {
      base = SplitBaseLoad(p.domains[split_mesh], *meshes[split_mesh].geometry, w,
                           cfg.bytes_per_element, cfg.instances);
    }
    const std::vector<double>* base_load = base.empty() ? nullptr : &base;
    MUONMESH_ASSIGN_OR_RETURN(std::vector<double> loads,
                              AssignOwnersJointly(cfg.owner_rule, w, cfg.bytes_per_element,
                                                  cfg.world_size, classes, cancel, base_load));
    if (i == 0) lower_bound = JointLowerBound(cfg.world_size, classes, base_load);
    if (split_class.has_value()) {
      // The exact exchange joins the dense loads; the ranks' loads are
      // summed afresh from the folded plans.
      FoldSplit(std::move(split_class->plan), cfg.instances, w, cfg.bytes_per_element,
                &p.domains[split_mesh]);
      loads.assign(cfg.world_size, 0.0);
      for (size_t m = 0; m < n; ++m) {
        const std::vector<std::vector<int32_t>>& at =
            m == split_mesh ? split_class->ranks : ranks[m];
        for (size_t q = 0; q < at.size(); ++q) {
          for (int32_t r : at[q]) loads[r] += p.domains[m].load[q];
        }
      }
    }
    p.makespan = loads.empty() ? 0 : *std::max_element(loads.begin(), loads.end());
    if (i == 0 || p.makespan < best.makespan) best = std::move(p);
    if (best.makespan <= lower_bound) break;  // cannot do better
  }
  best.lower_bound = lower_bound;
  return best;
}

// The owner plans of every mesh (PlanOwnersOnce), with the replica split
// as the config rules (types.h, ReplicaSplit). The auto rule: plan both
// ways and split only when the split plan's joint makespan (its replica
// exchange's bytes counted at comm_flops_per_byte) is strictly shorter,
// since the split adds an exchange round. Sets each unit's rotations, the
// meshes' domain plans, the joint lower bound and both candidates'
// makespans. Cancelled when `cancel` says so.
absl::Status PlanOwners(const ResolvedConfig& cfg, const std::vector<OwnerMesh>& meshes,
                        CancelToken* cancel, Plan* plan) {
  const bool can_split = SplitCanRun(cfg);
  std::optional<OwnerPlans> unsplit;
  std::optional<OwnerPlans> split;
  if (!can_split || cfg.replica_split != ReplicaSplit::kOn) {
    MUONMESH_ASSIGN_OR_RETURN(OwnerPlans p, PlanOwnersOnce(cfg, meshes, /*split=*/false, cancel));
    unsplit = std::move(p);
  }
  if (can_split && cfg.replica_split != ReplicaSplit::kOff) {
    MUONMESH_ASSIGN_OR_RETURN(OwnerPlans p, PlanOwnersOnce(cfg, meshes, /*split=*/true, cancel));
    split = std::move(p);
  }
  plan->joint_makespan_unsplit = unsplit.has_value() ? unsplit->makespan : 0;
  plan->joint_makespan_split = split.has_value() ? split->makespan : 0;
  const bool use_split =
      split.has_value() && (!unsplit.has_value() || split->makespan < unsplit->makespan);
  OwnerPlans& best = use_split ? *split : *unsplit;
  plan->joint_lower_bound = best.lower_bound;
  for (size_t m = 0; m < meshes.size(); ++m) {
    for (size_t u = 0; u < plan->units.size(); ++u) {
      UnitPlan& unit = plan->units[u];
      (meshes[m].kind == MeshKind::kDense ? unit.dense : unit.expert).rotation =
          best.rotations[m][u];
    }
    (meshes[m].kind == MeshKind::kDense ? plan->dense : plan->expert) = std::move(best.domains[m]);
  }
  return absl::OkStatus();
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

// The Muon exchanges of one class of domains. With the replica split
// (d.replicas > 1) each set of I replica domains gathers every matrix once
// (d.exchange_bytes is the set's), and the replicas exchange their results
// over dp_outer (ReplicaExchangeBytes).
void AddMuonCollectives(const DomainPlan& d, int64_t domains, OwnerRule rule, int64_t bpe,
                        std::vector<CollectiveBytes>* out) {
  if (d.matrices.empty()) return;
  const int64_t sets = domains / std::max<int64_t>(d.replicas, 1);
  if (d.exchange_bytes > 0) {
    const int64_t max_rank = *std::max_element(d.gather_bytes.begin(), d.gather_bytes.end());
    if (rule == OwnerRule::kAllGather) {
      out->push_back({"muon_allgather", d.mesh, "domain", d.exchange_bytes * domains, max_rank});
      return;
    }
    out->push_back({"muon_gather", d.mesh, "domain", d.exchange_bytes / 2 * sets, max_rank / 2});
    out->push_back({"muon_scatter", d.mesh, "domain", d.exchange_bytes / 2 * sets, max_rank / 2});
  }
  if (d.replicas > 1) {
    const ReplicaExchange ex = ReplicaExchangeBytes(d, bpe);
    int64_t total = 0;
    for (int64_t b : ex.sent) total += b;
    const int64_t max_rank = *std::max_element(ex.sent.begin(), ex.sent.end());
    if (total > 0)
      out->push_back({"muon_replica_exchange", d.mesh, "dp_outer", total * sets, max_rank});
  }
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

// The units of one mesh as the planner needs them after layout: each unit's
// matrices (positions before rotation) and the buffer totals the collectives
// are computed from.
struct MeshUnits {
  std::vector<std::vector<MatrixPlan>> matrices;  // per unit of the model
  int64_t buffer = 0;    // padded unit buffers (D * S), summed
  int64_t regather = 0;  // the same, weighted by each unit's gathers beyond the first
  int64_t shard = 0;     // shard elements per position, all units
  int64_t padding = 0;   // in one domain
};

// Lays out one unit's tensors of one mesh and lists its matrices.
void AddUnit(const UnitSpec& spec, int32_t u, const std::vector<LayoutTensor>& tensors,
             int64_t domain_size, const ResolvedConfig& cfg, LayoutCache& cache,
             UnitLayout* layout, MeshUnits* mesh) {
  // Held gathered until its last use, a unit is gathered once a step.
  const int64_t regathers =
      cfg.reshard_after_forward ? std::max<int64_t>(spec.gathers_per_step, 1) - 1 : 0;
  *layout = cache.Get(tensors, domain_size);
  mesh->matrices[u] = UnitMatrices(spec, u, *layout, cfg);
  mesh->shard += layout->shard_elements;
  mesh->buffer += layout->shard_elements * layout->num_shards;
  mesh->regather += regathers * layout->shard_elements * layout->num_shards;
  mesh->padding += layout->padding_elements;
}

// Phase 1: every unit's layouts on both meshes, and its matrices. False
// when cancelled.
bool LayOutUnits(const PlanInput& input, const MeshGeometry& dense_g,
                 const MeshGeometry& expert_g, CancelToken* cancel, Plan* plan,
                 MeshUnits* dense, MeshUnits* expert) {
  const ResolvedConfig& cfg = plan->config;
  const size_t n_units = input.model.units.size();
  dense->matrices.resize(n_units);
  expert->matrices.resize(n_units);
  LayoutCache cache;
  for (size_t u = 0; u < n_units; ++u) {
    const UnitSpec& spec = input.model.units[u];
    for (const ParamSpec& p : spec.params) plan->parameters += NumElements(p);
    const UnitTensors tensors = SplitUnit(spec, cfg.ep);
    UnitPlan unit;
    unit.name = spec.name;
    const int32_t index = static_cast<int32_t>(u);
    if (!tensors.dense.empty()) {
      unit.has_dense = true;
      AddUnit(spec, index, tensors.dense, dense_g.domain_size(), cfg, cache, &unit.dense, dense);
    }
    if (!tensors.expert.empty()) {
      unit.has_expert = true;
      plan->has_experts = true;
      AddUnit(spec, index, tensors.expert, expert_g.domain_size(), cfg, cache, &unit.expert,
              expert);
    }
    plan->units.push_back(std::move(unit));
    // A unit's work grows with its tensors and the shards it is cut into.
    const int64_t work = static_cast<int64_t>(spec.params.size()) + dense_g.domain_size() +
                         (tensors.expert.empty() ? 0 : expert_g.domain_size());
    if (cancel != nullptr && cancel->Tick(work)) return false;
  }
  // Every EP group lays out its own experts the same way.
  plan->padding_elements = dense->padding + expert->padding * cfg.ep;
  return true;
}

// Adds one position of a domain class (its load at entry `at` of its
// per-position vectors, and its shards of every unit) to a rank's totals.
void AddPosition(const DomainPlan& d, int64_t at, int64_t shard, const MeshGeometry& g,
                 RankSummary* rs) {
  rs->load_flops += d.load[at];
  rs->ns_flops += d.ns_flops[at];
  rs->gather_bytes += d.gather_bytes[at];
  rs->owned_matrices += d.owned[at];
  rs->shard_elements += shard;
  rs->param_shard_elements += shard * (g.domain_size() / g.param_shards());
  rs->grad_shard_elements += shard * (g.domain_size() / g.grad_shards());
}

// Phase 3: the domains with their ranks, and each rank's totals.
void SummarizeRanks(const MeshGeometry& dense_g, const MeshGeometry& expert_g,
                    const MeshUnits& dense, const MeshUnits& expert, Plan* plan) {
  const ResolvedConfig& cfg = plan->config;
  const int64_t n_dense = dense_g.num_domains();
  const int64_t n_expert = plan->has_experts ? expert_g.num_domains() : 0;
  plan->domains.resize(n_dense + n_expert);
  for (int64_t i = 0; i < n_dense + n_expert; ++i) {
    Domain& dom = plan->domains[i];
    dom.id = static_cast<int32_t>(i);
    dom.mesh = i < n_dense ? MeshKind::kDense : MeshKind::kExpert;
    dom.ranks.assign(i < n_dense ? dense_g.domain_size() : expert_g.domain_size(), -1);
  }
  plan->ranks.resize(cfg.world_size);
  const ReplicaExchange ex = ReplicaExchangeBytes(plan->dense, cfg.bytes_per_element);
  for (int32_t r = 0; r < cfg.world_size; ++r) {
    RankSummary& rs = plan->ranks[r];
    rs.rank = r;
    const int32_t dpos = dense_g.PositionOf(r);
    plan->domains[dense_g.DomainOf(r)].ranks[dpos] = r;
    const int64_t at = DenseIndex(plan->dense, dense_g, r);
    AddPosition(plan->dense, at, dense.shard, dense_g, &rs);
    if (!ex.sent.empty()) rs.replica_exchange_bytes = ex.sent[at] + ex.recv[at];
    if (plan->has_experts) {
      const int32_t epos = expert_g.PositionOf(r);
      plan->domains[n_dense + expert_g.DomainOf(r)].ranks[epos] = r;
      AddPosition(plan->expert, epos, expert.shard, expert_g, &rs);
    }
  }
  for (Domain& dom : plan->domains) {
    dom.name =
        DomainName(dom.mesh == MeshKind::kDense ? dense_g : expert_g, dom.ranks[0], cfg.ep);
  }
}

// The joint makespan: the busiest rank's load summed over its domains (the
// rank summaries' load_flops), and its rank, the lowest among equals.
void SetJointMakespan(Plan* plan) {
  plan->joint_makespan = 0;
  plan->joint_critical_rank = 0;
  for (const RankSummary& r : plan->ranks) {
    if (r.load_flops > plan->joint_makespan) {
      plan->joint_makespan = r.load_flops;
      plan->joint_critical_rank = r.rank;
    }
  }
}

// Balances the owners of one wave's units (AssignOwnersJointly on those
// matrices alone, each mesh a class) and writes them into the plan. Under
// the replica split (`split`: the dense plan's SplitClass) the wave's dense
// matrices are assigned over its I x D positions, around the replica
// exchange of the wave's rows (SplitBaseLoad), and each gets its owner
// position and replica.
absl::Status BalanceWave(const ResolvedConfig& cfg, const MeshGeometry& dense_g,
                         const std::vector<std::vector<int32_t>>& dense_ranks,
                         const std::vector<std::vector<int32_t>>& expert_ranks,
                         const SplitClass* split, const MuonWave& wave, CancelToken* cancel,
                         Plan* plan) {
  std::vector<DomainPlan*> full = {&plan->dense};
  if (plan->has_experts) full.push_back(&plan->expert);
  std::vector<DomainPlan> part(full.size());
  std::vector<std::vector<size_t>> index(full.size());
  DomainPlan wave_dense;  // the wave's dense matrices as planned, for the exchange
  wave_dense.size = plan->dense.size;
  for (size_t k = 0; k < full.size(); ++k) {
    const bool split_here = k == 0 && split != nullptr;
    const DomainPlan& from = split_here ? split->plan : *full[k];
    part[k].mesh = from.mesh;
    part[k].size = from.size;
    for (size_t j = 0; j < from.matrices.size(); ++j) {
      const MatrixPlan& m = from.matrices[j];
      if (m.unit < wave.first_unit || m.unit >= wave.end_unit) continue;
      part[k].matrices.push_back(m);
      part[k].matrices.back().owner = -1;  // AssignOwnersJointly takes them unassigned
      index[k].push_back(j);
      if (split_here) wave_dense.matrices.push_back(full[k]->matrices[j]);
    }
  }
  std::vector<DomainClass> classes;
  for (size_t k = 0; k < full.size(); ++k) {
    if (part[k].matrices.empty()) continue;
    const bool dense = full[k]->mesh == MeshKind::kDense;
    classes.push_back(
        {&part[k], dense ? (split != nullptr ? split->ranks : dense_ranks) : expert_ranks});
  }
  if (classes.empty()) return absl::OkStatus();
  std::vector<double> base;
  if (!wave_dense.matrices.empty()) {
    base = SplitBaseLoad(wave_dense, dense_g, cfg.comm_flops_per_byte, cfg.bytes_per_element,
                         cfg.instances);
  }
  MUONMESH_ASSIGN_OR_RETURN(
      std::vector<double> loads,
      AssignOwnersJointly(cfg.owner_rule, cfg.comm_flops_per_byte, cfg.bytes_per_element,
                          cfg.world_size, classes, cancel, base.empty() ? nullptr : &base));
  const int64_t d = plan->dense.size;
  for (size_t k = 0; k < full.size(); ++k) {
    for (size_t i = 0; i < index[k].size(); ++i) {
      MatrixPlan& m = full[k]->matrices[index[k][i]];
      const int32_t owner = part[k].matrices[i].owner;
      if (k == 0 && split != nullptr) {
        m.owner = static_cast<int32_t>(owner % d);
        m.replica = static_cast<int32_t>(owner / d);
      } else {
        m.owner = owner;
      }
    }
  }
  return absl::OkStatus();
}

// The dense plan's loads from its owners under the replica split: summed
// over the split class's positions and folded back with the exchange
// (FoldSplit), keeping what the assignment had recorded besides.
void SumSplitLoads(const ResolvedConfig& cfg, const MeshGeometry& dense_g, DomainPlan* dense) {
  const int64_t exchange_lower_bound = dense->exchange_lower_bound_bytes;
  const int64_t refine_work = dense->refine_work;
  const bool refine_budget_spent = dense->refine_budget_spent;
  SplitClass s = MakeSplitClass(*dense, dense_g, dense->replicas);
  SumOwnerLoads(cfg.comm_flops_per_byte, cfg.bytes_per_element, &s.plan);
  FoldSplit(std::move(s.plan), dense->replicas, cfg.comm_flops_per_byte, cfg.bytes_per_element,
            dense);
  dense->exchange_lower_bound_bytes = exchange_lower_bound;
  dense->refine_work = refine_work;
  dense->refine_budget_spent = refine_budget_spent;
}

// With a wave budget (PlanOptions::muon_wave_budget_bytes) the runtime cuts
// the Muon phase into waves (plan/waves.h), and the critical path is the
// sum over waves of each wave's busiest rank: the owners are balanced again
// wave by wave (BalanceWave) and the cut made again from the new owners
// (what a position must hold depends on what it owns), until the cut holds
// or kWaveRounds have run; the runtime cuts the final plan the same way.
// lpt only; under the replica split each wave's dense matrices are split
// between the replicas anew.
absl::Status BalanceWaves(const ResolvedConfig& cfg, const MeshGeometry& dense_g,
                          const MeshGeometry& expert_g, CancelToken* cancel, Plan* plan) {
  constexpr int kWaveRounds = 4;
  if (cfg.muon_wave_budget_bytes <= 0 || cfg.owner_rule != OwnerRule::kLpt) {
    return absl::OkStatus();
  }
  auto same_cut = [](const std::vector<MuonWave>& a, const std::vector<MuonWave>& b) {
    return std::equal(a.begin(), a.end(), b.begin(), b.end(),
                      [](const MuonWave& x, const MuonWave& y) {
                        return x.first_unit == y.first_unit && x.end_unit == y.end_unit;
                      });
  };
  const std::vector<std::vector<int32_t>> dense_ranks = RanksByPosition(dense_g);
  const std::vector<std::vector<int32_t>> expert_ranks =
      plan->has_experts ? RanksByPosition(expert_g) : std::vector<std::vector<int32_t>>{};
  std::optional<SplitClass> split;  // its holders and ranks; owners come from the plan
  if (plan->dense.replicas > 1) split = MakeSplitClass(plan->dense, dense_g, plan->dense.replicas);
  const SplitClass* split_class = split.has_value() ? &*split : nullptr;
  std::vector<MuonWave> balanced;
  for (int round = 0; round < kWaveRounds; ++round) {
    const std::vector<MuonWave> waves = PlanMuonWaves(*plan, cfg.muon_wave_budget_bytes);
    if (waves.size() <= 1 || same_cut(waves, balanced)) break;
    for (const MuonWave& wave : waves) {
      MUONMESH_RETURN_IF_ERROR(BalanceWave(cfg, dense_g, dense_ranks, expert_ranks, split_class,
                                           wave, cancel, plan));
    }
    balanced = waves;
  }
  if (balanced.empty()) return absl::OkStatus();
  if (split_class != nullptr) {
    SumSplitLoads(cfg, dense_g, &plan->dense);
  } else {
    SumOwnerLoads(cfg.comm_flops_per_byte, cfg.bytes_per_element, &plan->dense);
  }
  if (plan->has_experts) {
    SumOwnerLoads(cfg.comm_flops_per_byte, cfg.bytes_per_element, &plan->expert);
  }
  return absl::OkStatus();
}

// Where the joint makespan is over 1.05 x the joint lower bound, a stronger
// certified bound (StrongJointLowerBound) says whether the plan or the bound
// is loose; elsewhere the joint bound stands. Cancelled when `cancel` says.
absl::Status SetStrongBound(const MeshGeometry& dense_g, const MeshGeometry& expert_g,
                            CancelToken* cancel, Plan* plan) {
  plan->joint_strong_lower_bound = plan->joint_lower_bound;
  if (plan->joint_makespan <= kStrongBoundAbove * plan->joint_lower_bound) {
    return absl::OkStatus();
  }
  std::optional<SplitClass> split;
  std::vector<DomainClass> classes = {{&plan->dense, RanksByPosition(dense_g)}};
  if (plan->dense.replicas > 1) {
    split = MakeSplitClass(plan->dense, dense_g, plan->dense.replicas);
    classes[0] = {&split->plan, split->ranks};
  }
  if (plan->has_experts) classes.push_back({&plan->expert, RanksByPosition(expert_g)});
  const ResolvedConfig& cfg = plan->config;
  // Under the replica split every rank also sends or receives each row of
  // its shard over dp_outer at least once, whoever owns what (its rows of
  // its replica's matrices go out, the others' come in:
  // ReplicaExchangeBytes), so the least such exchange of any position joins
  // the classes' bound.
  double least_exchange = 0;
  if (split.has_value()) {
    const std::vector<double> held = HeldBytes(plan->dense, cfg.bytes_per_element);
    least_exchange = cfg.comm_flops_per_byte * *std::min_element(held.begin(), held.end());
  }
  const double strong =
      least_exchange + StrongJointLowerBound(cfg.comm_flops_per_byte, cfg.bytes_per_element,
                                             cfg.world_size, classes, kStrongBoundWork, cancel);
  plan->joint_strong_lower_bound =
      std::max(plan->joint_lower_bound, std::min(plan->joint_makespan, strong));
  if (cancel != nullptr && cancel->cancelled()) return CancelToken::Status();
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<Plan> ComputePlan(const PlanInput& input) { return ComputePlan(input, nullptr); }

absl::StatusOr<Plan> ComputePlan(const PlanInput& input, CancelToken* cancel) {
  MUONMESH_ASSIGN_OR_RETURN(ResolvedConfig resolved, Resolve(input));
  // Sized before anything is built, so that too big a plan costs little.
  MUONMESH_ASSIGN_OR_RETURN(PlanSize size, EstimatePlanSize(input, cancel));
  if (const std::vector<FieldViolation> v = PlanSizeViolations(size); !v.empty()) {
    return absl::InvalidArgumentError(
        absl::StrJoin(v, "; ", [](std::string* out, const FieldViolation& f) {
          absl::StrAppend(out, f.field, ": ", f.description);
        }));
  }
  Plan plan;
  plan.config = resolved;
  const ResolvedConfig& cfg = plan.config;
  const MeshGeometry dense_g = MeshGeometry::Dense(cfg);
  const MeshGeometry expert_g = MeshGeometry::Expert(cfg);
  plan.dense_axes = dense_g.axes();

  MeshUnits dense;
  MeshUnits expert;
  if (!LayOutUnits(input, dense_g, expert_g, cancel, &plan, &dense, &expert)) {
    return CancelToken::Status();
  }
  if (plan.has_experts) plan.expert_axes = expert_g.axes();

  plan.expert.mesh = MeshKind::kExpert;
  plan.expert.size = expert_g.domain_size();
  std::vector<OwnerMesh> meshes = {{MeshKind::kDense, &dense_g, &dense.matrices}};
  if (plan.has_experts) meshes.push_back({MeshKind::kExpert, &expert_g, &expert.matrices});
  MUONMESH_RETURN_IF_ERROR(PlanOwners(cfg, meshes, cancel, &plan));
  MUONMESH_RETURN_IF_ERROR(BalanceWaves(cfg, dense_g, expert_g, cancel, &plan));
  dense.matrices.clear();
  expert.matrices.clear();

  SummarizeRanks(dense_g, expert_g, dense, expert, &plan);
  SetJointMakespan(&plan);
  MUONMESH_RETURN_IF_ERROR(SetStrongBound(dense_g, expert_g, cancel, &plan));
  const int64_t bpe = cfg.bytes_per_element;
  AddMeshCollectives(dense_g, dense.buffer, dense.regather, bpe, &plan.collectives);
  AddMuonCollectives(plan.dense, dense_g.num_domains(), cfg.owner_rule, bpe, &plan.collectives);
  if (plan.has_experts) {
    AddMeshCollectives(expert_g, expert.buffer, expert.regather, bpe, &plan.collectives);
    AddMuonCollectives(plan.expert, expert_g.num_domains(), cfg.owner_rule, bpe, &plan.collectives);
  }
  return plan;
}

absl::StatusOr<int64_t> MegatronPaddingElements(const PlanInput& input) {
  MUONMESH_ASSIGN_OR_RETURN(ResolvedConfig cfg, Resolve(input));
  const int64_t dense_d = MeshGeometry::Dense(cfg).domain_size();
  const int64_t expert_d = MeshGeometry::Expert(cfg).domain_size();
  int64_t padding = 0;
  for (const UnitSpec& unit : input.model.units) {
    const UnitTensors t = SplitUnit(unit, cfg.ep);
    if (!t.dense.empty()) padding += MegatronLcmPadding(t.dense, dense_d);
    if (!t.expert.empty()) padding += MegatronLcmPadding(t.expert, expert_d) * cfg.ep;
  }
  return padding;
}

}  // namespace muonmesh::plan

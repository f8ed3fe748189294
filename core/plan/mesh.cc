#include "core/plan/mesh.h"

#include <algorithm>
#include <array>

namespace muonmesh::plan {
namespace {

struct StrategyRow {
  Strategy strategy;
  std::string_view name;
  AxisPlacements placements;
};

constexpr Placement kR = Placement::kReplicate;
constexpr Placement kS = Placement::kShard;
constexpr Placement kP = Placement::kPartialAvg;

// docs/architecture.md §3: (parameter, gradient, optimizer state) per strategy.
constexpr std::array<StrategyRow, 4> kStrategies = {{
    {Strategy::kNoShard, "no_shard", {kR, kP, kR}},
    {Strategy::kOptim, "optim", {kR, kP, kS}},
    {Strategy::kOptimGrads, "optim_grads", {kR, kS, kS}},
    {Strategy::kOptimGradsParams, "optim_grads_params", {kS, kS, kS}},
}};

constexpr std::array<std::pair<OwnerRule, std::string_view>, 4> kOwnerRules = {{
    {OwnerRule::kLpt, "lpt"},
    {OwnerRule::kRoundRobin, "round_robin"},
    {OwnerRule::kAllGather, "allgather"},
    {OwnerRule::kGreedyInOrder, "greedy_in_order"},
}};

// Nesting category of an optimizer-sharded axis: 0 if parameters are sharded
// there too, 1 if gradients are, 2 if only the optimizer state is.
int NestCategory(const AxisPlacements& p) {
  if (p.param == Placement::kShard) return 0;
  if (p.grad == Placement::kShard) return 1;
  return 2;
}

}  // namespace

std::optional<Strategy> ParseStrategy(std::string_view name) {
  for (const auto& row : kStrategies) {
    if (row.name == name) return row.strategy;
  }
  return std::nullopt;
}

std::string StrategyName(Strategy s) {
  return std::string(kStrategies[static_cast<int>(s)].name);
}

AxisPlacements PlacementsOf(Strategy s) {
  return kStrategies[static_cast<int>(s)].placements;
}

std::string PlacementName(Placement p) {
  switch (p) {
    case Placement::kReplicate:
      return "Replicate";
    case Placement::kShard:
      return "Shard";
    case Placement::kPartialAvg:
      return "Partial(avg)";
  }
  return "?";
}

std::string MeshName(MeshKind m) {
  return m == MeshKind::kDense ? "dense" : "expert";
}

std::optional<OwnerRule> ParseOwnerRule(std::string_view name) {
  for (const auto& [rule, rule_name] : kOwnerRules) {
    if (rule_name == name) return rule;
  }
  return std::nullopt;
}

std::string OwnerRuleName(OwnerRule r) {
  return std::string(kOwnerRules[static_cast<int>(r)].second);
}

std::optional<ReplicaSplit> ParseReplicaSplit(std::string_view name) {
  if (name == "auto") return ReplicaSplit::kAuto;
  if (name == "on") return ReplicaSplit::kOn;
  if (name == "off") return ReplicaSplit::kOff;
  return std::nullopt;
}

std::string ReplicaSplitName(ReplicaSplit s) {
  switch (s) {
    case ReplicaSplit::kAuto:
      return "auto";
    case ReplicaSplit::kOn:
      return "on";
    case ReplicaSplit::kOff:
      return "off";
  }
  return "?";
}

namespace {

MeshAxis MakeAxis(std::string name, int64_t size, Strategy s) {
  MeshAxis axis;
  axis.name = std::move(name);
  axis.size = size;
  axis.strategy = s;
  axis.placements = PlacementsOf(s);
  return axis;
}

}  // namespace

MeshGeometry MeshGeometry::Dense(const ResolvedConfig& config) {
  MeshGeometry g;
  g.kind_ = MeshKind::kDense;
  g.world_size_ = config.world_size;
  g.groups_ = 1;
  const int64_t inner = config.world_size / config.instances;
  // The outer axis always exists (size 1 when I == 1) so that coordinates
  // are (outer, inner) as in arange(W).reshape(I, W/I).
  g.axes_.push_back(MakeAxis("dp_outer", config.instances,
                             config.instances > 1 ? config.outer : Strategy::kNoShard));
  g.axes_.push_back(MakeAxis("dp_shard", inner, config.inner));
  g.shard_order_.clear();
  for (int a = 0; a < static_cast<int>(g.axes_.size()); ++a) {
    if (g.axes_[a].placements.optimizer == Placement::kShard && g.axes_[a].size > 1) {
      g.shard_order_.push_back(a);
    }
  }
  // Major first: by nesting category, inner (higher index) before outer.
  std::stable_sort(g.shard_order_.begin(), g.shard_order_.end(), [&](int a, int b) {
    const int ca = NestCategory(g.axes_[a].placements);
    const int cb = NestCategory(g.axes_[b].placements);
    if (ca != cb) return ca < cb;
    return a > b;
  });
  for (int a : g.shard_order_) {
    const MeshAxis& axis = g.axes_[a];
    g.domain_size_ *= axis.size;
    if (axis.placements.param == Placement::kShard) g.param_shards_ *= axis.size;
    if (axis.placements.grad == Placement::kShard) g.grad_shards_ *= axis.size;
  }
  return g;
}

MeshGeometry MeshGeometry::Expert(const ResolvedConfig& config) {
  MeshGeometry g;
  g.kind_ = MeshKind::kExpert;
  g.world_size_ = config.world_size;
  g.groups_ = config.ep;
  g.axes_.push_back(MakeAxis("expert_dp", config.world_size / config.ep, config.inner));
  const MeshAxis& axis = g.axes_[0];
  if (axis.placements.optimizer == Placement::kShard && axis.size > 1) {
    g.shard_order_.push_back(0);
    g.domain_size_ = axis.size;
    if (axis.placements.param == Placement::kShard) g.param_shards_ = axis.size;
    if (axis.placements.grad == Placement::kShard) g.grad_shards_ = axis.size;
  }
  return g;
}

std::vector<int64_t> MeshGeometry::Coords(int32_t rank) const {
  if (kind_ == MeshKind::kDense) {
    const int64_t inner = axes_[1].size;
    return {rank / inner, rank % inner};
  }
  return {rank / groups_};
}

int32_t MeshGeometry::GroupOf(int32_t rank) const {
  return static_cast<int32_t>(rank % groups_);
}

int32_t MeshGeometry::PositionOf(int32_t rank) const {
  const std::vector<int64_t> c = Coords(rank);
  int64_t pos = 0;
  for (int a : shard_order_) pos = pos * axes_[a].size + c[a];
  return static_cast<int32_t>(pos);
}

int32_t MeshGeometry::DomainOf(int32_t rank) const {
  const std::vector<int64_t> c = Coords(rank);
  int64_t dom = GroupOf(rank);
  for (int a = 0; a < static_cast<int>(axes_.size()); ++a) {
    if (std::find(shard_order_.begin(), shard_order_.end(), a) != shard_order_.end()) continue;
    dom = dom * axes_[a].size + c[a];
  }
  return static_cast<int32_t>(dom);
}

}  // namespace muonmesh::plan

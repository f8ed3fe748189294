#pragma once

// The parallelism vocabulary (strategies, placements) and the geometry of the
// dense ("dp_outer", "dp_shard") and expert ("expert_dp",) meshes: which
// ranks form each optimizer-shard domain and how shards nest inside it.

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "core/plan/types.h"

namespace muonmesh::plan {

std::optional<Strategy> ParseStrategy(std::string_view name);
std::string StrategyName(Strategy s);
std::string PlacementName(Placement p);
std::string MeshName(MeshKind m);
std::optional<OwnerRule> ParseOwnerRule(std::string_view name);
std::string OwnerRuleName(OwnerRule r);
// "auto" | "on" | "off" (types.h, ReplicaSplit).
std::optional<ReplicaSplit> ParseReplicaSplit(std::string_view name);
std::string ReplicaSplitName(ReplicaSplit s);

// The per-axis placement table of docs/architecture.md §3.
AxisPlacements PlacementsOf(Strategy s);

// Geometry of one mesh. Dense: rank r sits at (r / (W/I), r % (W/I)).
// Expert: rank r is in EP group r % EP at expert_dp coordinate r / EP (EP
// ranks are adjacent, as in Megatron), and the expert_dp axis takes the inner
// strategy; experts never get an outer axis.
//
// A domain is the set of ranks that split one copy of the optimizer state:
// ranks sharing their coordinates on every axis where the optimizer state is
// replicated (and, for experts, their EP group). Inside a domain, the
// position orders the optimizer-sharded axes major to minor as: axes where
// parameters are sharded, then where gradients are, then the rest (inner
// before outer on ties). Hence every parameter shard and gradient shard is a
// contiguous run of optimizer shards: HFSDP's optimizer shard of rank (o, i)
// is piece o of the inner parameter shard i.
//
// Immutable after construction; safe to share between threads.
class MeshGeometry {
 public:
  static MeshGeometry Dense(const ResolvedConfig& config);
  static MeshGeometry Expert(const ResolvedConfig& config);

  MeshKind kind() const { return kind_; }
  const std::vector<MeshAxis>& axes() const { return axes_; }
  int64_t world_size() const { return world_size_; }

  // D: optimizer shards per domain (= shards of every unit buffer).
  int64_t domain_size() const { return domain_size_; }
  int64_t num_domains() const { return world_size_ / domain_size_; }
  // Distinct parameter / gradient shards inside a domain; a parameter shard
  // is domain_size() / param_shards() consecutive optimizer shards.
  int64_t param_shards() const { return param_shards_; }
  int64_t grad_shards() const { return grad_shards_; }

  int32_t DomainOf(int32_t rank) const;
  int32_t PositionOf(int32_t rank) const;
  // EP group of a rank (0 on the dense mesh).
  int32_t GroupOf(int32_t rank) const;

  // Axes where the optimizer state is sharded, major first.
  const std::vector<int>& shard_order() const { return shard_order_; }

  // Coordinates of a rank, one per axis (the EP group is GroupOf).
  std::vector<int64_t> Coords(int32_t rank) const;

 private:
  MeshKind kind_ = MeshKind::kDense;
  int64_t world_size_ = 1;
  int64_t groups_ = 1;  // EP for the expert mesh, 1 for dense
  std::vector<MeshAxis> axes_;
  std::vector<int> shard_order_;
  int64_t domain_size_ = 1;
  int64_t param_shards_ = 1;
  int64_t grad_shards_ = 1;
};

}  // namespace muonmesh::plan

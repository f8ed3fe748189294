#include "core/plan/mesh.h"

#include <set>

#include "gtest/gtest.h"

namespace muonmesh::plan {
namespace {

constexpr Placement R = Placement::kReplicate;
constexpr Placement S = Placement::kShard;
constexpr Placement P = Placement::kPartialAvg;

struct TableRow {
  const char* name;
  Placement param, grad, optimizer;
};

// The table of docs/architecture.md §3, typed in from it.
TEST(MeshTest, PlacementTableMatchesDesign) {
  const TableRow rows[] = {
      {"no_shard", R, P, R},
      {"optim", R, P, S},
      {"optim_grads", R, S, S},
      {"optim_grads_params", S, S, S},
  };
  for (const TableRow& row : rows) {
    std::optional<Strategy> s = ParseStrategy(row.name);
    ASSERT_TRUE(s.has_value()) << row.name;
    EXPECT_EQ(StrategyName(*s), row.name);
    const AxisPlacements p = PlacementsOf(*s);
    EXPECT_EQ(p.param, row.param) << row.name;
    EXPECT_EQ(p.grad, row.grad) << row.name;
    EXPECT_EQ(p.optimizer, row.optimizer) << row.name;
  }
  EXPECT_FALSE(ParseStrategy("zero3").has_value());
}

ResolvedConfig Config(int64_t w, int64_t i, Strategy inner, Strategy outer, int64_t ep = 1) {
  ResolvedConfig c;
  c.world_size = w;
  c.instances = i;
  c.inner = inner;
  c.outer = outer;
  c.ep = ep;
  return c;
}

TEST(MeshTest, HsdpDomainsAreTheInnerRows) {
  // HSDP: no_shard outer over ZeRO-3 inner, W = 8, I = 2: optimizer
  // placements (Replicate, Shard); rank r sits at (r / 4, r % 4) and the
  // domains are the rows {0..3}, {4..7}.
  const MeshGeometry g =
      MeshGeometry::Dense(Config(8, 2, Strategy::kOptimGradsParams, Strategy::kNoShard));
  ASSERT_EQ(g.axes().size(), 2u);
  EXPECT_EQ(g.axes()[0].name, "dp_outer");
  EXPECT_EQ(g.axes()[0].size, 2);
  EXPECT_EQ(g.axes()[1].name, "dp_shard");
  EXPECT_EQ(g.axes()[1].size, 4);
  EXPECT_EQ(g.axes()[0].placements.optimizer, R);
  EXPECT_EQ(g.axes()[1].placements.optimizer, S);
  EXPECT_EQ(g.domain_size(), 4);
  EXPECT_EQ(g.num_domains(), 2);
  for (int r = 0; r < 8; ++r) {
    EXPECT_EQ(g.DomainOf(r), r / 4) << r;
    EXPECT_EQ(g.PositionOf(r), r % 4) << r;
  }
}

TEST(MeshTest, HfsdpShardsOptimizerOverTheFlattenedDomain) {
  // HFSDP: optim outer over ZeRO-3 inner: optimizer (Shard, Shard) over all
  // 8 ranks, parameters sharded on the inner axis only. The optimizer shard
  // of (o, i) is piece o of parameter shard i: position i * I + o.
  const MeshGeometry g =
      MeshGeometry::Dense(Config(8, 2, Strategy::kOptimGradsParams, Strategy::kOptim));
  EXPECT_EQ(g.axes()[0].placements.optimizer, S);
  EXPECT_EQ(g.axes()[1].placements.optimizer, S);
  EXPECT_EQ(g.axes()[0].placements.param, R);
  EXPECT_EQ(g.domain_size(), 8);
  EXPECT_EQ(g.num_domains(), 1);
  EXPECT_EQ(g.param_shards(), 4);
  std::set<int> positions;
  for (int r = 0; r < 8; ++r) {
    const int o = r / 4;
    const int i = r % 4;
    EXPECT_EQ(g.DomainOf(r), 0);
    EXPECT_EQ(g.PositionOf(r), i * 2 + o) << r;
    // Parameter shard = position / (D / param_shards) = the inner index.
    EXPECT_EQ(g.PositionOf(r) / (g.domain_size() / g.param_shards()), i);
    positions.insert(g.PositionOf(r));
  }
  EXPECT_EQ(positions.size(), 8u);
}

TEST(MeshTest, DdpGivesEveryRankItsOwnDomain) {
  const MeshGeometry g = MeshGeometry::Dense(Config(6, 1, Strategy::kNoShard, Strategy::kNoShard));
  EXPECT_EQ(g.domain_size(), 1);
  EXPECT_EQ(g.num_domains(), 6);
  for (int r = 0; r < 6; ++r) {
    EXPECT_EQ(g.DomainOf(r), r);
    EXPECT_EQ(g.PositionOf(r), 0);
  }
}

TEST(MeshTest, Zero1ShardsOnlyTheOptimizer) {
  const MeshGeometry g = MeshGeometry::Dense(Config(4, 1, Strategy::kOptim, Strategy::kNoShard));
  EXPECT_EQ(g.domain_size(), 4);
  EXPECT_EQ(g.param_shards(), 1);
  EXPECT_EQ(g.grad_shards(), 1);
  const MeshGeometry g2 =
      MeshGeometry::Dense(Config(4, 1, Strategy::kOptimGrads, Strategy::kNoShard));
  EXPECT_EQ(g2.param_shards(), 1);
  EXPECT_EQ(g2.grad_shards(), 4);
}

TEST(MeshTest, ExpertsNeverGetAnOuterAxis) {
  for (Strategy outer : {Strategy::kNoShard, Strategy::kOptim, Strategy::kOptimGradsParams}) {
    const MeshGeometry g =
        MeshGeometry::Expert(Config(16, 2, Strategy::kOptimGradsParams, outer, /*ep=*/4));
    ASSERT_EQ(g.axes().size(), 1u);
    EXPECT_EQ(g.axes()[0].name, "expert_dp");
    EXPECT_EQ(g.axes()[0].size, 4);
    EXPECT_EQ(g.num_domains(), 4);  // one per EP group
    for (int r = 0; r < 16; ++r) {
      EXPECT_EQ(g.GroupOf(r), r % 4);
      EXPECT_EQ(g.DomainOf(r), r % 4);
      EXPECT_EQ(g.PositionOf(r), r / 4);
    }
  }
}

}  // namespace
}  // namespace muonmesh::plan

#include "worker/runtime/groups.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace muonmesh::worker {
namespace {

using ::testing::ElementsAre;

plan::ResolvedConfig Hfsdp() {
  plan::ResolvedConfig c;
  c.world_size = 8;
  c.instances = 2;
  c.inner = plan::Strategy::kOptimGradsParams;
  c.outer = plan::Strategy::kOptim;
  return c;
}

TEST(GroupsTest, HfsdpGroupsFollowPositions) {
  // (2, 4) mesh, rank r at (r / 4, r % 4); position of (o, i) is 2 i + o.
  const plan::MeshGeometry g = plan::MeshGeometry::Dense(Hfsdp());
  const MeshGroups m = GroupsFor(g, 0, "j");
  EXPECT_THAT(m.domain.ranks, ElementsAre(0, 4, 1, 5, 2, 6, 3, 7));
  EXPECT_THAT(m.param_gather.ranks, ElementsAre(0, 1, 2, 3));  // same o, one per inner shard
  EXPECT_THAT(m.param_group.ranks, ElementsAre(0, 4));         // my inner shard's pieces
  ASSERT_EQ(m.reduce_scatter.size(), 2u);
  EXPECT_THAT(m.reduce_scatter[0].ranks, ElementsAre(0, 1, 2, 3));  // inner first (major)
  EXPECT_THAT(m.reduce_scatter[1].ranks, ElementsAre(0, 4));
  EXPECT_TRUE(m.all_reduce.empty());
}

TEST(GroupsTest, EveryMemberAgreesOnNameOrderAndItsIndex) {
  const plan::MeshGeometry g = plan::MeshGeometry::Dense(Hfsdp());
  for (int32_t r = 0; r < 8; ++r) {
    const MeshGroups m = GroupsFor(g, r, "j");
    for (const GroupSpec* spec : {&m.domain, &m.param_gather, &m.param_group}) {
      ASSERT_EQ(spec->ranks[spec->rank_in_group], r);
      for (int32_t other : spec->ranks) {
        const MeshGroups o = GroupsFor(g, other, "j");
        const GroupSpec* same = spec == &m.domain         ? &o.domain
                                : spec == &m.param_gather ? &o.param_gather
                                                          : &o.param_group;
        EXPECT_EQ(same->name, spec->name);
        EXPECT_EQ(same->ranks, spec->ranks);
      }
    }
    // The domain index is the position.
    EXPECT_EQ(m.domain.rank_in_group, g.PositionOf(r));
  }
}

TEST(GroupsTest, HsdpReducesInsideRowsAndAllReducesAcross) {
  plan::ResolvedConfig c = Hfsdp();
  c.outer = plan::Strategy::kNoShard;
  const plan::MeshGeometry g = plan::MeshGeometry::Dense(c);
  const MeshGroups m = GroupsFor(g, 5, "j");
  EXPECT_THAT(m.domain.ranks, ElementsAre(4, 5, 6, 7));
  ASSERT_EQ(m.all_reduce.size(), 1u);
  EXPECT_THAT(m.all_reduce[0].ranks, ElementsAre(1, 5));
}

}  // namespace
}  // namespace muonmesh::worker

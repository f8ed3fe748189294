// The HSDP replica split (types.h, ReplicaSplit): on small cases worked out
// by hand, the split halves each replica's Newton-Schulz work, the replica
// exchange moves the bytes its formula says, and the auto rule splits
// exactly when the split plan's critical path is the shorter.

#include <cstdint>
#include <map>
#include <string>

#include "gtest/gtest.h"
#include "core/plan/mesh.h"
#include "core/plan/owners.h"
#include "core/plan/planner.h"
#include "core/plan/validate.h"

namespace muonmesh::plan {
namespace {

// Four n x n Muon matrices in one unit, nothing else: on a domain of two
// positions the row-aligned layout gives each position two whole matrices
// (2n of the 4n rows, no padding), so every owner holds its matrix and the
// by-hand costs carry no gather bytes.
constexpr int64_t kN = 64;
constexpr int64_t kBytes = 4;  // fp32

ModelSpec FourSquares() {
  ModelSpec m;
  m.name = "four-squares";
  UnitSpec u;
  u.name = "layer";
  for (const char* name : {"w0", "w1", "w2", "w3"}) {
    u.params.push_back({name, {kN, kN}, "muon", false});
  }
  m.units.push_back(u);
  return m;
}

// Newton-Schulz FLOPs of one n x n matrix, by the formula of docs/architecture.md §4 with
// m = n: T (4 n^3 + 2 n^3) = 6 T n^3, T = 5.
constexpr double kC = 6.0 * 5 * kN * kN * kN;

// HSDP: `world` ranks, I = `instances` replicas of ZeRO-3 domains of two.
PlanInput Hsdp(int64_t world, int64_t instances, const char* split, double flops_per_byte) {
  PlanInput in;
  in.model = FourSquares();
  in.world_size = world;
  in.parallelism.data_parallel_sharding_strategy = "optim_grads_params";
  in.parallelism.num_distributed_optimizer_instances = instances;
  in.parallelism.outer_dp_sharding_strategy = "no_shard";
  in.options.device = "cuda";
  in.options.comm_flops_per_byte = flops_per_byte;
  in.options.muon_replica_split = split;
  return in;
}

std::map<std::string, int64_t> CollectiveBytesByName(const Plan& p) {
  std::map<std::string, int64_t> out;
  for (const CollectiveBytes& c : p.collectives) out[c.name] += c.bytes_per_step;
  return out;
}

TEST(ReplicaSplitTest, HalvesEachReplicasNewtonSchulzWork) {
  // I = 2 replicas of two positions: unsplit, each position of each replica
  // orthogonalizes two of the four matrices; split, each of the 4 ranks one.
  absl::StatusOr<Plan> off = ComputePlan(Hsdp(4, 2, "off", 1.0));
  absl::StatusOr<Plan> on = ComputePlan(Hsdp(4, 2, "on", 1.0));
  ASSERT_TRUE(off.ok()) << off.status();
  ASSERT_TRUE(on.ok()) << on.status();
  EXPECT_EQ(off->dense.replicas, 1);
  EXPECT_EQ(on->dense.replicas, 2);
  for (int32_t r = 0; r < 4; ++r) {
    EXPECT_DOUBLE_EQ(off->ranks[r].ns_flops, 2 * kC) << "rank " << r;
    EXPECT_DOUBLE_EQ(on->ranks[r].ns_flops, kC) << "rank " << r;
    EXPECT_EQ(on->ranks[r].owned_matrices, 1) << "rank " << r;
  }
  // Each matrix once for the set of replicas, by the owner in its replica.
  std::map<int32_t, int> per_replica;
  for (const MatrixPlan& m : on->dense.matrices) ++per_replica[m.replica];
  EXPECT_EQ(per_replica, (std::map<int32_t, int>{{0, 2}, {1, 2}}));
  for (const MatrixPlan& m : off->dense.matrices) EXPECT_EQ(m.replica, -1);
  // Owners hold their matrices: no owner traffic either way.
  const std::map<std::string, int64_t> off_bytes = CollectiveBytesByName(*off);
  const std::map<std::string, int64_t> on_bytes = CollectiveBytesByName(*on);
  EXPECT_EQ(off_bytes.count("muon_gather"), 0u);
  EXPECT_EQ(on_bytes.count("muon_gather"), 0u);
  EXPECT_EQ(off_bytes.count("muon_replica_exchange"), 0u);
}

TEST(ReplicaSplitTest, ReplicaExchangeBytesByFormula) {
  // The rank at (replica o, position q) sends its rows of replica o's
  // matrices to each of the other I - 1 replicas and receives its rows of
  // the others'. Over all ranks every matrix's rows go I - 1 times:
  // (I - 1) x 4 n^2 x 4 bytes, whichever replica orthogonalized it; with
  // I = 2 each rank sends and receives, together, exactly the rows it holds
  // (2 of the 4 matrices: 2 n^2 x 4 bytes).
  for (const int64_t instances : {2, 4}) {
    SCOPED_TRACE(instances);
    absl::StatusOr<Plan> on = ComputePlan(Hsdp(2 * instances, instances, "on", 1.0));
    ASSERT_TRUE(on.ok()) << on.status();
    ASSERT_EQ(on->dense.replicas, instances);
    const int64_t all_rows = 4 * kN * kN * kBytes;
    EXPECT_EQ(CollectiveBytesByName(*on)["muon_replica_exchange"], (instances - 1) * all_rows);
    int64_t sent_and_received = 0;
    for (const RankSummary& r : on->ranks) {
      if (instances == 2) {
        EXPECT_EQ(r.replica_exchange_bytes, 2 * kN * kN * kBytes) << r.rank;
      }
      sent_and_received += r.replica_exchange_bytes;
    }
    // What one rank sends, another receives.
    EXPECT_EQ(sent_and_received, 2 * (instances - 1) * all_rows);
    for (const CollectiveBytes& c : on->collectives) {
      if (c.name == "muon_replica_exchange") {
        EXPECT_EQ(c.axis, "dp_outer");
      }
    }
  }
}

TEST(ReplicaSplitTest, AutoSplitsWhenTheCriticalPathIsShorter) {
  // Unsplit, the critical path is two matrices: 2C. Split, one matrix and
  // the replica exchange: C + w x 2 n^2 x 4 bytes (the rank's rows, sent
  // and received). At w = 1 FLOP per byte that is C + 32768 < 2C: split.
  // At w = 1000 it is C + 32.8M > 2C = 15.7M: not.
  const double exchange = 2.0 * kN * kN * kBytes;
  for (const double w : {1.0, 1000.0}) {
    SCOPED_TRACE(w);
    absl::StatusOr<Plan> p = ComputePlan(Hsdp(4, 2, "", w));
    ASSERT_TRUE(p.ok()) << p.status();
    EXPECT_DOUBLE_EQ(p->joint_makespan_unsplit, 2 * kC);
    EXPECT_DOUBLE_EQ(p->joint_makespan_split, kC + w * exchange);
    const bool split = kC + w * exchange < 2 * kC;
    EXPECT_EQ(split, w == 1.0);
    EXPECT_EQ(p->dense.replicas, split ? 2 : 1);
    // The plan reports the critical path of what runs, and its bound: for
    // the split, 4 matrices on 4 ranks (C each) plus each rank's rows sent
    // or received once (w x 2 n^2 x 4 bytes, which no split avoids): tight;
    // unsplit, 4 matrices on 2 positions: 2C.
    EXPECT_DOUBLE_EQ(p->joint_makespan, split ? kC + w * exchange : 2 * kC);
    EXPECT_DOUBLE_EQ(p->joint_lower_bound, split ? kC + w * exchange : 2 * kC);
    EXPECT_LE(p->joint_lower_bound, p->joint_makespan);
  }
  // "off" and "on" force it either way.
  absl::StatusOr<Plan> off = ComputePlan(Hsdp(4, 2, "off", 1.0));
  absl::StatusOr<Plan> on = ComputePlan(Hsdp(4, 2, "on", 1000.0));
  ASSERT_TRUE(off.ok() && on.ok());
  EXPECT_EQ(off->dense.replicas, 1);
  EXPECT_EQ(off->joint_makespan_split, 0);
  EXPECT_EQ(on->dense.replicas, 2);
  EXPECT_EQ(on->joint_makespan_unsplit, 0);
}

// Split on 4 ranks (2 replicas of 2 positions): two n x n matrices held by
// position 0 and one 2n x n by position 1 (n^2 + n^2 and 2 n^2 elements).
// Every rank sends or receives each row of its shard once, E = w x 2 n^2 x
// 4 bytes, and some rank owns the 2n x n matrix, C2 = T (4 n^2 2n + 2 n^3) =
// 10 T n^3: no plan beats C2 + E, which the plan reaches. The joint bound
// only sees max(E, C2, (2C + C2) / 4 + E) = C2 at w = 100, so the strong
// bound is computed; it counts the exchange and is exact.
TEST(ReplicaSplitTest, StrongBoundCountsTheExchangeEveryRankCarries) {
  PlanInput in = Hsdp(4, 2, "on", 100.0);
  in.model.units[0].params = {{"a", {kN, kN}, "muon", false},
                              {"b", {kN, kN}, "muon", false},
                              {"c", {2 * kN, kN}, "muon", false}};
  absl::StatusOr<Plan> p = ComputePlan(in);
  ASSERT_TRUE(p.ok()) << p.status();
  ASSERT_EQ(p->dense.replicas, 2);
  const double c2 = 10.0 * 5 * kN * kN * kN;
  const double exchange = 100.0 * 2 * kN * kN * kBytes;
  EXPECT_DOUBLE_EQ(p->joint_makespan, c2 + exchange);
  EXPECT_DOUBLE_EQ(p->joint_lower_bound, c2);
  EXPECT_NEAR(p->joint_strong_lower_bound / (c2 + exchange), 1.0, 1e-5);
}

TEST(ReplicaSplitTest, NothingToSplitWithoutReplicatedOptimizerState) {
  // HFSDP shards the optimizer state over dp_outer; allgather has no owners;
  // one instance has no outer axis. "on" is then no error and no split.
  PlanInput hfsdp = Hsdp(4, 2, "on", 1.0);
  hfsdp.parallelism.outer_dp_sharding_strategy = "optim";
  PlanInput allgather = Hsdp(4, 2, "on", 1.0);
  allgather.options.owner_assignment = "allgather";
  PlanInput single = Hsdp(4, 1, "on", 1.0);
  single.parallelism.outer_dp_sharding_strategy = "";
  for (const PlanInput* in : {&hfsdp, &allgather, &single}) {
    absl::StatusOr<Plan> p = ComputePlan(*in);
    ASSERT_TRUE(p.ok()) << p.status();
    EXPECT_EQ(p->dense.replicas, 1);
    EXPECT_EQ(p->joint_makespan_split, 0);
    for (const CollectiveBytes& c : p->collectives) EXPECT_NE(c.name, "muon_replica_exchange");
  }
}

TEST(ReplicaSplitTest, UnknownValueIsAViolationNamingTheField) {
  PlanInput in = Hsdp(4, 2, "sometimes", 1.0);
  const std::vector<FieldViolation> v = Validate(in);
  ASSERT_EQ(v.size(), 1u);
  EXPECT_EQ(v[0].field, "options.muon_replica_split");
  EXPECT_NE(v[0].description.find("'sometimes'"), std::string::npos) << v[0].description;
  EXPECT_EQ(ComputePlan(in).status().code(), absl::StatusCode::kInvalidArgument);
  for (const char* ok : {"", "auto", "on", "off"}) {
    in.options.muon_replica_split = ok;
    EXPECT_TRUE(Validate(in).empty()) << ok;
  }
  EXPECT_EQ(ParseReplicaSplit("auto"), ReplicaSplit::kAuto);
  EXPECT_EQ(ReplicaSplitName(ReplicaSplit::kOff), "off");
}

}  // namespace
}  // namespace muonmesh::plan

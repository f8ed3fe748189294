#include "core/plan/waves.h"

#include <algorithm>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "core/plan/planner.h"
#include "core/plan/validate.h"
#include "tests/core/plan/spec_loader.h"
#include "tests/testing/model_specs.h"

namespace muonmesh::plan {
namespace {

PlanInput Llama(int64_t world, int64_t wave_budget_bytes) {
  absl::StatusOr<ModelSpec> spec = testing::LoadSpec("llama3-8b");
  EXPECT_TRUE(spec.ok()) << spec.status();
  PlanInput in;
  if (spec.ok()) in.model = *spec;
  in.world_size = world;
  in.options.device = "cpu";
  in.options.muon_wave_budget_bytes = wave_budget_bytes;
  return in;
}

// The critical path the runtime executes for `plan` cut into `waves`: the
// sum over waves of the busiest rank's Newton-Schulz FLOPs in it.
double WaveCriticalPath(const Plan& plan, const std::vector<MuonWave>& waves) {
  double sum = 0;
  for (const std::vector<double>& ranks : PlannedWaveNsFlops(plan, waves)) {
    sum += *std::max_element(ranks.begin(), ranks.end());
  }
  return sum;
}

// Plans `input(0)` (one wave) and `input(B)`, B two of the largest unit's
// bytes (about two layers a wave), and holds what balancing per wave must
// give: a shorter critical path than the whole model's owners cut the same
// way, and no wave below its bound (its largest matrix; one copy of its
// dense work over `ranks`, the ranks that share it). `waved`: the plan with
// the budget.
void ExpectWavesShortenThePath(const std::function<PlanInput(int64_t)>& input, int64_t ranks,
                               Plan* waved) {
  absl::StatusOr<Plan> whole = ComputePlan(input(0));
  ASSERT_TRUE(whole.ok()) << whole.status();
  const std::vector<int64_t> unit_bytes = MuonUnitBytes(*whole);
  const int64_t budget = 2 * *std::max_element(unit_bytes.begin(), unit_bytes.end());
  absl::StatusOr<Plan> planned = ComputePlan(input(budget));
  ASSERT_TRUE(planned.ok()) << planned.status();
  *waved = *std::move(planned);

  const std::vector<MuonWave> whole_cut = PlanMuonWaves(*whole, budget);
  const std::vector<MuonWave> waved_cut = PlanMuonWaves(*waved, budget);
  ASSERT_GT(waved_cut.size(), 4u);
  const double before = WaveCriticalPath(*whole, whole_cut);
  const double after = WaveCriticalPath(*waved, waved_cut);
  EXPECT_LT(after, before);
  ::testing::Test::RecordProperty("wave_critical_path_ratio", std::to_string(after / before));
  double bound = 0;
  for (const MuonWave& wave : waved_cut) {
    double largest = 0, total = 0;
    for (const MatrixPlan& m : waved->dense.matrices) {
      if (m.unit < wave.first_unit || m.unit >= wave.end_unit) continue;
      largest = std::max(largest, m.cost_flops);
      total += m.cost_flops;
    }
    bound += std::max(largest, total / static_cast<double>(ranks));
  }
  EXPECT_GE(after, bound * (1 - 1e-12));
}

// Llama-3-8B on 8 ranks, cut into waves of about two layers: the owners the
// planner balances wave by wave shorten the path (ExpectWavesShortenThePath)
// and own every matrix, and the domain's loads are its owners'.
TEST(WaveBalanceTest, OwnersBalancedWaveByWaveShortenTheCriticalPath) {
  ASSERT_TRUE(testing::ModelSpecExists(testing::ModelSpecPath("llama3-8b")));
  Plan waved;
  ASSERT_NO_FATAL_FAILURE(
      ExpectWavesShortenThePath([](int64_t budget) { return Llama(8, budget); }, 8, &waved));
  // Every matrix still has an owner, and the domain's loads are its owners'.
  std::vector<double> ns(static_cast<size_t>(waved.dense.size), 0.0);
  for (const MatrixPlan& m : waved.dense.matrices) {
    ASSERT_GE(m.owner, 0);
    ASSERT_LT(m.owner, waved.dense.size);
    ns[static_cast<size_t>(m.owner)] += m.cost_flops;
  }
  for (size_t p = 0; p < ns.size(); ++p) EXPECT_DOUBLE_EQ(waved.dense.ns_flops[p], ns[p]) << p;
}

// The same under the HSDP replica split (Llama-3-8B, 16 ranks, I = 2
// replicas of ZeRO-3 domains of 8, split on): each wave's dense matrices
// are split between the replicas anew, which shortens the path against the
// whole model's split owners (one copy of a wave's work is shared by the 16
// ranks of the set of replicas), and every matrix is orthogonalized by one
// replica.
TEST(WaveBalanceTest, UnderTheReplicaSplitEachWaveIsSplitAnew) {
  ASSERT_TRUE(testing::ModelSpecExists(testing::ModelSpecPath("llama3-8b")));
  auto hsdp = [](int64_t budget) {
    PlanInput in = Llama(16, budget);
    in.parallelism.data_parallel_sharding_strategy = "optim_grads_params";
    in.parallelism.num_distributed_optimizer_instances = 2;
    in.parallelism.outer_dp_sharding_strategy = "no_shard";
    in.options.muon_replica_split = "on";
    return in;
  };
  Plan waved;
  ASSERT_NO_FATAL_FAILURE(ExpectWavesShortenThePath(hsdp, 16, &waved));
  ASSERT_EQ(waved.dense.replicas, 2);
  // Owners and replicas in range; each replica's positions' Newton-Schulz
  // FLOPs are those of the matrices it owns.
  std::vector<double> ns(static_cast<size_t>(2 * waved.dense.size), 0.0);
  for (const MatrixPlan& m : waved.dense.matrices) {
    ASSERT_GE(m.owner, 0);
    ASSERT_LT(m.owner, waved.dense.size);
    ASSERT_TRUE(m.replica == 0 || m.replica == 1) << m.replica;
    ns[static_cast<size_t>(m.replica * waved.dense.size + m.owner)] += m.cost_flops;
  }
  ASSERT_EQ(waved.dense.ns_flops.size(), ns.size());
  for (size_t i = 0; i < ns.size(); ++i) EXPECT_DOUBLE_EQ(waved.dense.ns_flops[i], ns[i]) << i;
}

// One wave (no budget, or one that holds the whole model) keeps the whole
// model's owners.
TEST(WaveBalanceTest, OneWaveKeepsTheWholeModelsOwners) {
  ASSERT_TRUE(testing::ModelSpecExists(testing::ModelSpecPath("llama3-8b")));
  absl::StatusOr<Plan> whole = ComputePlan(Llama(8, 0));
  absl::StatusOr<Plan> roomy = ComputePlan(Llama(8, int64_t{1} << 50));
  ASSERT_TRUE(whole.ok() && roomy.ok());
  ASSERT_EQ(whole->dense.matrices.size(), roomy->dense.matrices.size());
  for (size_t j = 0; j < whole->dense.matrices.size(); ++j) {
    EXPECT_EQ(whole->dense.matrices[j].owner, roomy->dense.matrices[j].owner) << j;
  }
}

TEST(WaveBalanceTest, ANegativeBudgetNamesTheField) {
  PlanInput in = Llama(8, -1);
  const std::vector<FieldViolation> v = Validate(in);
  ASSERT_EQ(v.size(), 1u);
  EXPECT_EQ(v[0].field, "options.muon_wave_budget_bytes");
}

}  // namespace
}  // namespace muonmesh::plan

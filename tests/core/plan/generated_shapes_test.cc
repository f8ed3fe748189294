// The planner on generated model shapes (tests/core/plan/shape_generator.h): the
// joint makespan of the runtime's one Muon schedule (max over ranks of the
// load summed over every domain the rank belongs to) against the joint lower
// bound, both recomputed here from the plan's holders and owners by the
// formulas of docs/architecture.md §4 (and, where the HSDP replicas split the dense
// work, README's replica exchange), and the plan's invariants.

#include <algorithm>
#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "core/plan/planner.h"
#include "tests/core/plan/shape_generator.h"

namespace muonmesh::plan {
namespace {

using testing::GeneratedShape;
using testing::GenerateShape;
using testing::InputFor;

// T (4 m^2 n + 2 m^3), m = min, n = max, by hand.
double NsFlops(int64_t rows, int64_t cols, int64_t steps) {
  const double m = static_cast<double>(std::min(rows, cols));
  const double n = static_cast<double>(std::max(rows, cols));
  return static_cast<double>(steps) * (4 * m * m * n + 2 * m * m * m);
}

struct Checked {
  double joint_makespan = 0;
  double joint_bound = 0;
};

// Checks one plan's owner invariants and returns its joint makespan and
// joint lower bound, both computed here.
Checked CheckPlan(const Plan& p) {
  Checked out;
  const double w = p.config.comm_flops_per_byte;
  const int64_t bpe = p.config.bytes_per_element;
  const int64_t world = p.config.world_size;
  const int64_t per_replica = world / p.config.instances;  // ranks a dp_outer coordinate has
  std::vector<double> rank_load(world, 0.0);
  double total = 0;
  std::set<MeshKind> meshes_seen;
  for (const DomainPlan* d : {&p.dense, &p.expert}) {
    if (d == &p.expert && !p.has_experts) continue;
    SCOPED_TRACE(d == &p.dense ? "dense" : "expert");
    // Under the HSDP replica split (dense only) a set of I replica domains
    // shares the matrices: one entry per (replica, position), each matrix
    // once per set, and every rank swaps its rows over dp_outer: it sends
    // its rows of its replica's matrices to the I - 1 others and receives
    // its rows of the rest.
    const int64_t replicas = d->replicas;
    EXPECT_TRUE(replicas == 1 || (d == &p.dense && replicas == p.config.instances));
    const int64_t entries = replicas * d->size;
    std::vector<double> load(entries, 0.0);
    std::vector<int64_t> held(d->size, 0);
    std::vector<int64_t> own_replica(entries, 0);
    std::vector<double> min_costs;
    for (const MatrixPlan& m : d->matrices) {
      // Exactly one owner, inside the domain (and one replica under the
      // split); holders tile the rows.
      EXPECT_GE(m.owner, 0);
      EXPECT_LT(m.owner, d->size);
      if (m.owner < 0 || m.owner >= d->size) continue;
      const int64_t replica = replicas > 1 ? m.replica : 0;
      EXPECT_EQ(m.replica, replicas > 1 ? replica : -1);
      if (replica < 0 || replica >= replicas) continue;
      int64_t rows = 0, held_by_owner = 0, best = 0;
      for (const Holder& h : m.holders) {
        rows += h.row_count;
        best = std::max(best, h.row_count);
        if (h.position == m.owner) held_by_owner = h.row_count;
        held[h.position] += h.row_count * m.cols * bpe;
        own_replica[replica * d->size + h.position] += h.row_count * m.cols * bpe;
      }
      EXPECT_EQ(rows, m.rows);
      const double flops = NsFlops(m.rows, m.cols, p.config.ns_steps);
      EXPECT_DOUBLE_EQ(m.cost_flops, flops);
      const double cost = flops + w * 2.0 * static_cast<double>((m.rows - held_by_owner) * m.cols * bpe);
      EXPECT_DOUBLE_EQ(m.owner_cost, cost);
      load[replica * d->size + m.owner] += cost;
      min_costs.push_back(flops + w * 2.0 * static_cast<double>((m.rows - best) * m.cols * bpe));
    }
    if (replicas > 1) {
      for (int64_t i = 0; i < entries; ++i) {
        const int64_t sent = (replicas - 1) * own_replica[i];
        const int64_t received = held[i % d->size] - own_replica[i];
        load[i] += w * static_cast<double>(sent + received);
      }
    }
    // Loads are the sums of the owned costs (and the replica exchange).
    EXPECT_EQ(static_cast<int64_t>(d->load.size()), entries);
    if (static_cast<int64_t>(d->load.size()) != entries) continue;
    for (int64_t q = 0; q < entries; ++q) {
      EXPECT_NEAR(d->load[q], load[q], 1e-9 * std::max(1.0, load[q])) << "entry " << q;
    }
    // This mesh's bound: max(largest, total / D, p_D + p_{D+1}), with the
    // I x D positions of a set of replicas under the split.
    std::sort(min_costs.begin(), min_costs.end(), std::greater<>());
    double sum = 0;
    for (double c : min_costs) sum += c;
    const auto positions = static_cast<size_t>(entries);
    double bound =
        min_costs.empty() ? 0 : std::max(min_costs[0], sum / static_cast<double>(entries));
    if (min_costs.size() > positions) {
      bound = std::max(bound, min_costs[positions - 1] + min_costs[positions]);
    }
    out.joint_bound = std::max(out.joint_bound, bound);
    // Every rank sits at one position of one domain of this mesh.
    std::vector<int> seen(world, 0);
    int64_t domains = 0;
    for (const Domain& dom : p.domains) {
      if (dom.mesh != d->mesh) continue;
      ++domains;
      EXPECT_EQ(static_cast<int64_t>(dom.ranks.size()), d->size);
      for (size_t q = 0; q < dom.ranks.size(); ++q) {
        const int64_t replica = replicas > 1 ? dom.ranks[q] / per_replica : 0;
        ++seen[dom.ranks[q]];
        rank_load[dom.ranks[q]] += load[replica * d->size + static_cast<int64_t>(q)];
      }
    }
    for (int64_t r = 0; r < world; ++r) EXPECT_EQ(seen[r], 1) << "rank " << r;
    total += sum * static_cast<double>(domains / replicas);
    // Under the split the I ranks holding a shard send and receive, over
    // dp_outer, 2 (I - 1) x its rows whatever the assignment: the total
    // counts it, and the busiest of them carries at least the mean.
    if (replicas > 1) {
      const double share = 2.0 * static_cast<double>(replicas - 1) / static_cast<double>(replicas);
      for (const Domain& dom : p.domains) {
        if (dom.mesh != d->mesh) continue;
        for (size_t q = 0; q < dom.ranks.size(); ++q) {
          const double base = w * share * static_cast<double>(held[q]);
          total += base;
          out.joint_bound = std::max(out.joint_bound, base);
        }
      }
    }
  }
  out.joint_bound = std::max(out.joint_bound, total / static_cast<double>(world));
  for (int64_t r = 0; r < world; ++r) {
    EXPECT_NEAR(p.ranks[r].load_flops, rank_load[r], 1e-9 * std::max(1.0, rank_load[r]));
    out.joint_makespan = std::max(out.joint_makespan, rank_load[r]);
  }
  return out;
}

struct Sweep {
  int64_t world;
  int shapes;
};

// Muon matrices a rank's domains hold (one expert domain's experts).
int64_t MatricesPerDomain(const PlanInput& in) {
  int64_t n = 0;
  for (const UnitSpec& u : in.model.units) {
    for (const ParamSpec& p : u.params) {
      if (p.optimizer != "muon") continue;
      n += p.expert ? p.shape[0] / in.parallelism.expert_model_parallel_size : 1;
    }
  }
  return n;
}

// The shapes of a sweep the test plans: up to 2,500 matrices, which keeps
// it to seconds; planner_benchmark plans them all.
std::vector<std::pair<GeneratedShape, PlanInput>> Shapes(const Sweep& sweep) {
  std::vector<std::pair<GeneratedShape, PlanInput>> out;
  for (int seed = 0; seed < sweep.shapes; ++seed) {
    GeneratedShape shape = GenerateShape(seed);
    PlanInput in = InputFor(shape, sweep.world);
    if (MatricesPerDomain(in) <= 2500) out.emplace_back(std::move(shape), std::move(in));
  }
  return out;
}

class GeneratedShapesTest : public ::testing::TestWithParam<Sweep> {};

// Every plan keeps its invariants; its joint makespan and joint lower bound
// are the ones recomputed here; the stronger bound lies between the joint
// bound and the makespan. The ratio is held under a ceiling just above
// today's worst (1.27 at 64 ranks, where the stronger bound shows no plan
// does better): a regression guard; the issue's target is below.
TEST_P(GeneratedShapesTest, PlansKeepTheirInvariantsAndBounds) {
  const auto shapes = Shapes(GetParam());
  ASSERT_GE(shapes.size(), 10u);
  for (const auto& [shape, in] : shapes) {
    SCOPED_TRACE(shape.description);
    absl::StatusOr<Plan> p = ComputePlan(in);
    ASSERT_TRUE(p.ok()) << p.status();
    const Checked c = CheckPlan(*p);
    EXPECT_NEAR(p->joint_makespan, c.joint_makespan, 1e-9 * c.joint_makespan);
    EXPECT_NEAR(p->joint_lower_bound, c.joint_bound, 1e-9 * c.joint_bound);
    EXPECT_GE(p->joint_strong_lower_bound, c.joint_bound * (1 - 1e-12));
    EXPECT_LE(p->joint_strong_lower_bound, c.joint_makespan * (1 + 1e-12));
    EXPECT_LE(c.joint_makespan / c.joint_bound, 1.30);
  }
}

// The target of issue 10: joint makespan / joint lower bound <= 1.10 on
// every shape and <= 1.05 on at least 95 % of them, where a shape also
// counts when the stronger certified bound shows that no plan does better
// (the makespan within that of it: within that of the optimum).
void ExpectIssueTarget(const Sweep& sweep) {
  std::vector<double> ratios;
  for (const auto& [shape, in] : Shapes(sweep)) {
    SCOPED_TRACE(shape.description);
    absl::StatusOr<Plan> p = ComputePlan(in);
    ASSERT_TRUE(p.ok()) << p.status();
    const Checked c = CheckPlan(*p);
    const double ratio =
        c.joint_makespan / std::max(c.joint_bound, p->joint_strong_lower_bound);
    ratios.push_back(ratio);
    EXPECT_LE(ratio, 1.10) << "joint ratio " << c.joint_makespan / c.joint_bound;
  }
  const auto within =
      std::count_if(ratios.begin(), ratios.end(), [](double r) { return r <= 1.05; });
  EXPECT_GE(static_cast<double>(within), 0.95 * static_cast<double>(ratios.size()))
      << within << " of " << ratios.size() << " within 1.05";
}

// Met at 8, 64 and 512 ranks (seeds 0-59 with up to 2,500 matrices a
// domain; planner_benchmark plans all 60).
TEST(GeneratedShapesTargetTest, MeetsTheIssueTargetAt8Ranks) { ExpectIssueTarget({8, 50}); }
TEST(GeneratedShapesTargetTest, MeetsTheIssueTargetAt64Ranks) { ExpectIssueTarget({64, 60}); }
TEST(GeneratedShapesTargetTest, MeetsTheIssueTargetAt512Ranks) { ExpectIssueTarget({512, 60}); }

INSTANTIATE_TEST_SUITE_P(Sizes, GeneratedShapesTest,
                         ::testing::Values(Sweep{8, 50}, Sweep{64, 50}, Sweep{512, 12}),
                         [](const ::testing::TestParamInfo<Sweep>& info) {
                           return absl::StrCat("W", info.param.world);
                         });

// The generator is seeded: the same seed, the same shape.
TEST(ShapeGeneratorTest, SameSeedSameShape) {
  for (int seed : {0, 7, 41}) {
    const GeneratedShape a = GenerateShape(seed);
    const GeneratedShape b = GenerateShape(seed);
    EXPECT_EQ(a.description, b.description);
    ASSERT_EQ(a.model.units.size(), b.model.units.size());
    for (size_t u = 0; u < a.model.units.size(); ++u) {
      ASSERT_EQ(a.model.units[u].params.size(), b.model.units[u].params.size());
      for (size_t k = 0; k < a.model.units[u].params.size(); ++k) {
        EXPECT_EQ(a.model.units[u].params[k].shape, b.model.units[u].params[k].shape);
      }
    }
  }
}

}  // namespace
}  // namespace muonmesh::plan

#include "core/plan/plan_size.h"

#include <string>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "core/plan/planner.h"
#include "core/plan/validate.h"
#include "proto/convert/plan_convert.h"
#include "tests/core/plan/spec_loader.h"

namespace muonmesh::plan {
namespace {

using ::testing::HasSubstr;

// A model with everything the counts depend on: several row lengths, vectors,
// a 4-D tensor seen as a matrix, expert stacks whose runs cross experts,
// stacked blocks (ParamSpec::muon_stack_blocks) of a tensor and of a stack.
ModelSpec Mixed() {
  ModelSpec m;
  m.units.push_back({"embed", {{"embed.weight", {50, 12}, "adamw", false}}});
  for (int i = 0; i < 3; ++i) {
    const std::string p = "layers." + std::to_string(i);
    m.units.push_back({p,
                       {{p + ".q", {12, 12}, "muon", false},
                        {p + ".up", {40, 12}, "muon", false},
                        {p + ".conv", {6, 2, 3, 3}, "muon", false},
                        {p + ".norm", {12}, "adamw", false},
                        {p + ".experts.w1", {8, 10, 12}, "muon", true},
                        // Stacked blocks, whose runs meet both matrices.
                        {p + ".kv_b", {24, 12}, "muon", false, 3, 1, true},
                        {p + ".experts.w2", {8, 10, 12}, "muon", true, 3, 2, true},
                        {p + ".experts.bias", {8, 10}, "adamw", true}}});
  }
  return m;
}

PlanInput Input(ModelSpec model, int64_t world, const char* inner, int64_t instances,
                int64_t ep) {
  PlanInput in;
  in.model = std::move(model);
  in.world_size = world;
  in.parallelism.data_parallel_sharding_strategy = inner;
  in.parallelism.num_distributed_optimizer_instances = instances;
  in.parallelism.expert_model_parallel_size = ep;
  return in;
}

// The counts, taken from a computed plan and its answer message.
void ExpectSizeOfPlan(const PlanInput& in) {
  absl::StatusOr<PlanSize> size = EstimatePlanSize(in);
  ASSERT_TRUE(size.ok()) << size.status();
  absl::StatusOr<Plan> plan = ComputePlan(in);
  ASSERT_TRUE(plan.ok()) << plan.status();
  double segments = 0;
  double shards = 0;
  for (const UnitPlan& u : plan->units) {
    for (const UnitLayout* l : {&u.dense, &u.expert}) {
      if (l->tensors.empty()) continue;
      segments += static_cast<double>(l->segments.size());
      shards += static_cast<double>(l->num_shards);
    }
  }
  double matrices = 0;
  double holders = 0;
  for (const DomainPlan* d : {&plan->dense, &plan->expert}) {
    matrices += static_cast<double>(d->matrices.size());
    for (const MatrixPlan& m : d->matrices) holders += static_cast<double>(m.holders.size());
  }
  v1::Plan answer;
  convert::PlanToProto(in, *plan, false, &answer);
  double listed_holders = 0;
  double name_bytes = 0;
  for (const v1::Matrix& m : answer.matrices()) {
    listed_holders += m.holders_size();
    name_bytes += static_cast<double>(m.name().size());
  }
  EXPECT_EQ(size->layout_shards, shards);
  EXPECT_EQ(size->segments, segments);
  EXPECT_EQ(size->matrices, matrices);
  EXPECT_EQ(size->holders, holders);
  EXPECT_EQ(size->domains, answer.domains_size());
  EXPECT_EQ(size->listed_matrices, answer.matrices_size());
  EXPECT_EQ(size->listed_holders, listed_holders);
  // Names are counted with room for the widest expert index.
  EXPECT_GE(size->listed_name_bytes, name_bytes);
  EXPECT_GT(size->planner_bytes, 0);
}

TEST(PlanSizeTest, CountsAreThoseOfThePlan) {
  const struct {
    int64_t world;
    const char* inner;
    int64_t instances;
    int64_t ep;
  } configs[] = {{1, "optim_grads_params", 1, 1}, {4, "no_shard", 1, 2},
                 {8, "optim_grads_params", 2, 4}, {7, "optim", 1, 1},
                 {64, "optim_grads_params", 1, 8}, {48, "optim_grads_params", 3, 2}};
  for (const auto& c : configs) {
    SCOPED_TRACE(::testing::Message() << c.world << " " << c.inner << " I=" << c.instances
                                      << " EP=" << c.ep);
    ExpectSizeOfPlan(Input(Mixed(), c.world, c.inner, c.instances, c.ep));
  }
}

TEST(PlanSizeTest, CountsOfTheRealSpecs) {
  for (const auto& [spec, world, ep] :
       {std::tuple{"gpt2-124m", 512, 1}, std::tuple{"llama3-8b", 96, 1},
        std::tuple{"deepseek-v3", 512, 8}}) {
    SCOPED_TRACE(spec);
    absl::StatusOr<ModelSpec> model = testing::LoadSpec(spec);
    ASSERT_TRUE(model.ok()) << "spec not found: " << model.status();
    ExpectSizeOfPlan(Input(*model, world, "optim_grads_params", 1, ep));
  }
}

// A thousand layers of one [2^20, 2^20] matrix on 16384 ranks: every matrix
// is cut into 16384 runs, 16M holder entries; refused from its counts alone.
TEST(PlanSizeTest, APlanTooBigToBuildIsRefusedBeforePlanning) {
  ModelSpec m;
  for (int u = 0; u < 1000; ++u) {
    // StrCat: GCC 12 warns falsely (-Wrestrict) on "u" + std::to_string(u).
    const std::string name = absl::StrCat("u", u);
    m.units.push_back({name, {{absl::StrCat(name, ".w"), {1 << 20, 1 << 20}, "muon", false}}});
  }
  const PlanInput in = Input(m, 16384, "optim_grads_params", 1, 1);
  ASSERT_TRUE(Validate(in).empty());
  absl::StatusOr<PlanSize> size = EstimatePlanSize(in);
  ASSERT_TRUE(size.ok()) << size.status();
  EXPECT_EQ(size->holders, 1000.0 * 16384);
  EXPECT_EQ(size->segments, 1000.0 * 16384);
  const std::vector<FieldViolation> v = PlanSizeViolations(*size);
  ASSERT_EQ(v.size(), 1u);
  EXPECT_EQ(v[0].field, "world_size");
  EXPECT_THAT(v[0].description, HasSubstr("MiB (limit 2048 MiB)"));
  absl::StatusOr<Plan> plan = ComputePlan(in);
  EXPECT_EQ(plan.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(plan.status().message(), HasSubstr("world_size: planning would take about"));
  // A tenth of it is planned.
  m.units.resize(100);
  EXPECT_TRUE(PlanSizeViolations(*EstimatePlanSize(Input(m, 16384, "optim_grads_params", 1, 1)))
                  .empty());
}

TEST(PlanSizeTest, CancelledSizing) {
  CancelToken stop([] { return true; }, 1);
  absl::StatusOr<PlanSize> size =
      EstimatePlanSize(Input(Mixed(), 8, "optim_grads_params", 1, 1), &stop);
  EXPECT_EQ(size.status().code(), absl::StatusCode::kCancelled);
}

}  // namespace
}  // namespace muonmesh::plan

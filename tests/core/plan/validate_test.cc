#include "core/plan/validate.h"

#include <functional>
#include <tuple>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace muonmesh::plan {
namespace {

using ::testing::HasSubstr;

PlanInput ValidInput() {
  PlanInput in;
  in.world_size = 8;
  in.model.name = "tiny";
  UnitSpec unit;
  unit.name = "layers.0";
  unit.params.push_back({"layers.0.w", {16, 8}, "muon", false});
  unit.params.push_back({"layers.0.b", {16}, "adamw", false});
  unit.params.push_back({"layers.0.experts.w1", {8, 4, 8}, "muon", true});
  in.model.units.push_back(unit);
  return in;
}

struct Case {
  const char* name;
  std::function<void(PlanInput&)> mutate;
  const char* field;
  const char* reason;
};

// Names the case in test listings instead of dumping its bytes.
void PrintTo(const Case& c, std::ostream* os) { *os << c.name; }

class ValidateRuleTest : public ::testing::TestWithParam<Case> {};

TEST_P(ValidateRuleTest, ReportsTheFieldAndReason) {
  PlanInput in = ValidInput();
  ASSERT_TRUE(Validate(in).empty());
  GetParam().mutate(in);
  const std::vector<FieldViolation> v = Validate(in);
  ASSERT_EQ(v.size(), 1u) << (v.empty() ? "no violation" : v[0].field + ": " + v[0].description);
  EXPECT_EQ(v[0].field, GetParam().field);
  EXPECT_THAT(v[0].description, HasSubstr(GetParam().reason));
}

INSTANTIATE_TEST_SUITE_P(
    Rules, ValidateRuleTest,
    ::testing::Values(
        Case{"UnknownInner",
             [](PlanInput& in) { in.parallelism.data_parallel_sharding_strategy = "zero3"; },
             "parallelism.data_parallel_sharding_strategy", "unknown strategy 'zero3'"},
        Case{"UnknownOuter",
             [](PlanInput& in) {
               in.parallelism.num_distributed_optimizer_instances = 2;
               in.parallelism.outer_dp_sharding_strategy = "hsdp";
             },
             "parallelism.outer_dp_sharding_strategy", "unknown strategy 'hsdp'"},
        Case{"InstancesBelowOne",
             [](PlanInput& in) { in.parallelism.num_distributed_optimizer_instances = -2; },
             "parallelism.num_distributed_optimizer_instances",
             "must be >= 1 (0 or unset: 1), got -2"},
        Case{"EpBelowOne",
             [](PlanInput& in) { in.parallelism.expert_model_parallel_size = -2; },
             "parallelism.expert_model_parallel_size", "must be >= 1 (0 or unset: 1), got -2"},
        Case{"InstancesDoNotDivide",
             [](PlanInput& in) { in.parallelism.num_distributed_optimizer_instances = 3; },
             "parallelism.num_distributed_optimizer_instances", "3 does not divide world_size 8"},
        Case{"EpDoesNotDivideWorld",
             [](PlanInput& in) {
               in.world_size = 6;
               in.parallelism.expert_model_parallel_size = 4;
             },
             "parallelism.expert_model_parallel_size", "4 does not divide world_size 6"},
        Case{"ExpertsDoNotDivideOverEp",
             [](PlanInput& in) {
               in.model.units[0].params[2].shape[0] = 6;
               in.parallelism.expert_model_parallel_size = 4;
             },
             "model.units[0].params[2].shape[0]", "6 experts do not divide"},
        Case{"OuterWithOneInstance",
             [](PlanInput& in) { in.parallelism.outer_dp_sharding_strategy = "optim"; },
             "parallelism.outer_dp_sharding_strategy", "exists only when it is > 1"},
        Case{"TensorParallel",
             [](PlanInput& in) { in.parallelism.tensor_model_parallel_size = 2; },
             "parallelism.tensor_model_parallel_size", "not supported yet"},
        Case{"PipelineParallel",
             [](PlanInput& in) { in.parallelism.pipeline_model_parallel_size = 4; },
             "parallelism.pipeline_model_parallel_size", "not supported yet"},
        Case{"ContextParallel", [](PlanInput& in) { in.parallelism.context_parallel_size = 2; },
             "parallelism.context_parallel_size", "not supported yet"},
        Case{"EmptyParamName", [](PlanInput& in) { in.model.units[0].params[1].name = ""; },
             "model.units[0].params[1].name", "empty parameter name"},
        Case{"DuplicateParamName",
             [](PlanInput& in) { in.model.units[0].params[1].name = "layers.0.w"; },
             "model.units[0].params[1].name", "duplicate parameter name 'layers.0.w'"},
        Case{"NonPositiveDim", [](PlanInput& in) { in.model.units[0].params[0].shape[1] = 0; },
             "model.units[0].params[0].shape[1]", "must be positive, got 0"},
        Case{"EmptyShape", [](PlanInput& in) { in.model.units[0].params[1].shape.clear(); },
             "model.units[0].params[1].shape", "empty shape"},
        Case{"MuonOnAVector",
             [](PlanInput& in) { in.model.units[0].params[1].optimizer = "muon"; },
             "model.units[0].params[1].shape", "Muon needs a matrix"},
        Case{"MuonOnAnExpertVector",
             [](PlanInput& in) { in.model.units[0].params[2].shape = {8, 4}; },
             "model.units[0].params[2].shape", "Muon needs a matrix"},
        Case{"UnknownOptimizer",
             [](PlanInput& in) { in.model.units[0].params[0].optimizer = "sgd"; },
             "model.units[0].params[0].optimizer", "unknown optimizer 'sgd'"},
        Case{"NoUnits", [](PlanInput& in) { in.model.units.clear(); }, "model.units",
             "no units"},
        Case{"EmptyUnit", [](PlanInput& in) { in.model.units[0].params.clear(); },
             "model.units[0].params", "no parameters"},
        Case{"GathersPerStepOutOfRange",
             [](PlanInput& in) { in.model.units[0].gathers_per_step = 9; },
             "model.units[0].gathers_per_step", "must be in [1, 8] (0 or unset: 1), got 9"},
        Case{"GathersPerStepNegative",
             [](PlanInput& in) { in.model.units[0].gathers_per_step = -1; },
             "model.units[0].gathers_per_step", "must be in [1, 8] (0 or unset: 1), got -1"},
        Case{"WorldZero", [](PlanInput& in) { in.world_size = 0; }, "world_size",
             "must be >= 1"},
        Case{"WorldAbsurd", [](PlanInput& in) { in.world_size = int64_t{1} << 40; },
             "world_size", "exceeds the limit"},
        Case{"HugeTensor",
             [](PlanInput& in) {
               in.model.units[0].params[0].shape = {int64_t{1} << 30, int64_t{1} << 30};
             },
             "model.units[0].params[0].shape", "elements (the limit)"},
        Case{"TooManyDims",
             [](PlanInput& in) { in.model.units[0].params[0].shape.assign(9, 2); },
             "model.units[0].params[0].shape", "9 dimensions exceed"},
        Case{"NsStepsOutOfRange", [](PlanInput& in) { in.options.ns_steps = 101; },
             "options.ns_steps", "must be in [1, 100] (0 or unset: 5), got 101"},
        Case{"NsStepsNegative", [](PlanInput& in) { in.options.ns_steps = -1; },
             "options.ns_steps", "must be in [1, 100] (0 or unset: 5), got -1"},
        Case{"ModelNameTooLong", [](PlanInput& in) { in.model.name = std::string(1025, 'm'); },
             "model.name", "model name of 1025 bytes exceeds the limit of 1024 bytes"},
        Case{"UnitNameTooLong",
             [](PlanInput& in) { in.model.units[0].name = std::string(1025, 'u'); },
             "model.units[0].name", "unit name of 1025 bytes exceeds the limit of 1024 bytes"},
        Case{"ParamNameTooLong",
             [](PlanInput& in) { in.model.units[0].params[1].name = std::string(1025, 'p'); },
             "model.units[0].params[1].name",
             "parameter name of 1025 bytes exceeds the limit of 1024 bytes"},
        Case{"DuplicateUnitName",
             [](PlanInput& in) {
               in.model.units.push_back({"layers.0", {{"other.w", {4, 4}, "muon", false}}});
             },
             "model.units[1].name", "duplicate unit name 'layers.0'"},
        Case{"UnknownOwnerRule", [](PlanInput& in) { in.options.owner_assignment = "best"; },
             "options.owner_assignment", "unknown rule 'best'"},
        Case{"UnknownDevice", [](PlanInput& in) { in.options.device = "tpu"; },
             "options.device", "unknown device 'tpu'"},
        Case{"NegativeCommWeight", [](PlanInput& in) { in.options.comm_flops_per_byte = -1; },
             "options.comm_flops_per_byte", "finite number >= 0"},
        Case{"DdpPlanTooLarge",
             [](PlanInput& in) {
               in.world_size = 1 << 20;
               in.parallelism.data_parallel_sharding_strategy = "no_shard";
               for (int i = 0; i < 30; ++i) {
                 in.model.units[0].params.push_back(
                     {"extra." + std::to_string(i), {4, 4}, "muon", false});
               }
             },
             "world_size", "matrix copies"},
        Case{"TooManyLayoutShards",
             [](PlanInput& in) {
               in.world_size = 1 << 20;
               for (int i = 0; i < 16; ++i) {
                 in.model.units.push_back(
                     {"extra." + std::to_string(i),
                      {{"extra." + std::to_string(i) + ".w", {4, 4}, "muon", false}}});
               }
             },
             "world_size", "shards in all"},
        Case{"StackingOneSizeOfBlocks",
             [](PlanInput& in) {
               in.model.units[0].params[0].muon_block_rows = 4;
               in.model.units[0].params[0].muon_stack_blocks = true;
             },
             "model.units[0].params[0].muon_stack_blocks", "blocks of two sizes to stack"}),
    [](const ::testing::TestParamInfo<Case>& info) { return std::string(info.param.name); });

// Stacked blocks (MLA's kv_b_proj under split_qkv: [k_nope dn | v dv] per
// head, H heads): matrix 0 is every head's k_nope rows, matrix 1 every v
// row, in order. Against rows listed by brute force: TensorRow, the row's
// block, and Among for every tensor row range (a shard's rows).
TEST(ValidateTest, StackedBlocksListEveryRowOfTheirSizeOnce) {
  for (const auto& [dn, dv, heads] : {std::tuple{2, 3, 4}, std::tuple{3, 1, 5}, std::tuple{1, 1, 1}}) {
    SCOPED_TRACE(::testing::Message() << dn << " " << dv << " x" << heads);
    ParamSpec p{"kv_b", {heads * (dn + dv), 7}, "muon", false, dn, dv, true};
    ASSERT_EQ(MuonBlocksOf(p), 2);
    EXPECT_EQ(MuonMatrixOf(p).rows, heads * dn);
    std::vector<int64_t> listed[2];
    for (int64_t r = 0; r < heads * (dn + dv); ++r) {
      const int64_t block = r % (dn + dv) < dn ? 0 : 1;
      listed[block].push_back(r);
      EXPECT_EQ(MuonBlockOfRow(p, r), block) << "row " << r;
    }
    for (int64_t b = 0; b < 2; ++b) {
      const MatrixRows rows = MuonBlockRows(p, b);
      ASSERT_EQ(rows.count, static_cast<int64_t>(listed[b].size()));
      for (int64_t i = 0; i < rows.count; ++i) EXPECT_EQ(rows.TensorRow(i), listed[b][i]);
      for (int64_t lo = 0; lo <= heads * (dn + dv); ++lo) {
        for (int64_t hi = lo; hi <= heads * (dn + dv); ++hi) {
          // The matrix rows inside [lo, hi), counted one by one.
          int64_t first = -1, count = 0;
          for (int64_t i = 0; i < rows.count; ++i) {
            if (listed[b][i] < lo || listed[b][i] >= hi) continue;
            if (first < 0) first = i;
            ++count;
          }
          const RowRange got = rows.Among(lo, hi);
          ASSERT_EQ(got.count, count) << "[" << lo << ", " << hi << ")";
          if (count > 0) {
            EXPECT_EQ(got.start, first);
          }
        }
      }
    }
  }
}

TEST(ValidateTest, ReportsEveryViolationAtOnce) {
  PlanInput in = ValidInput();
  in.world_size = 8;
  in.parallelism.data_parallel_sharding_strategy = "bogus";
  in.parallelism.num_distributed_optimizer_instances = 3;
  in.parallelism.tensor_model_parallel_size = 2;
  in.model.units[0].params[0].shape = {16, -1};
  in.options.ns_steps = -1;
  const std::vector<FieldViolation> v = Validate(in);
  std::vector<std::string> fields;
  for (const auto& f : v) fields.push_back(f.field);
  EXPECT_THAT(fields, ::testing::UnorderedElementsAre(
                          "parallelism.data_parallel_sharding_strategy",
                          "parallelism.num_distributed_optimizer_instances",
                          "parallelism.tensor_model_parallel_size",
                          "model.units[0].params[0].shape[1]", "options.ns_steps"));
  absl::StatusOr<ResolvedConfig> r = Resolve(in);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("3 does not divide world_size 8"));
}

// Names and other strings of any length are quoted cut: a 10 MB name must
// not come back as 10 MB of messages.
TEST(ValidateTest, HugeStringsAreNeverEchoedWhole) {
  const std::string huge(10 << 20, 'x');
  PlanInput in = ValidInput();
  in.model.name = huge;
  in.model.units[0].name = huge;
  in.model.units[0].params[0].name = huge;
  in.model.units[0].params[1].optimizer = huge;
  in.parallelism.data_parallel_sharding_strategy = huge;
  in.options.owner_assignment = huge;
  in.options.device = huge;
  const std::vector<FieldViolation> v = Validate(in);
  EXPECT_EQ(v.size(), 7u);
  for (const FieldViolation& f : v) {
    SCOPED_TRACE(f.field);
    // The longest fixed text of these messages is under 150 bytes.
    EXPECT_LE(f.description.size(), 150u + kMaxQuotedBytes);
  }
  absl::StatusOr<ResolvedConfig> r = Resolve(in);
  EXPECT_LE(r.status().message().size(), 7 * (200u + kMaxQuotedBytes));
}

TEST(ValidateTest, QuoteCutsLongTextOnACharacterBoundary) {
  EXPECT_EQ(Quote("short"), "'short'");
  const std::string exact(kMaxQuotedBytes, 'a');
  EXPECT_EQ(Quote(exact), "'" + exact + "'");
  // 100 three-byte characters: 21 of them (63 bytes) fit in 64 bytes.
  std::string euros;
  for (int i = 0; i < 100; ++i) euros += "\xE2\x82\xAC";
  std::string expected = "'";
  for (int i = 0; i < 21; ++i) expected += "\xE2\x82\xAC";
  expected += "...' (300 bytes)";
  EXPECT_EQ(Quote(euros), expected);
}

TEST(ValidateTest, ZeroMeansUnsetEverywhere) {
  PlanInput in = ValidInput();
  in.parallelism.num_distributed_optimizer_instances = 0;
  in.parallelism.expert_model_parallel_size = 0;
  in.parallelism.tensor_model_parallel_size = 0;
  in.options.ns_steps = 0;
  in.options.comm_flops_per_byte = 0;
  in.model.units[0].gathers_per_step = 0;
  absl::StatusOr<ResolvedConfig> r = Resolve(in);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->instances, 1);
  EXPECT_EQ(r->ep, 1);
  EXPECT_EQ(r->ns_steps, 5);
  EXPECT_EQ(r->comm_flops_per_byte, 1e4);  // cuda, the default device
}

// On the CPU a byte of owner traffic is worth what a rank computes while it
// moves: 25 FLOPs a thread, so four threads make it 100; an explicit rate
// stays as given.
TEST(ValidateTest, TheCpuExchangeRateFollowsTheThreads) {
  PlanInput in = ValidInput();
  in.options.device = "cpu";
  for (int64_t threads : {0, 1, 4}) {
    in.options.threads_per_rank = threads;
    absl::StatusOr<ResolvedConfig> r = Resolve(in);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->comm_flops_per_byte, threads == 4 ? 100.0 : 25.0) << threads;
  }
  in.options.comm_flops_per_byte = 7;
  EXPECT_EQ(Resolve(in)->comm_flops_per_byte, 7);
}

TEST(ValidateTest, DefaultsResolveToZero3WithLpt) {
  absl::StatusOr<ResolvedConfig> r = Resolve(ValidInput());
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->inner, Strategy::kOptimGradsParams);
  EXPECT_EQ(r->instances, 1);
  EXPECT_EQ(r->ep, 1);
  EXPECT_EQ(r->owner_rule, OwnerRule::kLpt);
  EXPECT_EQ(r->ns_steps, 5);
  PlanInput two = ValidInput();
  two.parallelism.num_distributed_optimizer_instances = 2;
  r = Resolve(two);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->outer, Strategy::kOptim);  // HFSDP unless told otherwise
}

}  // namespace
}  // namespace muonmesh::plan

// The Newton-Schulz cost model (plan/ns_cost.h): where the Gram form
// restarts, FLOPs of both forms by hand, the choice auto makes on the real
// specs (derived here from the formulas: at 5 iterations in two segments,
// the Gram form costs 8 m^2 n + 28 m^3 against 20 m^2 n + 10 m^3, so it wins
// exactly when n / m > 1.5), and what the planner charges for each setting.

#include "plan/ns_cost.h"

#include <algorithm>
#include <initializer_list>
#include <iterator>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "plan/planner.h"
#include "plan/validate.h"
#include "tests/plan/spec_loader.h"

namespace muonmesh::plan {
namespace {

// Restarts before an iteration whose R would carry errors amplified past 150
// (the product of a_s^2 over the segment's earlier iterations): quintic
// a^2 = 11.86 (141 after two iterations, 1670 after three: so 0, 3, 6, 9);
// Polar Express a_t^2 = 67.3, 16.5, 15.3, 10.8, 5.19, 3.51, 3.45, 3.52,
// 3.52, ... (67.3 x 16.5 = 1113; 15.3 x 10.8 = 165; 5.19 x 3.51 x 3.45 x
// 3.52 = 221; 3.52^4 = 153: so 0, 2, 4, 8, 12).
TEST(NsCostTest, WhereTheGramFormRestarts) {
  const auto starts = [](NsTable table, int64_t steps) {
    std::vector<int64_t> out;
    for (int64_t t = 0; t < steps; ++t) {
      if (GramStartsAt(t, [table](int64_t s) { return NsTableRow(table, s).a; })) out.push_back(t);
    }
    return out;
  };
  EXPECT_EQ(starts(NsTable::kQuintic, 10), (std::vector<int64_t>{0, 3, 6, 9}));
  EXPECT_EQ(starts(NsTable::kPolarExpress, 14), (std::vector<int64_t>{0, 2, 4, 8, 12}));
}

TEST(NsCostTest, FlopsByHand) {
  constexpr NsTable kQ = NsTable::kQuintic;
  // Standard: T (4 m^2 n + 2 m^3).
  EXPECT_DOUBLE_EQ(StandardNsFlops(2, 3, 1), 4 * 4 * 3 + 2 * 8);
  EXPECT_DOUBLE_EQ(StandardNsFlops(3, 2, 1), 4 * 4 * 3 + 2 * 8);
  // Gram, one iteration: X X^T and Q X_0 (4 m^2 n) and R^2 (2 m^3).
  EXPECT_DOUBLE_EQ(GramNsFlops(2, 3, 1, kQ), 4 * 4 * 3 + 2 * 8);
  // Two iterations, one segment: R^2 twice, P^2 and P^2 R once, P Q once.
  EXPECT_DOUBLE_EQ(GramNsFlops(2, 3, 2, kQ), 4 * 4 * 3 + 5 * 2 * 8);
  // Five: segments of 3 and 2 iterations (R^2 three times, P^2 and P^2 R
  // twice, P Q twice: 9 products of m^3; then 5), and two rounds of X X^T
  // and Q X_0.
  const double m = 768, n = 3072;
  EXPECT_DOUBLE_EQ(GramNsFlops(768, 3072, 5, kQ), 8 * m * m * n + (9 + 5) * 2 * m * m * m);
  EXPECT_DOUBLE_EQ(GramNsFlops(3072, 768, 5, kQ), GramNsFlops(768, 3072, 5, kQ));
  // Seven: 3 + 3 + 1.
  EXPECT_DOUBLE_EQ(GramNsFlops(768, 3072, 7, kQ), 12 * m * m * n + (9 + 9 + 1) * 2 * m * m * m);
  EXPECT_DOUBLE_EQ(GramNsFlops(0, 10, 5, kQ), 0);
  // 1:4 at 5 iterations: 32 + 28 = 60 m^3 against 90 m^3.
  EXPECT_NEAR(GramNsFlops(1024, 4096, 5, kQ) / StandardNsFlops(1024, 4096, 5), 60.0 / 90.0, 1e-12);
  // Polar Express: 5 iterations in segments of 2, 2 and 1; 10 in 2, 2, 4, 2.
  EXPECT_DOUBLE_EQ(GramNsFlops(768, 3072, 5, NsTable::kPolarExpress),
                   12 * m * m * n + (5 + 5 + 1) * 2 * m * m * m);
  EXPECT_DOUBLE_EQ(GramNsFlops(768, 3072, 10, NsTable::kPolarExpress),
                   16 * m * m * n + (5 + 5 + 13 + 5) * 2 * m * m * m);
}

TEST(NsCostTest, FixedFormsAreNeverSwapped) {
  constexpr NsTable kQ = NsTable::kQuintic;
  EXPECT_EQ(ChooseNsForm(NsAlgorithm::kStandard, 8, 800, 5, kQ), NsAlgorithm::kStandard);
  EXPECT_EQ(ChooseNsForm(NsAlgorithm::kGram, 64, 64, 5, kQ), NsAlgorithm::kGram);
  EXPECT_DOUBLE_EQ(NsFlops(NsAlgorithm::kGram, 64, 64, 5, kQ), GramNsFlops(64, 64, 5, kQ));
  EXPECT_DOUBLE_EQ(NsFlops(NsAlgorithm::kStandard, 8, 800, 5, kQ), StandardNsFlops(8, 800, 5));
}

// Every value's name parses back to it; the empty name is the default; any
// other name is refused. For both enums.
template <typename T, typename Parse, typename Name>
void ExpectNamesRoundTrip(std::initializer_list<T> values, T by_default, Parse parse, Name name,
                          std::initializer_list<const char*> unknown) {
  for (T v : values) {
    T parsed = v == by_default ? *std::prev(values.end()) : by_default;
    ASSERT_TRUE(parse(name(v), &parsed)) << name(v);
    EXPECT_EQ(parsed, v);
  }
  T parsed = *std::prev(values.end());
  EXPECT_TRUE(parse("", &parsed));
  EXPECT_EQ(parsed, by_default);
  for (const char* text : unknown) EXPECT_FALSE(parse(text, &parsed)) << text;
}

TEST(NsCostTest, ParsesAndNamesEveryValue) {
  ExpectNamesRoundTrip({NsAlgorithm::kAuto, NsAlgorithm::kStandard, NsAlgorithm::kGram},
                       NsAlgorithm::kAuto, ParseNsAlgorithm, NsAlgorithmName, {"Gram", "fast"});
  ExpectNamesRoundTrip({NsTable::kQuintic, NsTable::kPolarExpress}, NsTable::kQuintic,
                       ParseNsTable, NsTableName, {"cubic", "Quintic"});
}

// Only gram, and only off the CPU, is refused; both validators report this
// one reason (BadSettingsNameTheField, job_test's MuonGramOnCuda).
TEST(NsCostTest, OnlyGramOffTheCpuIsUnavailable) {
  for (const char* device : {"cpu", "cuda"}) {
    for (NsAlgorithm a : {NsAlgorithm::kAuto, NsAlgorithm::kStandard, NsAlgorithm::kGram}) {
      const bool refused = a == NsAlgorithm::kGram && std::string(device) == "cuda";
      const char* why = NsFormUnavailable(a, device);
      EXPECT_EQ(why != nullptr, refused) << device << "/" << NsAlgorithmName(a);
      if (why != nullptr) {
        EXPECT_NE(std::string(why).find("CPU only"), std::string::npos);
      }
    }
  }
}

// On every Muon matrix of the three public specs, auto picks the Gram form
// exactly when the long side exceeds 1.5 times the short one, and the specs
// hold matrices of both kinds.
TEST(NsCostTest, AutoPicksTheCheaperFormOnTheRealSpecs) {
  int gram = 0, standard = 0;
  for (const char* name : {"gpt2-124m", "llama3-8b", "deepseek-v3"}) {
    SCOPED_TRACE(name);
    absl::StatusOr<ModelSpec> spec = testing::LoadSpec(name);
    ASSERT_TRUE(spec.ok()) << spec.status();
    for (const UnitSpec& u : spec->units) {
      for (const ParamSpec& p : u.params) {
        if (p.optimizer != "muon") continue;
        const MatrixView mv = AsMatrix(p);
        const int64_t lo = std::min(mv.rows, mv.cols), hi = std::max(mv.rows, mv.cols);
        const bool wide = 2 * hi > 3 * lo;
        for (NsTable table : {NsTable::kQuintic, NsTable::kPolarExpress}) {
          const NsAlgorithm got = ChooseNsForm(NsAlgorithm::kAuto, mv.rows, mv.cols, 5, table);
          EXPECT_EQ(got, wide ? NsAlgorithm::kGram : NsAlgorithm::kStandard)
              << u.name << "." << p.name << " " << mv.rows << "x" << mv.cols;
          EXPECT_LE(NsFlops(NsAlgorithm::kAuto, mv.rows, mv.cols, 5, table),
                    std::min(GramNsFlops(mv.rows, mv.cols, 5, table),
                             StandardNsFlops(mv.rows, mv.cols, 5)));
          (got == NsAlgorithm::kGram ? gram : standard)++;
        }
      }
    }
  }
  EXPECT_GT(gram, 0);
  EXPECT_GT(standard, 0);
}

PlanInput SmallInput(const std::string& device, const std::string& algorithm) {
  PlanInput in;
  in.model.name = "m";
  in.model.units.push_back({"u", {{"wide", {16, 96}, "muon", false},
                                  {"square", {32, 32}, "muon", false},
                                  {"b", {16}, "adamw", false}}});
  in.world_size = 2;
  in.parallelism.data_parallel_sharding_strategy = "optim_grads_params";
  in.options.device = device;
  in.options.ns_algorithm = algorithm;
  return in;
}

// The planner charges each matrix the FLOPs of the form that runs: on the
// CPU the setting as given; on CUDA (no Gram kernel yet) the standard form.
TEST(NsCostTest, ThePlannerChargesTheFormThatRuns) {
  struct Case {
    const char* device;
    const char* algorithm;
    NsAlgorithm wide, square;
  } cases[] = {{"cpu", "", NsAlgorithm::kGram, NsAlgorithm::kStandard},
               {"cpu", "auto", NsAlgorithm::kGram, NsAlgorithm::kStandard},
               {"cpu", "standard", NsAlgorithm::kStandard, NsAlgorithm::kStandard},
               {"cpu", "gram", NsAlgorithm::kGram, NsAlgorithm::kGram},
               {"cuda", "", NsAlgorithm::kStandard, NsAlgorithm::kStandard},
               {"", "auto", NsAlgorithm::kStandard, NsAlgorithm::kStandard}};
  for (const Case& c : cases) {
    SCOPED_TRACE(std::string(c.device) + "/" + c.algorithm);
    absl::StatusOr<Plan> plan = ComputePlan(SmallInput(c.device, c.algorithm));
    ASSERT_TRUE(plan.ok()) << plan.status();
    ASSERT_EQ(plan->dense.matrices.size(), 2u);
    for (const MatrixPlan& m : plan->dense.matrices) {
      const NsAlgorithm form = m.rows == m.cols ? c.square : c.wide;
      const double want = form == NsAlgorithm::kGram
                              ? GramNsFlops(m.rows, m.cols, 5, NsTable::kQuintic)
                              : StandardNsFlops(m.rows, m.cols, 5);
      EXPECT_DOUBLE_EQ(m.cost_flops, want) << m.rows << "x" << m.cols;
    }
  }
}

TEST(NsCostTest, UnknownCoefficientsNameTheField) {
  PlanInput in = SmallInput("cpu", "");
  in.options.ns_coefficients = "cubic";
  const std::vector<FieldViolation> v = Validate(in);
  ASSERT_EQ(v.size(), 1u);
  EXPECT_EQ(v[0].field, "options.ns_coefficients");
  EXPECT_NE(v[0].description.find("'cubic'"), std::string::npos) << v[0].description;
}

TEST(NsCostTest, BadSettingsNameTheField) {
  for (const auto& [device, algorithm] :
       {std::pair{"cpu", "fast"}, std::pair{"cuda", "gram"}, std::pair{"", "gram"}}) {
    const std::vector<FieldViolation> v = Validate(SmallInput(device, algorithm));
    ASSERT_EQ(v.size(), 1u) << device << "/" << algorithm;
    EXPECT_EQ(v[0].field, "options.ns_algorithm");
    EXPECT_NE(v[0].description.find(std::string(algorithm)), std::string::npos)
        << v[0].description;
  }
}

}  // namespace
}  // namespace muonmesh::plan

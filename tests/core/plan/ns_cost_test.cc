// The Newton-Schulz cost model (plan/ns_cost.h): where the Gram form
// restarts, FLOPs of both forms by hand, the choice auto makes on the real
// specs (derived here from the formulas: at 5 iterations in two segments,
// the Gram form costs 8 m^2 n + 28 m^3 against 20 m^2 n + 10 m^3, so it wins
// exactly when n / m > 1.5), and what the planner charges for each setting.

#include "core/plan/ns_cost.h"

#include <algorithm>
#include <cmath>
#include <initializer_list>
#include <iterator>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "core/plan/planner.h"
#include "core/plan/validate.h"
#include "tests/core/plan/spec_loader.h"

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
  ExpectNamesRoundTrip({NsAlgorithm::kAuto, NsAlgorithm::kStandard, NsAlgorithm::kGram,
                        NsAlgorithm::kSpectral},
                       NsAlgorithm::kAuto, ParseNsAlgorithm, NsAlgorithmName, {"Gram", "fast"});
  ExpectNamesRoundTrip({NsTable::kQuintic, NsTable::kPolarExpress}, NsTable::kQuintic,
                       ParseNsTable, NsTableName, {"cubic", "Quintic"});
}

// Only the Gram forms, and only off the CPU, are refused; both validators
// report this one reason (BadSettingsNameTheField, job_test's MuonGramOnCuda).
TEST(NsCostTest, OnlyGramFormsOffTheCpuAreUnavailable) {
  for (const char* device : {"cpu", "cuda"}) {
    for (NsAlgorithm a : {NsAlgorithm::kAuto, NsAlgorithm::kStandard, NsAlgorithm::kGram,
                          NsAlgorithm::kSpectral}) {
      const bool refused = (a == NsAlgorithm::kGram || a == NsAlgorithm::kSpectral) &&
                           std::string(device) == "cuda";
      const char* why = NsFormUnavailable(a, device);
      EXPECT_EQ(why != nullptr, refused) << device << "/" << NsAlgorithmName(a);
      if (why != nullptr) {
        EXPECT_NE(std::string(why).find("CPU only"), std::string::npos);
      }
    }
  }
}

// auto against the three costs written out by hand at 5 iterations (m, n the
// short and long sides): standard 5 (4 m^2 n + 2 m^3); the Gram iteration
// 8 m^2 n + 28 m^3 (quintic: segments of 3 and 2) or 12 m^2 n + 22 m^3
// (Polar Express: 2, 2 and 1); spectral 6 m^2 n + 30 m^3 + 3000 m^2 (both
// tables' gains, 485 and 976, within its limit). Ties go to standard.
TEST(NsCostTest, AutoPicksTheCheaperFormOnTheRealSpecs) {
  int spectral = 0, standard = 0;
  for (const char* name : {"gpt2-124m", "llama3-8b", "deepseek-v3"}) {
    SCOPED_TRACE(name);
    absl::StatusOr<ModelSpec> spec = testing::LoadSpec(name);
    ASSERT_TRUE(spec.ok()) << spec.status();
    for (const UnitSpec& u : spec->units) {
      for (const ParamSpec& p : u.params) {
        if (p.optimizer != "muon") continue;
        const MatrixView mv = AsMatrix(p);
        const double m = static_cast<double>(std::min(mv.rows, mv.cols));
        const double n = static_cast<double>(std::max(mv.rows, mv.cols));
        for (NsTable table : {NsTable::kQuintic, NsTable::kPolarExpress}) {
          const bool quintic = table == NsTable::kQuintic;
          const double costs[] = {5 * (4 * m * m * n + 2 * m * m * m),
                                  quintic ? 8 * m * m * n + 28 * m * m * m
                                          : 12 * m * m * n + 22 * m * m * m,
                                  6 * m * m * n + 30 * m * m * m + 3000 * m * m};
          const NsAlgorithm forms[] = {NsAlgorithm::kStandard, NsAlgorithm::kGram,
                                       NsAlgorithm::kSpectral};
          int best = 0;
          for (int f = 1; f < 3; ++f) {
            if (costs[f] < costs[best]) best = f;
          }
          const NsAlgorithm got = ChooseNsForm(NsAlgorithm::kAuto, mv.rows, mv.cols, 5, table);
          EXPECT_EQ(got, forms[best])
              << u.name << "." << p.name << " " << mv.rows << "x" << mv.cols;
          EXPECT_DOUBLE_EQ(NsFlops(NsAlgorithm::kAuto, mv.rows, mv.cols, 5, table), costs[best]);
          (got == NsAlgorithm::kSpectral ? spectral : standard)++;
        }
      }
    }
  }
  EXPECT_GT(spectral, 0);
  EXPECT_GT(standard, 0);
}

PlanInput SmallInput(const std::string& device, const std::string& algorithm) {
  PlanInput in;
  in.model.name = "m";
  in.model.units.push_back({"u", {{"wide", {16, 4096}, "muon", false},
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
  } cases[] = {{"cpu", "", NsAlgorithm::kSpectral, NsAlgorithm::kStandard},
               {"cpu", "auto", NsAlgorithm::kSpectral, NsAlgorithm::kStandard},
               {"cpu", "standard", NsAlgorithm::kStandard, NsAlgorithm::kStandard},
               {"cpu", "gram", NsAlgorithm::kGram, NsAlgorithm::kGram},
               {"cpu", "spectral", NsAlgorithm::kSpectral, NsAlgorithm::kSpectral},
               {"cuda", "", NsAlgorithm::kStandard, NsAlgorithm::kStandard},
               {"", "auto", NsAlgorithm::kStandard, NsAlgorithm::kStandard}};
  for (const Case& c : cases) {
    SCOPED_TRACE(std::string(c.device) + "/" + c.algorithm);
    absl::StatusOr<Plan> plan = ComputePlan(SmallInput(c.device, c.algorithm));
    ASSERT_TRUE(plan.ok()) << plan.status();
    ASSERT_EQ(plan->dense.matrices.size(), 2u);
    for (const MatrixPlan& m : plan->dense.matrices) {
      const NsAlgorithm form = m.rows == m.cols ? c.square : c.wide;
      const double lo = static_cast<double>(std::min(m.rows, m.cols));
      const double hi = static_cast<double>(std::max(m.rows, m.cols));
      double want = StandardNsFlops(m.rows, m.cols, 5);
      if (form == NsAlgorithm::kGram) want = GramNsFlops(m.rows, m.cols, 5, NsTable::kQuintic);
      if (form == NsAlgorithm::kSpectral) {
        want = 6 * lo * lo * hi + 30 * lo * lo * lo + 3000 * lo * lo;
      }
      EXPECT_EQ(m.ns_form, form) << m.rows << "x" << m.cols;
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
       {std::pair{"cpu", "fast"}, std::pair{"cuda", "gram"}, std::pair{"", "gram"},
        std::pair{"cuda", "spectral"}}) {
    const std::vector<FieldViolation> v = Validate(SmallInput(device, algorithm));
    ASSERT_EQ(v.size(), 1u) << device << "/" << algorithm;
    EXPECT_EQ(v[0].field, "options.ns_algorithm");
    EXPECT_NE(v[0].description.find(std::string(algorithm)), std::string::npos)
        << v[0].description;
  }
}

// The spectral form's gain limit: 5 quintic (gain 485) and 5 Polar Express
// (976) iterations are within it, 6 of Polar Express (1828) too, 7 (3394) and
// 10 quintic (2.3e5) are not; an explicit spectral beyond it is refused
// naming the field, auto passes it by.
TEST(NsCostTest, SpectralStopsAtItsGainLimit) {
  EXPECT_NEAR(NsTotalGain(5, NsTable::kQuintic), 3.4445 * 3.4445 * 3.4445 * 3.4445 * 3.4445,
              1e-9);
  EXPECT_NEAR(NsTotalGain(2, NsTable::kPolarExpress), 8.2051 * 4.0664, 1e-9);
  EXPECT_TRUE(SpectralGainProblem(5, NsTable::kQuintic).empty());
  EXPECT_TRUE(SpectralGainProblem(6, NsTable::kPolarExpress).empty());
  EXPECT_FALSE(SpectralGainProblem(7, NsTable::kPolarExpress).empty());
  EXPECT_NE(ChooseNsForm(NsAlgorithm::kAuto, 256, 8192, 10, NsTable::kQuintic),
            NsAlgorithm::kSpectral);
  EXPECT_EQ(ChooseNsForm(NsAlgorithm::kAuto, 256, 8192, 5, NsTable::kQuintic),
            NsAlgorithm::kSpectral);
  // Nor past LAPACK's 32-bit work size: 1 + 6 m + 2 m^2 <= 2^31 - 1 up to m = 32766.
  EXPECT_LE(1 + 6 * kSpectralMaxShortSide + 2 * kSpectralMaxShortSide * kSpectralMaxShortSide,
            int64_t{2147483647});
  EXPECT_GT(1 + 6 * (kSpectralMaxShortSide + 1) +
                2 * (kSpectralMaxShortSide + 1) * (kSpectralMaxShortSide + 1),
            int64_t{2147483647});
  EXPECT_EQ(ChooseNsForm(NsAlgorithm::kAuto, 32767, 65536, 5, NsTable::kQuintic),
            NsAlgorithm::kGram);
  PlanInput in = SmallInput("cpu", "spectral");
  in.options.ns_steps = 10;
  const std::vector<FieldViolation> v = Validate(in);
  ASSERT_EQ(v.size(), 1u);
  EXPECT_EQ(v[0].field, "options.ns_algorithm");
  EXPECT_NE(v[0].description.find("gives 235105"), std::string::npos) << v[0].description;
  // 40 iterations: a gain past any integer type, shown as what it is.
  in.options.ns_steps = 40;
  const std::vector<FieldViolation> big = Validate(in);
  ASSERT_EQ(big.size(), 1u);
  EXPECT_NE(big[0].description.find("gives 3.06e+21"), std::string::npos)
      << big[0].description;
  // Steps out of range are reported as such, and the gain (a loop over the
  // steps) is not computed for them.
  in.options.ns_steps = int64_t{1} << 40;
  const std::vector<FieldViolation> huge = Validate(in);
  ASSERT_EQ(huge.size(), 1u);
  EXPECT_EQ(huge[0].field, "options.ns_steps");
}

// An explicit spectral form on a matrix past LAPACK's size limit is refused
// by the planner, naming the first such matrix; one at the limit passes.
TEST(NsCostTest, SpectralPastItsShortSideIsRefusedByThePlanner) {
  PlanInput in = SmallInput("cpu", "spectral");
  in.model.units[0].params.push_back({"at_limit", {kSpectralMaxShortSide, 65536}, "muon", false});
  EXPECT_TRUE(Validate(in).empty());
  in.model.units[0].params.push_back(
      {"past", {kSpectralMaxShortSide + 1, kSpectralMaxShortSide + 1}, "muon", false});
  in.model.units[0].params.push_back({"also", {40000, 40000}, "muon", false});
  const std::vector<FieldViolation> v = Validate(in);
  ASSERT_EQ(v.size(), 1u);
  EXPECT_EQ(v[0].field, "options.ns_algorithm");
  EXPECT_NE(v[0].description.find("model.units[0].params[4] ('past') is 32767 x 32767 (and 1 "
                                  "more)"),
            std::string::npos)
      << v[0].description;
  in.options.ns_algorithm = "auto";  // auto takes another form there
  EXPECT_TRUE(Validate(in).empty());
}

// The thread count prices the spectral form's eigensolver: on T >= 2
// threads its share (0.89) of the 30 m^3 term and its 3000 m^2 term cost
// T / 1.14 times over, the rest as on one thread. With five quintic
// iterations the Gram iteration costs 8 m^2 n + 28 m^3 (two segments), the
// standard one 20 m^2 n + 10 m^3, the spectral form on one thread
// 6 m^2 n + 30 m^3 + 3000 m^2, so with r = n / m it wins over the Gram form
// from r = 1 + 1500 / m (2.46 at m = 1024, 12.7 at m = 128; the Gram form
// wins over the standard one from r = 1.5). On two threads
// 6 m^2 n + 30 (0.11 + 0.89 * 2 / 1.14) m^3 + 3000 (2 / 1.14) m^2, at
// m = 1024 (6 r + 55.28) m^3, so the Gram form wins up to r = 13.64: at 1:4
// as measured there (2.11x sgemm against 1.94x; at 1:8 the two measured
// within 2%). On eight threads at m = 64, (6 r + 519.6) m^3 needs r > 245.8.
TEST(NsCostTest, ThreadsPriceTheSpectralEigensolver) {
  const double m = 1024;
  const auto cubes = [](int64_t threads) {
    const double slowdown = threads == 1 ? 1.0 : static_cast<double>(threads) / 1.14;
    return 30.0 * (0.11 + 0.89 * slowdown) + 3000.0 * slowdown / 1024.0;
  };
  for (const int64_t threads : {1, 2, 3, 8}) {
    EXPECT_NEAR(SpectralNsFlops(1024, 4096, threads) / (m * m * m), 24 + cubes(threads), 1e-9)
        << threads;
    EXPECT_DOUBLE_EQ(SpectralNsFlops(4096, 1024, threads), SpectralNsFlops(1024, 4096, threads));
    // Whole FLOPs, so that sums over matrices are exact in any order.
    EXPECT_EQ(SpectralNsFlops(1000, 7003, threads),
              std::floor(SpectralNsFlops(1000, 7003, threads)))
        << threads;
  }
  const auto form = [](int64_t rows, int64_t cols, int64_t threads) {
    return ChooseNsForm(NsAlgorithm::kAuto, rows, cols, 5, NsTable::kQuintic, threads);
  };
  EXPECT_EQ(form(1024, 1472, 1), NsAlgorithm::kStandard);  // n / m = 1.4375
  EXPECT_EQ(form(1024, 1600, 1), NsAlgorithm::kGram);      // 1.5625
  EXPECT_EQ(form(1024, 2432, 1), NsAlgorithm::kGram);      // 2.375
  EXPECT_EQ(form(1024, 2560, 1), NsAlgorithm::kSpectral);  // 2.5
  EXPECT_EQ(form(1024, 8192, 1), NsAlgorithm::kSpectral);
  EXPECT_EQ(form(128, 344, 1), NsAlgorithm::kGram);        // small: the m^2 term
  EXPECT_EQ(form(128, 1536, 1), NsAlgorithm::kGram);       // 12
  EXPECT_EQ(form(128, 1664, 1), NsAlgorithm::kSpectral);   // 13
  EXPECT_EQ(form(1024, 4096, 2), NsAlgorithm::kGram);
  EXPECT_EQ(form(1024, 13824, 2), NsAlgorithm::kGram);     // 13.5
  EXPECT_EQ(form(1024, 14336, 2), NsAlgorithm::kSpectral); // 14
  EXPECT_EQ(form(64, 15680, 8), NsAlgorithm::kGram);       // 245
  EXPECT_EQ(form(64, 15808, 8), NsAlgorithm::kSpectral);   // 247
  EXPECT_EQ(form(1024, 1024, 1), NsAlgorithm::kStandard);
  // What the planner charges follows the form and the threads; explicit
  // forms do not change with threads.
  EXPECT_DOUBLE_EQ(NsFlops(NsAlgorithm::kAuto, 1024, 4096, 5, NsTable::kQuintic, 2),
                   GramNsFlops(1024, 4096, 5, NsTable::kQuintic));
  EXPECT_DOUBLE_EQ(NsFlops(NsAlgorithm::kSpectral, 1024, 4096, 5, NsTable::kQuintic, 2),
                   SpectralNsFlops(1024, 4096, 2));
  EXPECT_EQ(ChooseNsForm(NsAlgorithm::kSpectral, 1024, 1024, 5, NsTable::kQuintic, 8),
            NsAlgorithm::kSpectral);
}

}  // namespace
}  // namespace muonmesh::plan

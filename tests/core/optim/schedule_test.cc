// The recipe's per-step factors (core/optim/schedule.h) at chosen steps,
// each value worked out by hand from the formulas in the header (the cosine
// ones with cos(pi/2) = 0 and cos(3 pi/4) = -sqrt(2)/2).

#include "core/optim/schedule.h"

#include <cmath>
#include <string>

#include "gtest/gtest.h"

namespace muonmesh::optim {
namespace {

TEST(LrScheduleTest, WarmupThenCosineToTheFloor) {
  const LrSchedule s{.warmup_steps = 1, .decay = LrDecay::kCosine, .min_lr_ratio = 0.1};
  EXPECT_DOUBLE_EQ(LrMultiplier(s, 0, 5), 1.0);   // (0 + 1) / 1
  EXPECT_DOUBLE_EQ(LrMultiplier(s, 1, 5), 1.0);   // q = 0
  EXPECT_DOUBLE_EQ(LrMultiplier(s, 3, 5), 0.55);  // q = 1/2: 0.1 + 0.9 / 2
  EXPECT_NEAR(LrMultiplier(s, 4, 5), 0.1 + 0.45 * (1 - std::sqrt(2.0) / 2), 1e-15);  // q = 3/4
}

TEST(LrScheduleTest, WarmupStartsAtOneOverW) {
  const LrSchedule s{.warmup_steps = 4, .decay = LrDecay::kLinear};
  EXPECT_DOUBLE_EQ(LrMultiplier(s, 0, 12), 0.25);
  EXPECT_DOUBLE_EQ(LrMultiplier(s, 2, 12), 0.75);
  EXPECT_DOUBLE_EQ(LrMultiplier(s, 3, 12), 1.0);
  EXPECT_DOUBLE_EQ(LrMultiplier(s, 4, 12), 1.0);    // q = 0
  EXPECT_DOUBLE_EQ(LrMultiplier(s, 8, 12), 0.5);    // q = 4/8
  EXPECT_DOUBLE_EQ(LrMultiplier(s, 11, 12), 0.125); // q = 7/8
  EXPECT_DOUBLE_EQ(LrMultiplier(s, 99, 12), 0.125); // past the end: the last step's
}

TEST(LrScheduleTest, ConstantAfterWarmupEvenWhenTheWarmupIsLonger) {
  const LrSchedule s{.warmup_steps = 10};
  EXPECT_DOUBLE_EQ(LrMultiplier(s, 0, 5), 0.1);
  EXPECT_DOUBLE_EQ(LrMultiplier(s, 4, 5), 0.5);
  EXPECT_DOUBLE_EQ(LrMultiplier(LrSchedule{}, 3, 5), 1.0);
}

TEST(LrScheduleTest, WsdHoldsThenDecaysOverItsLastSteps) {
  const LrSchedule s{.decay = LrDecay::kWsd, .decay_steps = 4, .min_lr_ratio = 0.2};
  EXPECT_DOUBLE_EQ(LrMultiplier(s, 0, 10), 1.0);
  EXPECT_DOUBLE_EQ(LrMultiplier(s, 6, 10), 1.0);  // S - D: the decay's first step
  EXPECT_DOUBLE_EQ(LrMultiplier(s, 7, 10), 0.8);  // 1 - 0.8 / 4
  EXPECT_DOUBLE_EQ(LrMultiplier(s, 9, 10), 0.4);  // 1 - 0.8 * 3 / 4
}

TEST(LrScheduleTest, BadSchedulesNameTheirField) {
  std::string field;
  const auto error = [&](const LrSchedule& s, int64_t steps) {
    field.clear();
    return ScheduleError(s, steps, "training.lr_schedule", &field);
  };
  EXPECT_EQ(error({.warmup_steps = 5, .decay = LrDecay::kCosine}, 100), "");
  EXPECT_NE(error({.warmup_steps = 100, .decay = LrDecay::kCosine}, 100), "");
  EXPECT_EQ(field, "training.lr_schedule.warmup_steps");
  EXPECT_EQ(error({.warmup_steps = 100}, 100), "");  // constant: a warmup only
  EXPECT_NE(error({.warmup_steps = -1}, 100), "");
  EXPECT_NE(error({.min_lr_ratio = 1.5}, 100), "");
  EXPECT_EQ(field, "training.lr_schedule.min_lr_ratio");
  EXPECT_NE(error({.min_lr_ratio = std::nan("")}, 100), "");
  EXPECT_NE(error({.decay = LrDecay::kWsd}, 100), "");
  EXPECT_EQ(field, "training.lr_schedule.decay_steps");
  EXPECT_NE(error({.warmup_steps = 10, .decay = LrDecay::kWsd, .decay_steps = 91}, 100), "");
  EXPECT_EQ(field, "training.lr_schedule.decay_steps");
  EXPECT_EQ(error({.warmup_steps = 10, .decay = LrDecay::kWsd, .decay_steps = 90}, 100), "");
  EXPECT_NE(error({.decay = LrDecay::kCosine, .decay_steps = 3}, 100), "");
}

TEST(LrScheduleTest, DecayNames) {
  for (LrDecay d : {LrDecay::kConstant, LrDecay::kCosine, LrDecay::kLinear, LrDecay::kWsd}) {
    EXPECT_EQ(ParseLrDecay(LrDecayName(d)), d);
  }
  EXPECT_EQ(ParseLrDecay(""), LrDecay::kConstant);
  EXPECT_FALSE(ParseLrDecay("exponential").has_value());
}

TEST(MomentumWarmupTest, RisesLinearlyFromItsStart) {
  const MomentumWarmup w{.start = 0.85, .steps = 300};
  EXPECT_DOUBLE_EQ(MomentumAt(0.95, w, 0), 0.85);
  EXPECT_NEAR(MomentumAt(0.95, w, 150), 0.90, 1e-15);
  EXPECT_DOUBLE_EQ(MomentumAt(0.95, w, 300), 0.95);
  EXPECT_DOUBLE_EQ(MomentumAt(0.95, w, 1000), 0.95);
  EXPECT_DOUBLE_EQ(MomentumAt(0.95, std::nullopt, 0), 0.95);
}

}  // namespace
}  // namespace muonmesh::optim

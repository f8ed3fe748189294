#include "core/optim/schedule.h"

#include <algorithm>
#include <cmath>
#include <numbers>

#include "absl/strings/str_cat.h"

namespace muonmesh::optim {

std::optional<LrDecay> ParseLrDecay(std::string_view name) {
  if (name.empty() || name == "constant") return LrDecay::kConstant;
  if (name == "cosine") return LrDecay::kCosine;
  if (name == "linear") return LrDecay::kLinear;
  if (name == "wsd") return LrDecay::kWsd;
  return std::nullopt;
}

std::string LrDecayName(LrDecay decay) {
  switch (decay) {
    case LrDecay::kConstant:
      return "constant";
    case LrDecay::kCosine:
      return "cosine";
    case LrDecay::kLinear:
      return "linear";
    case LrDecay::kWsd:
      return "wsd";
  }
  return "?";
}

double LrMultiplier(const LrSchedule& schedule, int64_t step, int64_t total_steps) {
  const int64_t s = std::clamp<int64_t>(step, 0, std::max<int64_t>(total_steps - 1, 0));
  const int64_t w = schedule.warmup_steps;
  if (s < w) return static_cast<double>(s + 1) / static_cast<double>(w);
  const double r = schedule.min_lr_ratio;
  const double q = total_steps > w ? static_cast<double>(s - w) / static_cast<double>(total_steps - w)
                                   : 0.0;
  switch (schedule.decay) {
    case LrDecay::kConstant:
      return 1.0;
    case LrDecay::kCosine:
      return r + (1.0 - r) * 0.5 * (1.0 + std::cos(std::numbers::pi * q));
    case LrDecay::kLinear:
      return 1.0 - (1.0 - r) * q;
    case LrDecay::kWsd: {
      const int64_t d = schedule.decay_steps;
      const int64_t begin = total_steps - d;
      if (d <= 0 || s < begin) return 1.0;
      return 1.0 - (1.0 - r) * static_cast<double>(s - begin) / static_cast<double>(d);
    }
  }
  return 1.0;
}

std::string ScheduleError(const LrSchedule& schedule, int64_t total_steps,
                          const std::string& prefix, std::string* field) {
  const auto fail = [&](const char* name, std::string why) {
    *field = absl::StrCat(prefix, ".", name);
    return why;
  };
  if (schedule.warmup_steps < 0) return fail("warmup_steps", "must be >= 0");
  if (schedule.decay != LrDecay::kConstant && total_steps > 0 &&
      schedule.warmup_steps >= total_steps) {
    return fail("warmup_steps",
                absl::StrCat(schedule.warmup_steps, " leaves no step of training.steps (",
                             total_steps, ") to decay over; at most ", total_steps - 1));
  }
  if (!(schedule.min_lr_ratio >= 0.0 && schedule.min_lr_ratio <= 1.0)) {
    return fail("min_lr_ratio", absl::StrCat(schedule.min_lr_ratio, " is outside [0, 1]"));
  }
  if (schedule.decay == LrDecay::kWsd) {
    if (schedule.decay_steps < 1) return fail("decay_steps", "must be >= 1 with decay: wsd");
    if (total_steps > 0 && schedule.decay_steps > total_steps - schedule.warmup_steps) {
      return fail("decay_steps",
                  absl::StrCat(schedule.decay_steps, " is more than the ",
                               total_steps - schedule.warmup_steps,
                               " steps after the warmup (training.steps - warmup_steps)"));
    }
  } else if (schedule.decay_steps != 0) {
    return fail("decay_steps", absl::StrCat("only for decay: wsd (this schedule decays ",
                                            LrDecayName(schedule.decay), ")"));
  }
  return "";
}

double MomentumAt(double momentum, const std::optional<MomentumWarmup>& warmup, int64_t step) {
  if (!warmup.has_value() || warmup->steps <= 0) return momentum;
  const double f = std::min(1.0, static_cast<double>(std::max<int64_t>(step, 0)) /
                                     static_cast<double>(warmup->steps));
  return warmup->start + (momentum - warmup->start) * f;
}

}  // namespace muonmesh::optim

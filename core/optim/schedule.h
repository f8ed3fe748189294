#pragma once

// The training recipe's per-step factors (docs/architecture.md §5, "The
// recipe"): the learning-rate multiplier m(s) of a warmup followed by a
// decay, and Muon's momentum warmup. Pure functions of the step; every rank
// computes the same numbers, so no rank needs to be told them.
//
// With S steps and s = 0 .. S-1 the step whose update is being made:
//   m(s) = (s + 1) / W                          for s < W (warmup);
//   after it, q = (s - W) / (S - W):
//     constant  1
//     cosine    r + (1 - r) (1 + cos(pi q)) / 2
//     linear    1 - (1 - r) q
//     wsd       1 until S - D, then 1 - (1 - r) (s - (S - D)) / D.
// (Hugging Face's get_cosine_schedule_with_warmup convention: the first
// step already moves at 1/W of the rate.) Both optimizers take lr m(s), and
// their decoupled weight decay with it: p <- p (1 - lr m(s) wd).
//
// Momentum warmup (modded-nanogpt's): beta(s) = b0 + (beta - b0) min(1, s / Wm).

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace muonmesh::optim {

enum class LrDecay { kConstant, kCosine, kLinear, kWsd };

std::optional<LrDecay> ParseLrDecay(std::string_view name);
std::string LrDecayName(LrDecay decay);

struct LrSchedule {
  int64_t warmup_steps = 0;       // W
  LrDecay decay = LrDecay::kConstant;
  int64_t decay_steps = 0;        // D (wsd only)
  double min_lr_ratio = 0;        // r, in [0, 1]
};

// m(s) for a job of `total_steps` (S). `schedule` must be valid for it
// (ScheduleError empty); steps past S - 1 are taken as S - 1.
double LrMultiplier(const LrSchedule& schedule, int64_t step, int64_t total_steps);

// Why `schedule` cannot run `total_steps` steps, naming the field under
// `prefix` (e.g. "training.lr_schedule"); empty when it can.
std::string ScheduleError(const LrSchedule& schedule, int64_t total_steps,
                          const std::string& prefix, std::string* field);

struct MomentumWarmup {
  double start = 0.85;  // b0, in [0, 1)
  int64_t steps = 300;  // Wm, >= 1
};

// beta(s): `momentum` itself without a warmup.
double MomentumAt(double momentum, const std::optional<MomentumWarmup>& warmup, int64_t step);

}  // namespace muonmesh::optim

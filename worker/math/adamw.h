#pragma once

// AdamW with torch.optim.AdamW semantics (no amsgrad, not maximize), on a flat
// shard of one or more parameters. Stateless and thread-safe: the caller owns
// the moment buffers (zero before the first step) and the step count.
//
// For step t >= 1, elementwise and in torch's order:
//   p <- p (1 - lr wd)                        (decoupled weight decay, first)
//   m <- lerp(m, g, 1 - beta1)
//   v <- v beta2 + (1 - beta2) g g
//   p <- p - (lr / (1 - beta1^t)) m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
// Scalars are computed in double and rounded to float once.

#include <cstdint>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "core/optim/optimizer_options.h"
#include "core/optim/types.h"

namespace muonmesh::math {

// One AdamW step; `step` is t, the 1-based count of this step. All four
// buffers have the same size. InvalidArgument, with nothing written, for
// invalid options, step < 1, mismatched sizes, a NaN/infinity in grad or the
// state, or a result that would be non-finite (the step is refused).
absl::Status AdamWStep(const optim::AdamWOptions& options, int64_t step, absl::Span<const float> grad,
                       absl::Span<float> exp_avg, absl::Span<float> exp_avg_sq,
                       absl::Span<float> param);

}  // namespace muonmesh::math

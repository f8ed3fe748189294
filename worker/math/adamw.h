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
#include "worker/math/types.h"

namespace muonmesh::math {

// OK or InvalidArgument naming the field: lr, eps, weight_decay finite and
// >= 0, betas in [0, 1), lr * weight_decay <= 1.
absl::Status ValidateAdamWOptions(const AdamWOptions& options);

// The per-element scalars of step t (1-based), each computed in double and
// rounded to float once; AdamWStep and the CUDA kernels both use these, so
// they round alike.
struct AdamWScalars {
  float decay;            // 1 - lr wd
  float one_minus_beta1;  // lerp weight of the first moment
  float beta2;
  float one_minus_beta2;
  float bias_correction2_sqrt;
  float eps;
  float neg_step_size;  // -lr / (1 - beta1^t)
};
AdamWScalars AdamWScalarsFor(const AdamWOptions& options, int64_t step);

// One AdamW step; `step` is t, the 1-based count of this step. All four
// buffers have the same size. InvalidArgument, with nothing written, for
// invalid options, step < 1, mismatched sizes, a NaN/infinity in grad or the
// state, or a result that would be non-finite (the step is refused).
absl::Status AdamWStep(const AdamWOptions& options, int64_t step, absl::Span<const float> grad,
                       absl::Span<float> exp_avg, absl::Span<float> exp_avg_sq,
                       absl::Span<float> param);

}  // namespace muonmesh::math

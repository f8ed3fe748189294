#pragma once

// The optimizers' options checked and turned into the scalars their
// arithmetic uses, apart from that arithmetic (worker/math/ on the CPU,
// worker/cuda/ on GPUs): the job file's rules (proto/job/) and the CUDA
// kernels share them without linking OpenBLAS. Free functions, any thread.

#include <cstdint>

#include "absl/status/status.h"
#include "core/optim/types.h"

namespace muonmesh::optim {

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

// OK or InvalidArgument naming the field: lr and weight_decay must be finite
// and >= 0, momentum in [0, 1), lr * weight_decay <= 1, ns as
// ValidateNsOptions.
absl::Status ValidateMuonOptions(const MuonOptions& options);

// The update scale of a rows x cols matrix (torch's _adjust_lr ratio):
// sqrt(max(1, rows / cols)) or 0.2 sqrt(max(rows, cols)).
double MuonUpdateScale(MuonScale scale, int64_t rows, int64_t cols);

}  // namespace muonmesh::optim

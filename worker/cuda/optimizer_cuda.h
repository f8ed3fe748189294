#pragma once

// The elementwise optimizer steps of worker/math on device memory: AdamW and
// Muon's two elementwise phases (momentum and Nesterov input before
// Newton-Schulz, momentum and weight update after). The same options, the
// same checks, the same all-or-nothing refusals and the same results, bit
// for bit (worker/cuda/optimizer_kernels.h says how).
//
// A CudaOptimizer is bound to one stream on the device current at Create; it
// owns a flag word in device memory and a pinned host copy. Each call
// launches a check pass, waits for the stream, and then (if nothing is
// refused) the commit pass, and returns once the commit is queued: callers
// that read the results on the host synchronise the stream. One thread at a
// time.

#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/optim/types.h"

namespace muonmesh::cuda {

class CudaOptimizer {
 public:
  // FailedPrecondition without a device.
  static absl::StatusOr<std::unique_ptr<CudaOptimizer>> Create(cudaStream_t stream = nullptr);
  ~CudaOptimizer();
  CudaOptimizer(const CudaOptimizer&) = delete;
  CudaOptimizer& operator=(const CudaOptimizer&) = delete;

  // math::AdamWStep on `count` elements of device buffers.
  absl::Status AdamWStep(const optim::AdamWOptions& options, int64_t step, const float* grad,
                         float* exp_avg, float* exp_avg_sq, float* param, int64_t count);

  // math::MuonPrepare: writes `update`.
  absl::Status MuonPrepare(const optim::MuonOptions& options, const float* grad,
                           const float* momentum, float* update, int64_t count);

  // math::MuonApply on a shard of whole rows of a rows x cols matrix.
  absl::Status MuonApply(const optim::MuonOptions& options, int64_t rows, int64_t cols,
                         const float* grad, const float* orthogonalized, float* momentum,
                         float* param, int64_t count);

  // The first index in [0, count) whose x is not finite, or count.
  absl::StatusOr<int64_t> FirstNonFinite(const float* x, int64_t count);

  cudaStream_t stream() const { return stream_; }

 private:
  CudaOptimizer(cudaStream_t stream, long long* device_flag, long long* host_flag);
  // Sets the flag to `count`, runs `check` and returns the first flagged
  // index, or `count` when none.
  template <typename Launch>
  absl::StatusOr<int64_t> FirstBad(int64_t count, Launch check);

  cudaStream_t stream_;
  long long* device_flag_;
  long long* host_flag_;  // pinned
};

}  // namespace muonmesh::cuda

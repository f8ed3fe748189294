#pragma once

// The `synthetic` workload (worker/model/synthetic.h) with its gradients
// generated on a CUDA GPU, for jobs with `device: cuda`: the same spec, the
// same initial weights (written on the host, as Workload says) and the same
// gradients bit for bit (worker/cuda/uniform_kernels.h), in device memory.
// The loss is the same sum of squares, summed in double on the GPU in a fixed
// order of its own (so equal to the CPU's to double rounding, not bit for
// bit).
//
// Built only with MUONMESH_ENABLE_CUDA. Uses the GPU current on the calling
// thread, on a stream of its own, and waits for its work before returning.

#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>

#include "absl/status/statusor.h"
#include "worker/model/synthetic.h"
#include "worker/model/cuda_workload.h"
#include "worker/model/workload.h"

namespace muonmesh::worker {

class CudaSynthetic final : public CudaWorkload<Synthetic> {
 public:
  static absl::StatusOr<std::unique_ptr<CudaSynthetic>> Create(Synthetic synthetic);
  ~CudaSynthetic() override;

  // Synthetic::ForwardBackwardByUnit's calls and results, with the gradient
  // buffers in device memory.
  absl::StatusOr<double> ForwardBackwardByUnit(int64_t step, UnitAccess& units,
                                               absl::Span<const int64_t> samples) override;

 private:
  CudaSynthetic(Synthetic cpu, cudaStream_t stream, double* partial, double* sums,
                float* scratch);
  // Sum of squares of `count` device floats, in double.
  absl::StatusOr<double> SumSquares(const float* x, int64_t count);

  cudaStream_t stream_;
  double* partial_;  // device: first-stage partial sums
  double* sums_;     // device: one result
  float* scratch_;   // device: kScratch floats for expert slices of other groups
};

}  // namespace muonmesh::worker

#pragma once

// The `moe_mlp` workload (worker/model/moe_mlp.h) on a CUDA GPU, for jobs
// with `device: cuda`: the same definition, the same call order and the same
// token exchanges (ExchangeTokens buffers in device memory), with the
// products on cuBLAS (fp32) and the row moves and elementwise steps as
// kernels (worker/cuda/mlp_kernels.h). The routing bookkeeping is small and
// stays on the host: the router's logits come back to the host, where the
// softmax, the argmax (lowest index on ties), the dispatch order and the
// router's gradient are computed in double exactly as on the CPU, and go
// back as index and gate arrays. Results agree with the CPU workload to fp32
// rounding (cuBLAS and tanhf round differently), not bit for bit; a token
// whose two best router scores are within that rounding may pick another
// expert than on the CPU.
//
// Built only with MUONMESH_ENABLE_CUDA. Uses the GPU current on the creating
// thread, on a stream of its own; waits for its work before returning.

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "worker/model/moe_mlp.h"
#include "worker/model/cuda_workload.h"
#include "worker/model/workload.h"

namespace muonmesh::worker {

class CudaMoeMlp final : public CudaWorkload<MoeMlp> {
 public:
  // Copies `moe`'s dataset to the current GPU.
  static absl::StatusOr<std::unique_ptr<CudaMoeMlp>> Create(MoeMlp moe);
  ~CudaMoeMlp() override;
  CudaMoeMlp(const CudaMoeMlp&) = delete;
  CudaMoeMlp& operator=(const CudaMoeMlp&) = delete;

  // MoeMlp::ForwardBackwardByUnit's calls, exchanges and results.
  absl::StatusOr<double> ForwardBackwardByUnit(int64_t step, UnitAccess& units,
                                               absl::Span<const int64_t> samples) override;

 private:
  class Scratch;
  explicit CudaMoeMlp(MoeMlp cpu);
  absl::Status Init();
  struct Pass;  // one call's routing and token counts
  absl::StatusOr<double> Run(UnitAccess& units, absl::Span<const int64_t> samples);
  // The steps of Run, in order. Each acquires the units it uses and releases
  // them, except that Dispatch and ExpertsForward run under Run's hold of
  // unit 1; OutputLayer returns the sum of squared errors.
  absl::Status ReserveFor(int64_t n, int ep);
  absl::Status InputForward(UnitAccess& units, int64_t n);
  absl::Status Dispatch(UnitAccess& units, const float* w_router, Pass& pass);
  absl::Status ExpertsForward(UnitAccess& units, const float* w1, const float* w2, Pass& pass);
  absl::StatusOr<double> OutputLayer(UnitAccess& units, int64_t n);
  absl::Status ExpertsBackward(UnitAccess& units, const Pass& pass);
  absl::Status InputBackward(UnitAccess& units, int64_t n);
  // C[m, n] = alpha op(A) op(B) + beta C (row-major), on cuBLAS.
  absl::Status Gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha,
                    const float* a, const float* b, float beta, float* c);
  absl::Status Sync();

  cudaStream_t stream_ = nullptr;
  cublasHandle_t blas_ = nullptr;
  float* x_ = nullptr;
  float* y_ = nullptr;
  std::unique_ptr<Scratch> scratch_;
};

}  // namespace muonmesh::worker

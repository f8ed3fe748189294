#pragma once

// The `moe_mlp` workload (worker/model/moe_mlp.h) on a CUDA GPU, for jobs
// with `device: cuda`: the same definition, and the same walk over the units
// and token exchanges as the host's (RunMoeMlpPasses, moe_mlp_passes.h; the
// exchange buffers in device memory), with the
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
#include "worker/model/moe_mlp_passes.h"
#include "worker/model/cuda_workload.h"
#include "worker/model/workload.h"

namespace muonmesh::worker {

class CudaMoeMlp final : public CudaWorkload<MoeMlp>, private MoeMlpPasses {
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
  struct Pass;  // one call's routing, from the forward pass to the backward one
  absl::Status ReserveFor(int64_t n, int ep);
  // MoeMlpPasses on the GPU, which RunMoeMlpPasses drives. Each waits for
  // its work before returning, so no unit is released while a kernel reads it.
  absl::Status Gather(absl::Span<const int64_t> samples, int ep) override;
  absl::Status InputForward(int64_t n, const float* weight, const float* bias) override;
  absl::StatusOr<std::vector<int64_t>> Route(int64_t n, int ep, const float* w_router) override;
  absl::StatusOr<std::vector<float>> ReceivedCounts(int ep) override;
  absl::Status PackTokens(int64_t n, int64_t received) override;
  absl::Status ExpertsForward(int64_t received, int64_t local, const float* w1,
                              const float* w2) override;
  absl::Status Combine(int64_t n) override;
  absl::Status OutputLayer(int64_t n, const float* weight, const float* bias) override;
  absl::StatusOr<double> OutputLoss(absl::Span<const int64_t> samples) override;
  absl::Status OutputBackward(int64_t n, const float* weight, float* dw, float* db) override;
  absl::Status PackGateGradients(int64_t n) override;
  absl::Status ExpertsBackward(int64_t received, int64_t local, int ep, const float* w1,
                               const float* w2, float* gw1, float* gw2) override;
  absl::Status RouterBackward(int64_t n, const float* w_router, float* gw_router) override;
  absl::Status InputBackward(int64_t n, float* dw, float* db) override;
  float* counts_send() override;
  float* counts_recv() override;
  float* send() override;
  float* recv() override;
  // C[m, n] = alpha op(A) op(B) + beta C (row-major), on cuBLAS.
  absl::Status Gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha,
                    const float* a, const float* b, float beta, float* c);
  absl::Status Sync();

  cudaStream_t stream_ = nullptr;
  cublasHandle_t blas_ = nullptr;
  float* x_ = nullptr;
  float* y_ = nullptr;
  std::unique_ptr<Scratch> scratch_;
  std::unique_ptr<Pass> pass_;
};

}  // namespace muonmesh::worker

#pragma once

// The `mlp` workload (worker/model/mlp.h) on a CUDA GPU, for jobs with
// `device: cuda`: the same spec, initialisation (written on the host) and
// model, with the dataset in device memory, the products on cuBLAS (fp32)
// and the elementwise loops as kernels (worker/cuda/mlp_kernels.h). Both
// forms run RunMlpPasses (worker/model/mlp_passes.h): the calls to the
// runtime are Mlp::ForwardBackwardByUnit's, in the same order.
// cuBLAS and the GPU's tanhf round differently from OpenBLAS and the CPU's
// tanh, so results agree with the CPU workload to fp32 rounding, not bit for
// bit; the loss is summed in double in a fixed order, the same on every run.
//
// Built only with MUONMESH_ENABLE_CUDA. Uses the GPU current on the creating
// thread, on a stream of its own; waits for its work before returning.

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "worker/model/mlp.h"
#include "worker/model/mlp_passes.h"
#include "worker/model/cuda_workload.h"
#include "worker/model/workload.h"

namespace muonmesh::worker {

class CudaMlp final : public CudaWorkload<Mlp>, private MlpPasses {
 public:
  // Copies `mlp`'s dataset to the current GPU.
  static absl::StatusOr<std::unique_ptr<CudaMlp>> Create(Mlp mlp);
  ~CudaMlp() override;
  CudaMlp(const CudaMlp&) = delete;
  CudaMlp& operator=(const CudaMlp&) = delete;

  absl::StatusOr<double> ForwardBackwardByUnit(int64_t step, UnitAccess& units,
                                               absl::Span<const int64_t> samples) override;

 private:
  explicit CudaMlp(Mlp cpu);
  absl::Status Init();
  absl::Status Reserve(int64_t n);
  // C[m, n] = op(A) op(B) (row-major), as cblas_sgemm with alpha 1, beta 0.
  absl::Status Gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, const float* a,
                    const float* b, float* c);
  absl::Status Backward(int64_t i, int64_t n, const float* weight, const float* delta,
                        float* delta_next, float* dw, float* db);
  // MlpPasses on the GPU, which RunMlpPasses drives.
  absl::Status Gather(absl::Span<const int64_t> samples) override;
  absl::Status ForwardLayer(int64_t i, int64_t n, const float* weight, const float* bias) override;
  absl::StatusOr<double> OutputLoss(absl::Span<const int64_t> samples) override;
  absl::Status BackwardLayer(int64_t i, int64_t n, const float* weight, float* dw,
                             float* db) override;

  std::vector<int64_t> dims_;
  cudaStream_t stream_ = nullptr;
  cublasHandle_t blas_ = nullptr;
  float* x_ = nullptr;  // [N, d_0]
  float* y_ = nullptr;  // [N, d_L]
  int64_t capacity_ = 0;
  int64_t* rows_ = nullptr;          // [capacity]
  std::vector<float*> acts_;         // acts_[i]: [capacity, d_i]
  float* delta_ = nullptr;           // [capacity, max d]
  float* delta_next_ = nullptr;
  double* partial_ = nullptr;        // loss partial sums
  float* pass_delta_ = nullptr;      // the passes' dL/dz: delta_ or delta_next_
  float* pass_delta_next_ = nullptr;
};

}  // namespace muonmesh::worker

#pragma once

// The `gpt` workload (worker/model/gpt.h) on a CUDA GPU, for jobs with
// `device: cuda`: the same spec, initialisation (written on the host), data
// windows (read on the host, copied to the GPU per call) and model, with
// every product on cuBLAS in fp32 (the attention's per-head products as
// strided batches, one per sample) and the rest as kernels
// (worker/cuda/gpt_kernels.h). The calls to the runtime are the host's:
// both run RunGptPasses (worker/model/gpt_passes.h). cuBLAS's summation
// order and the kernels' block reductions differ from OpenBLAS's and the
// CPU's sequential sums, so results agree with the CPU workload to fp32
// rounding, not bit for bit; the loss is summed in double in row order, the
// same on every run.
//
// Built only with MUONMESH_ENABLE_CUDA. Uses the GPU current on the creating
// thread, on a stream of its own; each pass waits for its work before it
// returns, so a unit the runtime releases is no longer read.

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "worker/model/cuda_workload.h"
#include "worker/model/gpt.h"
#include "worker/model/gpt_passes.h"
#include "worker/model/workload.h"

namespace muonmesh::worker {

class CudaGpt final : public CudaWorkload<Gpt>, private GptPasses {
 public:
  // FailedPrecondition without a GPU; the host Gpt keeps the token streams.
  static absl::StatusOr<std::unique_ptr<CudaGpt>> Create(Gpt gpt);
  ~CudaGpt() override;
  CudaGpt(const CudaGpt&) = delete;
  CudaGpt& operator=(const CudaGpt&) = delete;

  // Gpt::ForwardBackwardByUnit's contract, its errors and calls to `units`.
  absl::StatusOr<double> ForwardBackwardByUnit(int64_t step, UnitAccess& units,
                                               absl::Span<const int64_t> samples) override;
  int64_t num_validation_samples() const override { return cpu_.num_validation_samples(); }
  // Gpt::ValidationLossByUnit's.
  absl::StatusOr<double> ValidationLossByUnit(UnitAccess& units,
                                              absl::Span<const int64_t> samples) override;

 private:
  // Block l's activations on the device, rows = n T (Gpt::BlockActs).
  struct BlockActs {
    float* resid_in = nullptr;
    float* ln1 = nullptr;
    float* ln1_mean = nullptr;
    float* ln1_rstd = nullptr;
    float* qkv = nullptr;
    float* att = nullptr;  // [n, H, T, T]
    float* atty = nullptr;
    float* resid_mid = nullptr;
    float* ln2 = nullptr;
    float* ln2_mean = nullptr;
    float* ln2_rstd = nullptr;
    float* fch = nullptr;
    float* fch_gelu = nullptr;
  };

  explicit CudaGpt(Gpt cpu);
  absl::Status Init();
  // Frees every scratch buffer, then allocates them for n windows; an error
  // names the batch and its size and leaves no scratch.
  absl::Status Reserve(int64_t n);
  void FreeScratch();
  absl::Status Sync();

  // GptPasses on the GPU.
  absl::Status Prepare(absl::Span<const int32_t> windows, int64_t n) override;
  absl::Status EmbedForward(int64_t n, const float* wte, const float* wpe) override;
  absl::Status BlockForward(int64_t layer, int64_t n, absl::Span<const float* const> p) override;
  absl::Status FinalNorm(int64_t n, const float* w, const float* b) override;
  absl::StatusOr<double> LogitsAndLoss(int64_t n, const float* wte, bool gradients) override;
  absl::Status HeadBackward(int64_t n, const float* wte, const float* lnf_w, float* dwte,
                            float* dlnf_w, float* dlnf_b) override;
  absl::Status BlockBackward(int64_t layer, int64_t n, absl::Span<const float* const> p,
                             absl::Span<float* const> g) override;
  absl::Status EmbedBackward(int64_t n, float* dwte, float* dwpe) override;

  // y [rows, out] = x W^T + b.
  absl::Status Linear(int64_t rows, int64_t in, int64_t out, const float* x, const float* w,
                      const float* b, float* y);
  // dW = dy^T x, db = column sums of dy, dx = dy W (overwritten).
  absl::Status LinearBackward(int64_t rows, int64_t in, int64_t out, const float* dy,
                              const float* x, const float* w, float* dw, float* db, float* dx);
  absl::Status AttentionForward(const BlockActs& a, int64_t n);
  absl::Status AttentionBackward(const BlockActs& a, int64_t n, const float* datty, float* dqkv);
  float* BlockOutput(int64_t layer) const;

  cudaStream_t stream_ = nullptr;
  cublasHandle_t blas_ = nullptr;
  std::vector<int32_t> windows_;  // host scratch for RunGptPasses
  std::vector<double> row_loss_;  // [rows] the loss per position, on the host

  int64_t capacity_ = 0;  // windows the buffers below hold
  std::vector<void*> allocations_;
  int32_t* windows_d_ = nullptr;  // [n, T + 1]
  std::vector<BlockActs> blocks_;
  float* resid_out_ = nullptr;
  float* lnf_ = nullptr;
  float* lnf_mean_ = nullptr;
  float* lnf_rstd_ = nullptr;
  float* logits_ = nullptr;  // [rows, V]; dL/dlogits after the loss
  double* row_loss_d_ = nullptr;
  float* dresid_ = nullptr;
  float* dc_ = nullptr;
  float* dqkv_ = nullptr;
  float* dfch_ = nullptr;
  float* datt_ = nullptr;  // [n, H, T, T]
};

}  // namespace muonmesh::worker

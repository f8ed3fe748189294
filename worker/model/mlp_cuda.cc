#include "worker/model/mlp_cuda.h"

#include <algorithm>
#include <climits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "core/base/status_macros.h"
#include "worker/cuda/cuda_checks.h"
#include "worker/cuda/mlp_kernels.h"
#include "worker/cuda/row_major_gemm.h"
#include "worker/model/checks.h"

namespace muonmesh::worker {

absl::StatusOr<std::unique_ptr<CudaMlp>> CudaMlp::Create(Mlp mlp) {
  MUONMESH_RETURN_IF_ERROR(cuda::CudaDeviceCount("mlp on cuda").status());
  std::unique_ptr<CudaMlp> w(new CudaMlp(std::move(mlp)));
  MUONMESH_RETURN_IF_ERROR(w->Init());
  return w;
}

CudaMlp::CudaMlp(Mlp cpu) : CudaWorkload(std::move(cpu)), dims_(cpu_.dims()) {}

absl::Status CudaMlp::Init() {
  MUONMESH_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  MUONMESH_CUBLAS_CHECK(cublasCreate(&blas_));
  MUONMESH_CUBLAS_CHECK(cublasSetStream(blas_, stream_));
  // Plain fp32 products (no TF32), like the CPU workload.
  MUONMESH_CUBLAS_CHECK(cublasSetMathMode(blas_, CUBLAS_PEDANTIC_MATH));
  MUONMESH_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&x_), sizeof(float) * cpu_.x().size()));
  MUONMESH_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&y_), sizeof(float) * cpu_.y().size()));
  MUONMESH_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&partial_),
                                 sizeof(double) * cuda::internal::kLossBlocks));
  MUONMESH_CUDA_CHECK(cudaMemcpy(x_, cpu_.x().data(), sizeof(float) * cpu_.x().size(),
                                 cudaMemcpyHostToDevice));
  MUONMESH_CUDA_CHECK(cudaMemcpy(y_, cpu_.y().data(), sizeof(float) * cpu_.y().size(),
                                 cudaMemcpyHostToDevice));
  acts_.assign(dims_.size(), nullptr);
  return absl::OkStatus();
}

CudaMlp::~CudaMlp() {
  for (float* a : acts_) cudaFree(a);
  cudaFree(rows_);
  cudaFree(delta_);
  cudaFree(delta_next_);
  cudaFree(partial_);
  cudaFree(x_);
  cudaFree(y_);
  if (blas_ != nullptr) cublasDestroy(blas_);
  if (stream_ != nullptr) cudaStreamDestroy(stream_);
}

absl::Status CudaMlp::Reserve(int64_t n) {
  if (n <= capacity_) return absl::OkStatus();
  const int64_t max_dim = *std::max_element(dims_.begin(), dims_.end());
  auto grow = [&](auto** p, size_t bytes) -> absl::Status {
    cudaFree(*p);
    *p = nullptr;
    MUONMESH_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(p), bytes));
    return absl::OkStatus();
  };
  for (size_t i = 0; i < dims_.size(); ++i) {
    MUONMESH_RETURN_IF_ERROR(grow(&acts_[i], sizeof(float) * n * dims_[i]));
  }
  MUONMESH_RETURN_IF_ERROR(grow(&rows_, sizeof(int64_t) * n));
  MUONMESH_RETURN_IF_ERROR(grow(&delta_, sizeof(float) * n * max_dim));
  MUONMESH_RETURN_IF_ERROR(grow(&delta_next_, sizeof(float) * n * max_dim));
  capacity_ = n;
  return absl::OkStatus();
}

absl::Status CudaMlp::Gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k,
                           const float* a, const float* b, float* c) {
  return cuda::RowMajorSgemm(blas_, trans_a, trans_b, m, n, k, 1.0f, a, b, 0.0f, c);
}

absl::Status CudaMlp::Backward(int64_t i, int64_t n, const float* weight, const float* delta,
                               float* delta_next, float* dw, float* db) {
  const int64_t in = dims_[i];
  const int64_t width = dims_[i + 1];
  const float* h = acts_[i];
  // dW_i = delta^T h_i [width, in]; db_i = column sums of delta.
  MUONMESH_RETURN_IF_ERROR(Gemm(true, false, width, in, n, delta, h, dw));
  MUONMESH_CUDA_CHECK(cuda::internal::LaunchColumnSums(delta, n, width, db, stream_));
  if (i > 0) {
    // dL/dh_i = delta W_i [n, in], through tanh.
    MUONMESH_RETURN_IF_ERROR(Gemm(false, false, n, in, width, delta, weight, delta_next));
    MUONMESH_CUDA_CHECK(cuda::internal::LaunchTanhBackward(delta_next, h, n * in, stream_));
  }
  MUONMESH_CUDA_CHECK(cudaStreamSynchronize(stream_));
  return absl::OkStatus();
}

absl::StatusOr<double> CudaMlp::ForwardBackwardByUnit(int64_t /*step*/, UnitAccess& units,
                                                      absl::Span<const int64_t> samples) {
  return RunMlpPasses(dims_, cpu_.num_samples(), *this, units, samples);
}

absl::Status CudaMlp::Gather(absl::Span<const int64_t> samples) {
  const int64_t n = static_cast<int64_t>(samples.size());
  MUONMESH_RETURN_IF_ERROR(Reserve(n));
  MUONMESH_CUDA_CHECK(cudaMemcpyAsync(rows_, samples.data(), sizeof(int64_t) * n,
                                      cudaMemcpyHostToDevice, stream_));
  MUONMESH_CUDA_CHECK(
      cuda::internal::LaunchGatherRows(x_, rows_, n, dims_.front(), acts_[0], stream_));
  return absl::OkStatus();
}

absl::Status CudaMlp::ForwardLayer(int64_t i, int64_t n, const float* weight, const float* bias) {
  const int64_t layers = static_cast<int64_t>(dims_.size()) - 1;
  MUONMESH_RETURN_IF_ERROR(Gemm(false, true, n, dims_[i + 1], dims_[i], acts_[i], weight,
                                acts_[i + 1]));
  MUONMESH_CUDA_CHECK(cuda::internal::LaunchBiasActivate(acts_[i + 1], bias, n, dims_[i + 1],
                                                         i + 1 < layers, stream_));
  MUONMESH_CUDA_CHECK(cudaStreamSynchronize(stream_));
  return absl::OkStatus();
}

absl::StatusOr<double> CudaMlp::OutputLoss(absl::Span<const int64_t> samples) {
  const int64_t n = static_cast<int64_t>(samples.size());
  const int64_t layers = static_cast<int64_t>(dims_.size()) - 1;
  const int64_t d_out = dims_.back();
  const double denom = static_cast<double>(n) * static_cast<double>(d_out);
  std::vector<double> partial(cuda::internal::kLossBlocks);
  MUONMESH_CUDA_CHECK(cuda::internal::LaunchOutputDelta(acts_[layers], y_, rows_, n, d_out, denom,
                                                        delta_, partial_, stream_));
  MUONMESH_CUDA_CHECK(cudaMemcpyAsync(partial.data(), partial_, sizeof(double) * partial.size(),
                                      cudaMemcpyDeviceToHost, stream_));
  MUONMESH_CUDA_CHECK(cudaStreamSynchronize(stream_));
  double sum = 0.0;
  for (double v : partial) sum += v;
  pass_delta_ = delta_;
  pass_delta_next_ = delta_next_;
  return sum;
}

absl::Status CudaMlp::BackwardLayer(int64_t i, int64_t n, const float* weight, float* dw,
                                    float* db) {
  MUONMESH_RETURN_IF_ERROR(Backward(i, n, weight, pass_delta_, pass_delta_next_, dw, db));
  std::swap(pass_delta_, pass_delta_next_);
  return absl::OkStatus();
}

}  // namespace muonmesh::worker

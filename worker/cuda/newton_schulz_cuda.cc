#include "worker/cuda/newton_schulz_cuda.h"

#include <algorithm>
#include <climits>
#include <cmath>
#include <string>
#include <utility>

#include "core/plan/ns_cost.h"
#include "core/base/status_macros.h"
#include "worker/cuda/cuda_checks.h"
#include "worker/cuda/ns_kernels.h"
#include "core/optim/ns_coefficients.h"

namespace muonmesh::cuda {
namespace internal {

DeviceBytes::~DeviceBytes() {
  if (data_ != nullptr) cudaFree(data_);  // nothing to report to in a destructor
}

absl::Status DeviceBytes::Reserve(size_t bytes) {
  if (bytes <= capacity_) return absl::OkStatus();
  if (data_ != nullptr) {
    MUONMESH_CUDA_CHECK(cudaFree(data_));
    data_ = nullptr;
    capacity_ = 0;
  }
  MUONMESH_CUDA_CHECK(cudaMalloc(&data_, bytes));
  capacity_ = bytes;
  return absl::OkStatus();
}

}  // namespace internal

namespace {

// Layout of scratch_ (doubles): reduction partials, then the sums of squares
// (slot 0: input, slot 1: output), then 1 / norm.
constexpr int kSumsOffset = internal::kReduceBlocks;
constexpr int kInvNormOffset = kSumsOffset + 2;
constexpr int kScratchDoubles = kInvNormOffset + 1;

// The transpose kernel's grid puts rows / 32 in gridDim.y (at most 65535).
constexpr int64_t kMaxDim = std::min<int64_t>(INT_MAX, 65535LL * 32);

absl::Status CheckShape(int64_t rows, int64_t cols) {
  if (rows < 0 || cols < 0 || rows > kMaxDim || cols > kMaxDim) {
    return absl::InvalidArgumentError("CUDA Newton-Schulz: shape " + std::to_string(rows) + " x " +
                                      std::to_string(cols) + " outside [0, " +
                                      std::to_string(kMaxDim) + "]");
  }
  return absl::OkStatus();
}

// The numerics' checks, and the forms this class runs (not the spectral one).
absl::Status ValidateOptions(const optim::NsOptions& options) {
  MUONMESH_RETURN_IF_ERROR(optim::ValidateNsOptions(options));
  if (options.algorithm == plan::NsAlgorithm::kSpectral) {
    return absl::InvalidArgumentError("CUDA Newton-Schulz: the spectral form runs on the CPU only");
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<CudaNewtonSchulz>> CudaNewtonSchulz::Create(cudaStream_t stream) {
  int devices = 0;
  MUONMESH_CUDA_CHECK(cudaGetDeviceCount(&devices));
  if (devices == 0) return absl::FailedPreconditionError("CUDA Newton-Schulz: no CUDA device");
  cublasHandle_t handle = nullptr;
  MUONMESH_CUBLAS_CHECK(cublasCreate(&handle));
  std::unique_ptr<CudaNewtonSchulz> ns(new CudaNewtonSchulz(handle, stream));
  MUONMESH_CUBLAS_CHECK(cublasSetStream(handle, stream));
  // alpha/beta are host floats (the default, stated for the reader).
  MUONMESH_CUBLAS_CHECK(cublasSetPointerMode(handle, CUBLAS_POINTER_MODE_HOST));
  void* pinned = nullptr;
  MUONMESH_CUDA_CHECK(cudaMallocHost(&pinned, 2 * sizeof(double)));
  ns->host_sums_ = static_cast<double*>(pinned);
  MUONMESH_RETURN_IF_ERROR(ns->scratch_.Reserve(kScratchDoubles * sizeof(double)));
  return ns;
}

CudaNewtonSchulz::CudaNewtonSchulz(cublasHandle_t handle, cudaStream_t stream)
    : handle_(handle), stream_(stream) {}

CudaNewtonSchulz::~CudaNewtonSchulz() {
  if (host_sums_ != nullptr) cudaFreeHost(host_sums_);
  cublasDestroy(handle_);
}

size_t CudaNewtonSchulz::workspace_bytes() const {
  return x_.capacity() + xb_.capacity() + ab_.capacity() + bb_.capacity() + gram_.capacity() +
         xl_.capacity() + scratch_.capacity();
}

absl::Status CudaNewtonSchulz::Reserve(int64_t rows, int64_t cols, plan::NsAlgorithm algorithm) {
  MUONMESH_RETURN_IF_ERROR(CheckShape(rows, cols));
  const size_t m = static_cast<size_t>(std::min(rows, cols));
  const size_t n = static_cast<size_t>(std::max(rows, cols));
  for (auto [buffer, bytes] :
       {std::pair{&x_, m * n * sizeof(float)}, std::pair{&xb_, m * n * sizeof(__nv_bfloat16)},
        std::pair{&ab_, m * m * sizeof(__nv_bfloat16)},
        std::pair{&bb_, m * m * sizeof(__nv_bfloat16)}}) {
    MUONMESH_RETURN_IF_ERROR(buffer->Reserve(bytes));
  }
  if (algorithm == plan::NsAlgorithm::kGram) {
    MUONMESH_RETURN_IF_ERROR(gram_.Reserve(5 * m * m * sizeof(float)));
    MUONMESH_RETURN_IF_ERROR(xl_.Reserve(m * n * sizeof(__nv_bfloat16)));
  }
  return absl::OkStatus();
}

absl::Status CudaNewtonSchulz::Run(float* x, int64_t rows, int64_t cols,
                                   const optim::NsOptions& options) {
  MUONMESH_RETURN_IF_ERROR(ValidateOptions(options));
  MUONMESH_RETURN_IF_ERROR(CheckShape(rows, cols));
  return RunValidated(x, rows, cols, options);
}

absl::Status CudaNewtonSchulz::RunBatched(float* x, int64_t count, int64_t rows, int64_t cols,
                                          const optim::NsOptions& options) {
  MUONMESH_RETURN_IF_ERROR(ValidateOptions(options));
  MUONMESH_RETURN_IF_ERROR(CheckShape(rows, cols));
  if (count < 0) return absl::InvalidArgumentError("CUDA Newton-Schulz: negative batch count");
  const int64_t size = rows * cols;
  for (int64_t e = 0; e < count; ++e) {
    MUONMESH_RETURN_IF_ERROR(RunValidated(x + e * size, rows, cols, options), "batch matrix ", e);
  }
  return absl::OkStatus();
}

absl::Status CudaNewtonSchulz::RunValidated(float* x, int64_t rows, int64_t cols,
                                            const optim::NsOptions& options) {
  if (rows == 0 || cols == 0) return absl::OkStatus();
  MUONMESH_RETURN_IF_ERROR(Reserve(rows, cols, options.algorithm));

  const bool transpose = rows > cols;
  const int64_t m = std::min(rows, cols);
  const int64_t n = std::max(rows, cols);
  const int64_t mn = m * n;
  auto* xf = static_cast<float*>(x_.get());
  auto* xb = static_cast<__nv_bfloat16*>(xb_.get());
  auto* scratch = static_cast<double*>(scratch_.get());
  double* sums = scratch + kSumsOffset;
  double* inv_norm = scratch + kInvNormOffset;

  // The working m x n matrix, identical for x and x^T from here on.
  if (transpose) {
    MUONMESH_CUDA_CHECK(internal::LaunchTranspose(x, rows, cols, xf, stream_));
  } else {
    MUONMESH_CUDA_CHECK(
        cudaMemcpyAsync(xf, x, mn * sizeof(float), cudaMemcpyDeviceToDevice, stream_));
  }
  MUONMESH_CUDA_CHECK(
      internal::LaunchSumSquares(xf, mn, scratch, sums, 0, options.eps, inv_norm, stream_));
  MUONMESH_CUDA_CHECK(internal::LaunchScaleToBf16(xf, xb, mn, inv_norm, stream_));

  // auto stays standard on CUDA (see the header).
  if (options.algorithm == plan::NsAlgorithm::kGram) {
    MUONMESH_RETURN_IF_ERROR(IterateGram(m, n, options));
  } else {
    MUONMESH_RETURN_IF_ERROR(IterateStandard(m, n, options));
  }

  // One synchronisation: both sums of squares come back together.
  MUONMESH_CUDA_CHECK(
      internal::LaunchSumSquares(xf, mn, scratch, sums, 1, options.eps, nullptr, stream_));
  MUONMESH_CUDA_CHECK(cudaMemcpyAsync(host_sums_, sums, 2 * sizeof(double),
                                      cudaMemcpyDeviceToHost, stream_));
  MUONMESH_CUDA_CHECK(cudaStreamSynchronize(stream_));
  if (!std::isfinite(host_sums_[0])) {
    return absl::InvalidArgumentError("CUDA Newton-Schulz: input holds a NaN or infinity");
  }
  if (!std::isfinite(host_sums_[1])) {
    return absl::InvalidArgumentError(
        "CUDA Newton-Schulz: the iteration produced a NaN or infinity (diverging coefficients?)");
  }
  if (transpose) {
    MUONMESH_CUDA_CHECK(internal::LaunchTranspose(xf, m, n, x, stream_));
  } else {
    MUONMESH_CUDA_CHECK(
        cudaMemcpyAsync(x, xf, mn * sizeof(float), cudaMemcpyDeviceToDevice, stream_));
  }
  // Stream order would be enough for callers on stream(); synchronising makes
  // "x holds the result when Run returns" true for every caller.
  MUONMESH_CUDA_CHECK(cudaStreamSynchronize(stream_));
  return absl::OkStatus();
}

absl::Status CudaNewtonSchulz::IterateStandard(int64_t m, int64_t n,
                                               const optim::NsOptions& options) {
  auto* xf = static_cast<float*>(x_.get());
  auto* xb = static_cast<__nv_bfloat16*>(xb_.get());
  auto* ab = static_cast<__nv_bfloat16*>(ab_.get());
  auto* bb = static_cast<__nv_bfloat16*>(bb_.get());
  const int64_t mn = m * n;
  // cuBLAS is column-major: the row-major m x n X is the column-major n x m
  // matrix X^T (leading dimension n); likewise for the m x m A and B.
  const int im = static_cast<int>(m);
  const int in = static_cast<int>(n);
  const float one = 1.0f;
  const float zero = 0.0f;
  for (int t = 0; t < options.steps; ++t) {
    const optim::NsCoefficientSet k = optim::NsCoefficientsForStep(options, t);
    const float ka = static_cast<float>(k.a);
    const float kb = static_cast<float>(k.b);
    const float kc = static_cast<float>(k.c);
    // A = X X^T: column-major (X^T)^T (X^T), m x m, over n.
    MUONMESH_CUBLAS_CHECK(cublasGemmEx(handle_, CUBLAS_OP_T, CUBLAS_OP_N, im, im, in, &one, xb,
                                       CUDA_R_16BF, in, xb, CUDA_R_16BF, in, &zero, ab,
                                       CUDA_R_16BF, im, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    // B = c A A + b A (C may not alias an input, so B starts as a copy of A).
    MUONMESH_CUDA_CHECK(cudaMemcpyAsync(bb, ab, m * m * sizeof(__nv_bfloat16),
                                        cudaMemcpyDeviceToDevice, stream_));
    MUONMESH_CUBLAS_CHECK(cublasGemmEx(handle_, CUBLAS_OP_N, CUBLAS_OP_N, im, im, im, &kc, ab,
                                       CUDA_R_16BF, im, ab, CUDA_R_16BF, im, &kb, bb, CUDA_R_16BF,
                                       im, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    // X = a X + B X: column-major X^T <- a X^T + X^T B^T, n x m, over m, into
    // the fp32 master copy.
    MUONMESH_CUBLAS_CHECK(cublasGemmEx(handle_, CUBLAS_OP_N, CUBLAS_OP_N, in, im, im, &one, xb,
                                       CUDA_R_16BF, in, bb, CUDA_R_16BF, im, &ka, xf, CUDA_R_32F,
                                       in, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    if (t + 1 < options.steps) {
      MUONMESH_CUDA_CHECK(internal::LaunchToBf16(xf, xb, mn, stream_));
    }
  }
  return absl::OkStatus();
}

absl::Status CudaNewtonSchulz::IterateGram(int64_t m, int64_t n, const optim::NsOptions& options) {
  const size_t mm = static_cast<size_t>(m) * static_cast<size_t>(m);
  auto* xf = static_cast<float*>(x_.get());
  auto* xh = static_cast<__nv_bfloat16*>(xb_.get());  // bf16(X_0)
  auto* xl = static_cast<__nv_bfloat16*>(xl_.get());  // bf16(X_0 - xh)
  auto* qh = static_cast<__nv_bfloat16*>(ab_.get());  // the same split of Q
  auto* ql = static_cast<__nv_bfloat16*>(bb_.get());
  float* r = static_cast<float*>(gram_.get());
  float* p = r + mm;
  float* q = p + mm;
  float* s = q + mm;
  float* s2 = s + mm;
  const int64_t mn = m * n;
  const int im = static_cast<int>(m);
  const int in = static_cast<int>(n);
  const float one = 1.0f;
  const float zero = 0.0f;
  // cuBLAS is column-major: a row-major matrix is its column-major transpose.
  // X = Q X_0 (m x n, fp32, over the fp32 X_0 in x_, which it replaces; the
  // products read only the bf16 halves): column-major X^T = X_0^T Q^T, n x m
  // over m, as Xl^T Qh^T + Xh^T Ql^T + Xh^T Qh^T, the small terms first.
  const auto q_times_x0 = [&]() -> absl::Status {
    MUONMESH_CUDA_CHECK(internal::LaunchSplitBf16(q, qh, ql, static_cast<int64_t>(mm), stream_));
    const std::pair<const __nv_bfloat16*, const __nv_bfloat16*> terms[] = {
        {xl, qh}, {xh, ql}, {xh, qh}};
    for (int i = 0; i < 3; ++i) {
      MUONMESH_CUBLAS_CHECK(cublasGemmEx(handle_, CUBLAS_OP_N, CUBLAS_OP_N, in, im, im, &one,
                                         terms[i].first, CUDA_R_16BF, in, terms[i].second,
                                         CUDA_R_16BF, im, i == 0 ? &zero : &one, xf, CUDA_R_32F,
                                         in, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    }
    return absl::OkStatus();
  };
  // Row-major c = alpha a b for m x m a, b: column-major c^T = b^T a^T.
  const auto product = [&](const float* a, const float* b, float alpha,
                           float* c) -> absl::Status {
    MUONMESH_CUBLAS_CHECK(cublasSgemm(handle_, CUBLAS_OP_N, CUBLAS_OP_N, im, im, im, &alpha, b,
                                      im, a, im, &zero, c, im));
    return absl::OkStatus();
  };
  MUONMESH_CUDA_CHECK(internal::LaunchSplitBf16(xf, xh, xl, mn, stream_));
  plan::GramRestartRule rule;
  bool starts = rule.Next(optim::NsCoefficientsForStep(options, 0).a);
  for (int t = 0; t < options.steps; ++t) {
    if (starts) {
      if (t > 0) {  // restart: X = Q X_0 becomes the new X_0
        MUONMESH_RETURN_IF_ERROR(q_times_x0());
        MUONMESH_CUDA_CHECK(internal::LaunchSplitBf16(xf, xh, xl, mn, stream_));
      }
      // R = X_0 X_0^T in fp32, from bf16(X_0): column-major (X_0^T)^T X_0^T.
      MUONMESH_CUBLAS_CHECK(cublasGemmEx(handle_, CUBLAS_OP_T, CUBLAS_OP_N, im, im, in, &one, xh,
                                         CUDA_R_16BF, in, xh, CUDA_R_16BF, in, &zero, r,
                                         CUDA_R_32F, im, CUBLAS_COMPUTE_32F,
                                         CUBLAS_GEMM_DEFAULT));
    }
    const optim::NsCoefficientSet k = optim::NsCoefficientsForStep(options, t);
    const float kb = static_cast<float>(k.b);
    // P = c R R, then P = P + b R (in place), then a on the diagonal.
    MUONMESH_RETURN_IF_ERROR(product(r, r, static_cast<float>(k.c), p));
    MUONMESH_CUBLAS_CHECK(
        cublasSgeam(handle_, CUBLAS_OP_N, CUBLAS_OP_N, im, im, &one, p, im, &kb, r, im, p, im));
    MUONMESH_CUDA_CHECK(internal::LaunchAddToDiagonal(p, m, static_cast<float>(k.a), stream_));
    if (starts) {
      MUONMESH_CUDA_CHECK(
          cudaMemcpyAsync(q, p, mm * sizeof(float), cudaMemcpyDeviceToDevice, stream_));
    } else {
      MUONMESH_RETURN_IF_ERROR(product(p, q, 1.0f, s));  // Q <- P Q
      std::swap(q, s);
    }
    // R is needed again unless this is the last iteration or the next one
    // restarts: R <- P P R.
    starts = t + 1 < options.steps && rule.Next(optim::NsCoefficientsForStep(options, t + 1).a);
    if (t + 1 < options.steps && !starts) {
      MUONMESH_RETURN_IF_ERROR(product(p, p, 1.0f, s));
      MUONMESH_RETURN_IF_ERROR(product(s, r, 1.0f, s2));
      std::swap(r, s2);
    }
  }
  return q_times_x0();  // X_T = Q X_0, fp32, in x_
}

}  // namespace muonmesh::cuda

#pragma once

// Newton-Schulz orthogonalisation on an NVIDIA GPU with cuBLAS: the same
// iteration as math::NewtonSchulz (worker/math/newton_schulz.h), in mixed
// precision. Per iteration, with X the fp32 master copy and Xb = bf16(X):
//   A  = bf16(Xb Xb^T)                   cublasGemmEx, bf16 in, fp32 accumulate
//   B  = bf16(c A A + b A)               cublasGemmEx, bf16 in, fp32 accumulate
//   X  = a X + B Xb   (fp32 output)      cublasGemmEx, bf16 in, fp32 accumulate
//   Xb = bf16(X)
// The normalisation X / max(||X||_F, eps) is an fp32 two-stage reduction with
// a fixed order, so results are deterministic for a given GPU model and cuBLAS
// version. Rows > cols is handled by transposing into the workspace first, so
// NS(x^T) = NS(x)^T exactly.
//
// With options.algorithm == kGram, the Gram form of plan/ns_cost.h instead:
//   R  = Xb Xb^T                        cublasGemmEx, bf16 in, fp32 out
//   P  = a I + b R + c R R,  Q <- P Q,  R <- P P R     cublasSgemm, fp32
//   X  = Q X_0 = Qh Xh + Qh Xl + Ql Xh   three cublasGemmEx, fp32 out
// where Qh = bf16(Q), Ql = bf16(Q - Qh) and likewise Xh, Xl for the fp32 X_0:
// X_0 stays fp32 (its bf16 split carries ~16 bits). Restarts take a fresh
// R = X X^T (X = Q X_0 becomes X_0) where plan::GramRestartRule says, as on the
// CPU. Why the split: with single bf16 products Q X_0 the result is the
// iteration of bf16(X_0), whose rounding the iteration multiplies by up to
// a^T (485 for 5 quintic steps) in the directions of small singular values.
// On the inputs of newton_schulz_cuda_test, run on the CPU stand-in for CUDA
// (tests/worker/cuda_cpu/, the same bf16 roundings), ill-conditioned ones
// reach errors of 0.09-0.4 that way, against the standard form's
// 0.006-0.026; split, 0.002-0.017 (on an H200: 0.0005-0.017, the standard
// form 0.006-0.042). The m x m work stays in fp32: the recurrence multiplies
// R's rounding there by about a^2 an iteration, which bf16 could not bear.
// That makes it slow: measured on an H200 (newton_schulz_cuda_benchmark,
// BENCHMARKS.md), 3-12x the standard form's time on every shape from
// 768 x 3072 to 8192 x 8192, since fp32 products run at 50 TFLOP/s there
// against bf16's ~750. So auto runs the standard form here (the planner
// charges it on cuda), and the job and plan validators refuse gram on cuda
// (plan::NsFormUnavailable); the form stays, tested, for that comparison.
//
// A CudaNewtonSchulz owns a cuBLAS handle bound to one stream on the device
// that was current at Create, and a workspace that grows to the largest shape
// seen (or Reserve'd) and is reused: after warm-up a call allocates nothing.
// One thread at a time; the caller keeps the device current.

#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/optim/types.h"

namespace muonmesh::cuda {

namespace internal {

// cudaMalloc'd bytes that only grow (contents are not kept on growth).
class DeviceBytes {
 public:
  DeviceBytes() = default;
  DeviceBytes(const DeviceBytes&) = delete;
  DeviceBytes& operator=(const DeviceBytes&) = delete;
  ~DeviceBytes();
  absl::Status Reserve(size_t bytes);
  void* get() const { return data_; }
  size_t capacity() const { return capacity_; }

 private:
  void* data_ = nullptr;
  size_t capacity_ = 0;
};

}  // namespace internal

class CudaNewtonSchulz {
 public:
  // Creates the cuBLAS handle on the current device, bound to `stream` (the
  // legacy default stream when null). FailedPrecondition without a device.
  static absl::StatusOr<std::unique_ptr<CudaNewtonSchulz>> Create(cudaStream_t stream = nullptr);

  ~CudaNewtonSchulz();
  CudaNewtonSchulz(const CudaNewtonSchulz&) = delete;
  CudaNewtonSchulz& operator=(const CudaNewtonSchulz&) = delete;

  // Grows the workspace for rows x cols (either orientation), including the
  // Gram form's buffers when `algorithm` is kGram.
  absl::Status Reserve(int64_t rows, int64_t cols,
                       plan::NsAlgorithm algorithm = plan::NsAlgorithm::kStandard);

  // Orthogonalises the row-major rows x cols fp32 matrix x (device memory) in
  // place, on stream(), and returns when x holds the result (it synchronises
  // the stream to check the result before writing it back, and after).
  //  - rows == 0 or cols == 0: nothing to do, OK.
  //  - a zero matrix stays zero.
  //  - InvalidArgument, x untouched: invalid options or shape, a NaN or
  //    infinity in x, or a non-finite result (a diverging user table).
  //  - ResourceExhausted / FailedPrecondition / Internal from CUDA or cuBLAS,
  //    with the failing call and its file:line.
  absl::Status Run(float* x, int64_t rows, int64_t cols, const optim::NsOptions& options);

  // `count` matrices stored back to back ([count, rows, cols]); each equals
  // Run on that matrix bit for bit. Stops at the first error: earlier
  // matrices hold their results, that one and later ones are untouched.
  absl::Status RunBatched(float* x, int64_t count, int64_t rows, int64_t cols,
                          const optim::NsOptions& options);

  cudaStream_t stream() const { return stream_; }
  size_t workspace_bytes() const;

 private:
  CudaNewtonSchulz(cublasHandle_t handle, cudaStream_t stream);
  absl::Status RunValidated(float* x, int64_t rows, int64_t cols, const optim::NsOptions& options);
  // The iterations on the normalised x_ (fp32) and xb_ (bf16), m <= n; the
  // result in x_.
  absl::Status IterateStandard(int64_t m, int64_t n, const optim::NsOptions& options);
  absl::Status IterateGram(int64_t m, int64_t n, const optim::NsOptions& options);

  cublasHandle_t handle_;
  cudaStream_t stream_;
  internal::DeviceBytes x_;        // fp32 m x n master copy
  internal::DeviceBytes xb_;       // bf16 m x n
  internal::DeviceBytes ab_;       // bf16 m x m
  internal::DeviceBytes bb_;       // bf16 m x m
  internal::DeviceBytes gram_;     // Gram form only: fp32 m x m R, P, Q and two scratch
  internal::DeviceBytes xl_;       // Gram form only: bf16 m x n, X_0 - bf16(X_0)
  internal::DeviceBytes scratch_;  // reduction partials, sums, 1/norm
  double* host_sums_ = nullptr;    // pinned: sums of squares of input, output
};

}  // namespace muonmesh::cuda

#pragma once

// Launchers of the elementwise optimizer kernels (AdamW, Muon's momentum and
// update phases) on device memory. Plain C++ interface (no Abseil), compiled
// by nvcc in optimizer_kernels.cu; each returns the launch error
// (cudaGetLastError). worker/cuda/optimizer_cuda.h wraps them with the
// checks and the all-or-nothing semantics of worker/math.
//
// Arithmetic. The same fp32 operations in the same order as the CPU code
// (worker/math/adamw.cc, muon.cc), each rounded on its own: the kernels use
// the _rn intrinsics, so nvcc cannot fuse a multiply and an add, and sqrt and
// division are IEEE-rounded. Results are therefore bit-identical to the CPU's.
//
// tests/worker/cuda_cpu/kernels_cpu.cc transcribes these kernels for the CPU
// stand-in that runs the GPU tests in every build: change both together.
//
// Check-then-commit: each step has a `check` launch that computes every new
// value without writing it and records the first index whose input or result
// is not finite in *bad (an int64 the caller sets to `count` beforehand;
// atomicMin), and a `commit` launch that writes.

#include <cuda_runtime_api.h>

#include <cstdint>

namespace muonmesh::cuda::internal {

// Per-step scalars, computed on the host in double and rounded to float once
// (as worker/math does).
struct AdamWScalars {
  float decay;            // 1 - lr wd
  float one_minus_beta1;  // lerp weight of the first moment
  float beta2;
  float one_minus_beta2;
  float bias_correction2_sqrt;
  float eps;
  float neg_step_size;  // -lr / bias_correction1
};

struct MuonScalars {
  float one_minus_beta;  // momentum lerp weight
  float beta;            // Nesterov lerp weight
  bool nesterov;
  float decay;  // 1 - lr wd (apply only)
  float step;   // -lr scale (apply only)
};

cudaError_t LaunchAdamW(const AdamWScalars& k, const float* grad, float* exp_avg,
                        float* exp_avg_sq, float* param, int64_t count, bool commit,
                        long long* bad, cudaStream_t stream);

// u = nesterov ? lerp(g, m', beta) : m' with m' = lerp(m, g, 1 - beta).
// `check` flags non-finite g or m; commit writes u.
cudaError_t LaunchMuonPrepare(const MuonScalars& k, const float* grad, const float* momentum,
                              float* update, int64_t count, bool commit, long long* bad,
                              cudaStream_t stream);

// m <- m', p <- p decay + step O. `check` flags a non-finite O, new p or m'.
cudaError_t LaunchMuonApply(const MuonScalars& k, const float* grad, const float* orthogonalized,
                            float* momentum, float* param, int64_t count, bool commit,
                            long long* bad, cudaStream_t stream);

// Flags (atomicMin into *bad) the first index whose x is not finite.
cudaError_t LaunchCheckFinite(const float* x, int64_t count, long long* bad, cudaStream_t stream);

// dst[i] = value for i < count.
cudaError_t LaunchFill(float* dst, int64_t count, float value, cudaStream_t stream);

}  // namespace muonmesh::cuda::internal

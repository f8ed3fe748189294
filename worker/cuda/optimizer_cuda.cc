#include "worker/cuda/optimizer_cuda.h"

#include <cmath>

#include "absl/strings/str_cat.h"
#include "core/base/status_macros.h"
#include "worker/cuda/cuda_checks.h"
#include "worker/cuda/optimizer_kernels.h"
#include "worker/math/adamw.h"
#include "worker/math/muon.h"

namespace muonmesh::cuda {

absl::StatusOr<std::unique_ptr<CudaOptimizer>> CudaOptimizer::Create(cudaStream_t stream) {
  MUONMESH_RETURN_IF_ERROR(CudaDeviceCount("CudaOptimizer").status());
  long long* device_flag = nullptr;
  long long* host_flag = nullptr;
  MUONMESH_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&device_flag), sizeof(long long)));
  if (cudaError_t e = cudaMallocHost(reinterpret_cast<void**>(&host_flag), sizeof(long long));
      e != cudaSuccess) {
    cudaFree(device_flag);
    return CudaErrorToStatus(e, "cudaMallocHost(&host_flag, sizeof(long long))", __FILE__,
                             __LINE__);
  }
  return std::unique_ptr<CudaOptimizer>(new CudaOptimizer(stream, device_flag, host_flag));
}

CudaOptimizer::CudaOptimizer(cudaStream_t stream, long long* device_flag, long long* host_flag)
    : stream_(stream), device_flag_(device_flag), host_flag_(host_flag) {}

CudaOptimizer::~CudaOptimizer() {
  cudaFree(device_flag_);
  cudaFreeHost(host_flag_);
}

template <typename Launch>
absl::StatusOr<int64_t> CudaOptimizer::FirstBad(int64_t count, Launch check) {
  *host_flag_ = count;
  MUONMESH_CUDA_CHECK(cudaMemcpyAsync(device_flag_, host_flag_, sizeof(long long),
                                      cudaMemcpyHostToDevice, stream_));
  MUONMESH_CUDA_CHECK(check());
  MUONMESH_CUDA_CHECK(cudaMemcpyAsync(host_flag_, device_flag_, sizeof(long long),
                                      cudaMemcpyDeviceToHost, stream_));
  MUONMESH_CUDA_CHECK(cudaStreamSynchronize(stream_));
  return static_cast<int64_t>(*host_flag_);
}

absl::Status CudaOptimizer::AdamWStep(const optim::AdamWOptions& options, int64_t step,
                                      const float* grad, float* exp_avg, float* exp_avg_sq,
                                      float* param, int64_t count) {
  MUONMESH_RETURN_IF_ERROR(optim::ValidateAdamWOptions(options));
  if (step < 1) {
    return absl::InvalidArgumentError(absl::StrCat("adamw: step ", step, " < 1 (t is 1-based)"));
  }
  if (count < 0) return absl::InvalidArgumentError("AdamWStep: negative count");
  if (count == 0) return absl::OkStatus();
  const optim::AdamWScalars m = optim::AdamWScalarsFor(options, step);
  const internal::AdamWScalars k{m.decay,           m.one_minus_beta1,
                                 m.beta2,           m.one_minus_beta2,
                                 m.bias_correction2_sqrt, m.eps,
                                 m.neg_step_size};
  absl::StatusOr<int64_t> bad = FirstBad(count, [&] {
    return internal::LaunchAdamW(k, grad, exp_avg, exp_avg_sq, param, count, false, device_flag_,
                                 stream_);
  });
  MUONMESH_RETURN_IF_ERROR(bad.status());
  if (*bad < count) {
    return absl::InvalidArgumentError(absl::StrCat(
        "AdamWStep: step refused, element ", *bad, " has a non-finite gradient or result"));
  }
  MUONMESH_CUDA_CHECK(internal::LaunchAdamW(k, grad, exp_avg, exp_avg_sq, param, count, true,
                                            device_flag_, stream_));
  return absl::OkStatus();
}

absl::StatusOr<int64_t> CudaOptimizer::FirstNonFinite(const float* x, int64_t count) {
  if (count <= 0) return count;
  return FirstBad(count,
                  [&] { return internal::LaunchCheckFinite(x, count, device_flag_, stream_); });
}

namespace {
internal::MuonScalars MuonScalarsOf(const optim::MuonOptions& o, int64_t rows, int64_t cols) {
  internal::MuonScalars k;
  k.one_minus_beta = static_cast<float>(1.0 - o.momentum);
  k.beta = static_cast<float>(o.momentum);
  k.nesterov = o.nesterov;
  k.decay = static_cast<float>(1.0 - o.lr * o.weight_decay);
  k.step = rows > 0 && cols > 0
               ? static_cast<float>(-(o.lr * optim::MuonUpdateScale(o.scale, rows, cols)))
               : 0.0f;
  return k;
}
}  // namespace

absl::Status CudaOptimizer::MuonPrepare(const optim::MuonOptions& options, const float* grad,
                                        const float* momentum, float* update, int64_t count) {
  MUONMESH_RETURN_IF_ERROR(optim::ValidateMuonOptions(options));
  if (count < 0) return absl::InvalidArgumentError("MuonPrepare: negative count");
  if (count == 0) return absl::OkStatus();
  const internal::MuonScalars k = MuonScalarsOf(options, 0, 0);
  absl::StatusOr<int64_t> bad = FirstBad(count, [&] {
    return internal::LaunchMuonPrepare(k, grad, momentum, update, count, false, device_flag_,
                                       stream_);
  });
  MUONMESH_RETURN_IF_ERROR(bad.status());
  if (*bad < count) {
    return absl::InvalidArgumentError(absl::StrCat(
        "MuonPrepare: NaN or infinity in grad or the momentum buffer (element ", *bad, ")"));
  }
  MUONMESH_CUDA_CHECK(internal::LaunchMuonPrepare(k, grad, momentum, update, count, true,
                                                  device_flag_, stream_));
  return absl::OkStatus();
}

absl::Status CudaOptimizer::MuonApply(const optim::MuonOptions& options, int64_t rows,
                                      int64_t cols, const float* grad,
                                      const float* orthogonalized, float* momentum, float* param,
                                      int64_t count) {
  MUONMESH_RETURN_IF_ERROR(optim::ValidateMuonOptions(options));
  if (rows <= 0 || cols <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("MuonApply: matrix shape ", rows, " x ", cols, " is not positive"));
  }
  if (count < 0 || count % cols != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("MuonApply: shard of ", count, " values is not whole rows of ", cols));
  }
  if (count == 0) return absl::OkStatus();
  const internal::MuonScalars k = MuonScalarsOf(options, rows, cols);
  absl::StatusOr<int64_t> bad = FirstBad(count, [&] {
    return internal::LaunchMuonApply(k, grad, orthogonalized, momentum, param, count, false,
                                     device_flag_, stream_);
  });
  MUONMESH_RETURN_IF_ERROR(bad.status());
  if (*bad < count) {
    return absl::InvalidArgumentError(absl::StrCat(
        "MuonApply: step refused, element ", *bad, " has a non-finite update or result"));
  }
  MUONMESH_CUDA_CHECK(internal::LaunchMuonApply(k, grad, orthogonalized, momentum, param, count,
                                                true, device_flag_, stream_));
  return absl::OkStatus();
}

}  // namespace muonmesh::cuda

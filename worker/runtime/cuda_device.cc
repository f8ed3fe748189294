#include "worker/runtime/cuda_device.h"

#include <cuda_runtime_api.h>

#include <cmath>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "core/base/status_macros.h"
#include "worker/cuda/cuda_checks.h"
#include "worker/cuda/newton_schulz_cuda.h"
#include "worker/cuda/optimizer_cuda.h"
#include "worker/cuda/optimizer_kernels.h"

namespace muonmesh::worker {
namespace {

class CudaDevice final : public Device {
 public:
  CudaDevice(int ordinal, cudaStream_t stream, std::unique_ptr<cuda::CudaOptimizer> optimizer,
             std::unique_ptr<cuda::CudaNewtonSchulz> ns)
      : ordinal_(ordinal),
        stream_(stream),
        optimizer_(std::move(optimizer)),
        ns_(std::move(ns)) {}
  ~CudaDevice() override {
    ns_.reset();
    optimizer_.reset();
    cudaStreamDestroy(stream_);
  }

  comm::MemorySpace memory_space() const override { return comm::MemorySpace::kCudaDevice; }
  std::string name() const override { return absl::StrCat("cuda:", ordinal_); }

  absl::StatusOr<DeviceBuffer> Allocate(int64_t count) override {
    if (count < 0) return absl::InvalidArgumentError(absl::StrCat("Allocate(", count, ")"));
    void* p = nullptr;
    MUONMESH_CUDA_CHECK(
        cudaMalloc(&p, sizeof(float) * static_cast<size_t>(count > 0 ? count : 1)));
    return DeviceBuffer(static_cast<float*>(p), count, [](float* q) { cudaFree(q); });
  }
  absl::Status Copy(float* dst, const float* src, int64_t count) override {
    return Memcpy(dst, src, count, cudaMemcpyDeviceToDevice);
  }
  absl::Status Fill(float* dst, int64_t count, float value) override {
    if (count <= 0) return absl::OkStatus();
    if (value == 0.0f && !std::signbit(value)) {
      MUONMESH_CUDA_CHECK(cudaMemsetAsync(dst, 0, sizeof(float) * count, stream_));
    } else {
      MUONMESH_CUDA_CHECK(cuda::internal::LaunchFill(dst, count, value, stream_));
    }
    MUONMESH_CUDA_CHECK(cudaStreamSynchronize(stream_));
    return absl::OkStatus();
  }
  absl::Status CopyFromHost(float* dst, const float* host_src, int64_t count) override {
    return Memcpy(dst, host_src, count, cudaMemcpyHostToDevice);
  }
  absl::Status CopyToHost(float* host_dst, const float* src, int64_t count) override {
    return Memcpy(host_dst, src, count, cudaMemcpyDeviceToHost);
  }
  absl::Status AdamWStep(const optim::AdamWOptions& options, int64_t step, const float* grad,
                         float* exp_avg, float* exp_avg_sq, float* param,
                         int64_t count) override {
    return Done(optimizer_->AdamWStep(options, step, grad, exp_avg, exp_avg_sq, param, count));
  }
  absl::Status MuonPrepare(const optim::MuonOptions& options, const float* grad,
                           const float* momentum, float* update, int64_t count) override {
    return Done(optimizer_->MuonPrepare(options, grad, momentum, update, count));
  }
  absl::Status MuonApply(const optim::MuonOptions& options, int64_t rows, int64_t cols,
                         const float* grad, const float* orthogonalized, float* momentum,
                         float* param, int64_t count) override {
    return Done(optimizer_->MuonApply(options, rows, cols, grad, orthogonalized, momentum, param,
                                      count));
  }
  absl::StatusOr<bool> AllFinite(const float* x, int64_t count) override {
    MUONMESH_ASSIGN_OR_RETURN(int64_t first, optimizer_->FirstNonFinite(x, count));
    return first >= count;
  }
  absl::Status NewtonSchulz(float* x, int64_t rows, int64_t cols,
                            const optim::NsOptions& options) override {
    return ns_->Run(x, rows, cols, options);  // returns with the result in x
  }

 private:
  absl::Status Memcpy(void* dst, const void* src, int64_t count, cudaMemcpyKind kind) {
    if (count <= 0) return absl::OkStatus();
    MUONMESH_CUDA_CHECK(cudaMemcpyAsync(dst, src, sizeof(float) * count, kind, stream_));
    MUONMESH_CUDA_CHECK(cudaStreamSynchronize(stream_));
    return absl::OkStatus();
  }
  // Waits for the commit pass an optimizer call queued.
  absl::Status Done(absl::Status st) {
    MUONMESH_RETURN_IF_ERROR(st);
    MUONMESH_CUDA_CHECK(cudaStreamSynchronize(stream_));
    return absl::OkStatus();
  }

  int ordinal_;
  cudaStream_t stream_;
  std::unique_ptr<cuda::CudaOptimizer> optimizer_;
  std::unique_ptr<cuda::CudaNewtonSchulz> ns_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Device>> MakeCudaDevice(int ordinal) {
  MUONMESH_ASSIGN_OR_RETURN(const int count, cuda::CudaDeviceCount(absl::StrCat("CUDA device ", ordinal)));
  if (ordinal < 0 || ordinal >= count) {
    return absl::FailedPreconditionError(
        absl::StrCat("CUDA device ", ordinal, " does not exist (this machine has ", count, ")"));
  }
  MUONMESH_CUDA_CHECK(cudaSetDevice(ordinal));
  cudaStream_t stream = nullptr;
  MUONMESH_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  absl::StatusOr<std::unique_ptr<cuda::CudaOptimizer>> optimizer =
      cuda::CudaOptimizer::Create(stream);
  absl::StatusOr<std::unique_ptr<cuda::CudaNewtonSchulz>> ns =
      optimizer.ok() ? cuda::CudaNewtonSchulz::Create(stream)
                     : absl::StatusOr<std::unique_ptr<cuda::CudaNewtonSchulz>>(optimizer.status());
  if (!optimizer.ok() || !ns.ok()) {
    cudaStreamDestroy(stream);
    return optimizer.ok() ? ns.status() : optimizer.status();
  }
  return std::unique_ptr<Device>(
      new CudaDevice(ordinal, stream, *std::move(optimizer), *std::move(ns)));
}

}  // namespace muonmesh::worker

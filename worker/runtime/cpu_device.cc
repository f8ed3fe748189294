// The CPU Device: host memory and worker/math (OpenBLAS).

#include <algorithm>
#include <cmath>
#include <new>

#include "absl/strings/str_cat.h"
#include "worker/math/adamw.h"
#include "worker/math/muon.h"
#include "worker/math/newton_schulz.h"
#include "worker/runtime/device.h"

namespace muonmesh::worker {

namespace {

class CpuDevice final : public Device {
 public:
  comm::MemorySpace memory_space() const override { return comm::MemorySpace::kHost; }
  std::string name() const override { return "cpu"; }

  absl::StatusOr<DeviceBuffer> Allocate(int64_t count) override {
    if (count < 0) return absl::InvalidArgumentError(absl::StrCat("Allocate(", count, ")"));
    float* p = new (std::nothrow) float[static_cast<size_t>(std::max<int64_t>(count, 1))];
    if (p == nullptr) {
      return absl::ResourceExhaustedError(
          absl::StrCat("cpu: cannot allocate ", count, " floats"));
    }
    return DeviceBuffer(p, count, [](float* q) { delete[] q; });
  }
  absl::Status Copy(float* dst, const float* src, int64_t count) override {
    if (count > 0) std::copy(src, src + count, dst);
    return absl::OkStatus();
  }
  absl::Status Fill(float* dst, int64_t count, float value) override {
    if (count > 0) std::fill(dst, dst + count, value);
    return absl::OkStatus();
  }
  absl::Status CopyFromHost(float* dst, const float* host_src, int64_t count) override {
    return Copy(dst, host_src, count);
  }
  absl::Status CopyToHost(float* host_dst, const float* src, int64_t count) override {
    return Copy(host_dst, src, count);
  }
  absl::Status AdamWStep(const optim::AdamWOptions& options, int64_t step, const float* grad,
                         float* exp_avg, float* exp_avg_sq, float* param,
                         int64_t count) override {
    const size_t n = static_cast<size_t>(count);
    return math::AdamWStep(options, step, absl::MakeConstSpan(grad, n),
                           absl::MakeSpan(exp_avg, n), absl::MakeSpan(exp_avg_sq, n),
                           absl::MakeSpan(param, n));
  }
  absl::Status MuonPrepare(const optim::MuonOptions& options, const float* grad,
                           const float* momentum, float* update, int64_t count) override {
    const size_t n = static_cast<size_t>(count);
    return math::MuonPrepare(options, absl::MakeConstSpan(grad, n),
                             absl::MakeConstSpan(momentum, n), absl::MakeSpan(update, n));
  }
  absl::Status MuonApply(const optim::MuonOptions& options, int64_t rows, int64_t cols,
                         const float* grad, const float* orthogonalized, float* momentum,
                         float* param, int64_t count) override {
    const size_t n = static_cast<size_t>(count);
    return math::MuonApply(options, rows, cols, absl::MakeConstSpan(grad, n),
                           absl::MakeConstSpan(orthogonalized, n), absl::MakeSpan(momentum, n),
                           absl::MakeSpan(param, n));
  }
  absl::StatusOr<bool> AllFinite(const float* x, int64_t count) override {
    for (int64_t i = 0; i < count; ++i) {
      if (!std::isfinite(x[i])) return false;
    }
    return true;
  }
  absl::StatusOr<double> SumOfSquares(const float* x, int64_t count) override {
    double sum = 0;
    for (int64_t i = 0; i < count; ++i) sum += static_cast<double>(x[i]) * x[i];
    return sum;
  }
  absl::Status Add(float* dst, const float* src, int64_t count) override {
    for (int64_t i = 0; i < count; ++i) dst[i] += src[i];
    return absl::OkStatus();
  }
  absl::Status Scale(float* x, int64_t count, float factor) override {
    for (int64_t i = 0; i < count; ++i) x[i] *= factor;
    return absl::OkStatus();
  }
  absl::Status NewtonSchulz(float* x, int64_t rows, int64_t cols,
                            const optim::NsOptions& options) override {
    return ns_.Run(x, rows, cols, options);
  }

 private:
  math::NewtonSchulz ns_;
};

}  // namespace

std::unique_ptr<Device> MakeCpuDevice() { return std::make_unique<CpuDevice>(); }

}  // namespace muonmesh::worker

#include "worker/runtime/device.h"

#include <algorithm>
#include <vector>

#include "core/base/status_macros.h"
#include "worker/math/orthogonality.h"

namespace muonmesh::worker {

absl::StatusOr<DeviceBuffer> Device::AllocateZeroed(int64_t count) {
  MUONMESH_ASSIGN_OR_RETURN(DeviceBuffer b, Allocate(count));
  MUONMESH_RETURN_IF_ERROR(Fill(b.data(), count, 0.0f));
  return b;
}

namespace {

constexpr int64_t kHostChunk = int64_t{1} << 20;  // floats per host copy

}  // namespace

absl::StatusOr<double> Device::SumOfSquares(const float* x, int64_t count) {
  std::vector<float> host(static_cast<size_t>(std::min(count, kHostChunk)));
  double sum = 0;
  for (int64_t at = 0; at < count; at += kHostChunk) {
    const int64_t n = std::min(kHostChunk, count - at);
    MUONMESH_RETURN_IF_ERROR(CopyToHost(host.data(), x + at, n));
    for (int64_t i = 0; i < n; ++i) sum += static_cast<double>(host[i]) * host[i];
  }
  return sum;
}

absl::StatusOr<double> Device::OrthogonalityError(const float* x, int64_t rows, int64_t cols) {
  if (rows <= 0 || cols <= 0) return math::OrthogonalityError(nullptr, rows, cols);
  std::vector<float> host(static_cast<size_t>(rows * cols));
  MUONMESH_RETURN_IF_ERROR(CopyToHost(host.data(), x, rows * cols));
  return math::OrthogonalityError(host.data(), rows, cols);
}

absl::Status Device::Scale(float* x, int64_t count, float factor) {
  std::vector<float> host(static_cast<size_t>(std::min(count, kHostChunk)));
  for (int64_t at = 0; at < count; at += kHostChunk) {
    const int64_t n = std::min(kHostChunk, count - at);
    MUONMESH_RETURN_IF_ERROR(CopyToHost(host.data(), x + at, n));
    for (int64_t i = 0; i < n; ++i) host[i] *= factor;
    MUONMESH_RETURN_IF_ERROR(CopyFromHost(x + at, host.data(), n));
  }
  return absl::OkStatus();
}

absl::Status Device::Add(float* dst, const float* src, int64_t count) {
  std::vector<float> a(static_cast<size_t>(std::min(count, kHostChunk)));
  std::vector<float> b(a.size());
  for (int64_t at = 0; at < count; at += kHostChunk) {
    const int64_t n = std::min(kHostChunk, count - at);
    MUONMESH_RETURN_IF_ERROR(CopyToHost(a.data(), dst + at, n));
    MUONMESH_RETURN_IF_ERROR(CopyToHost(b.data(), src + at, n));
    for (int64_t i = 0; i < n; ++i) a[i] += b[i];
    MUONMESH_RETURN_IF_ERROR(CopyFromHost(dst + at, a.data(), n));
  }
  return absl::OkStatus();
}

}  // namespace muonmesh::worker

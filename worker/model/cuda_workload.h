#pragma once

// What every built-in workload's GPU form shares: it keeps the host
// workload it was made from and takes from it the spec, the dataset's size
// and the initialisation (always written to host memory), computes on the
// GPU (memory_space() is device memory), and trains only through
// ForwardBackwardByUnit, the runtime's path: ForwardBackward, which takes
// whole-model host tensors, is Unimplemented. Header-only, no CUDA API:
// the derived class (mlp_cuda.h, moe_mlp_cuda.h, synthetic_cuda.h) owns the
// device state.

#include <cstdint>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/types/span.h"
#include "worker/model/workload.h"

namespace muonmesh::worker {

template <typename HostWorkload>
class CudaWorkload : public Workload {
 public:
  const plan::ModelSpec& spec() const final { return cpu_.spec(); }
  int64_t num_samples() const final { return cpu_.num_samples(); }
  comm::MemorySpace memory_space() const final { return comm::MemorySpace::kCudaDevice; }
  absl::Status Initialize(uint64_t seed, absl::Span<float* const> params) const final {
    return cpu_.Initialize(seed, params);
  }
  absl::Status InitializeUnit(uint64_t seed, int unit,
                              absl::Span<float* const> params) const final {
    return cpu_.InitializeUnit(seed, unit, params);
  }
  absl::StatusOr<double> ForwardBackward(int64_t, absl::Span<const float* const>,
                                         absl::Span<const int64_t>,
                                         absl::Span<float* const>) final {
    return absl::UnimplementedError(absl::StrCat(
        cpu_.spec().name, " on cuda: use ForwardBackwardByUnit (the runtime's path)"));
  }

 protected:
  explicit CudaWorkload(HostWorkload cpu) : cpu_(std::move(cpu)) {}

  HostWorkload cpu_;
};

}  // namespace muonmesh::worker

#pragma once

// Where one rank's tensors live and how the runtime's own memory-bound work
// runs there: allocation, copies, fills, the elementwise optimizer steps and
// Newton-Schulz. The Trainer does all of its tensor work through a Device,
// so the same engine runs on the CPU (host memory, OpenBLAS) and on a CUDA
// GPU (device memory, CUDA kernels and cuBLAS); its communicators must work
// on the same memory (Gloo or in-process on the host, NCCL on the GPU), and
// so must the workload (Workload::memory_space).
//
// Semantics. Every method returns once its work is complete (v1 keeps it
// simple: collectives and host reads may follow at once). Pointers are in
// this device's memory unless the name says host; ranges must not overlap.
// The optimizer steps and Newton-Schulz have the semantics of worker/math
// (the same checks and all-or-nothing refusals); the CPU device is
// worker/math itself; the CUDA device's elementwise steps are bit-identical
// to it, its Newton-Schulz is bf16 (worker/cuda/newton_schulz_cuda.h).
//
// A Device is used by one thread at a time (one per rank).

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "worker/comm/types.h"
#include "core/optim/types.h"

namespace muonmesh::worker {

// `size` floats of a Device's memory, freed on destruction. Move-only.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  DeviceBuffer(float* data, int64_t size, std::function<void(float*)> release)
      : data_(data), size_(size), release_(std::move(release)) {}
  DeviceBuffer(DeviceBuffer&& other) noexcept { *this = std::move(other); }
  DeviceBuffer& operator=(DeviceBuffer&& other) noexcept {
    if (this != &other) {
      Reset();
      data_ = std::exchange(other.data_, nullptr);
      size_ = std::exchange(other.size_, 0);
      release_ = std::move(other.release_);
    }
    return *this;
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer() { Reset(); }

  float* data() { return data_; }
  const float* data() const { return data_; }
  int64_t size() const { return size_; }
  bool empty() const { return size_ == 0; }
  void Reset() {
    if (data_ != nullptr && release_) release_(data_);
    data_ = nullptr;
    size_ = 0;
  }

 private:
  float* data_ = nullptr;
  int64_t size_ = 0;
  std::function<void(float*)> release_;
};

class Device {
 public:
  virtual ~Device() = default;

  virtual comm::MemorySpace memory_space() const = 0;
  virtual std::string name() const = 0;  // "cpu", "cuda:0"

  // `count` floats (>= 0), contents unspecified. ResourceExhausted when
  // memory runs out.
  virtual absl::StatusOr<DeviceBuffer> Allocate(int64_t count) = 0;
  // Allocate, then every element 0.
  absl::StatusOr<DeviceBuffer> AllocateZeroed(int64_t count);

  virtual absl::Status Copy(float* dst, const float* src, int64_t count) = 0;
  virtual absl::Status Fill(float* dst, int64_t count, float value) = 0;
  virtual absl::Status CopyFromHost(float* dst, const float* host_src, int64_t count) = 0;
  virtual absl::Status CopyToHost(float* host_dst, const float* src, int64_t count) = 0;

  // math::AdamWStep, math::MuonPrepare, math::MuonApply on `count` elements.
  virtual absl::Status AdamWStep(const optim::AdamWOptions& options, int64_t step,
                                 const float* grad, float* exp_avg, float* exp_avg_sq,
                                 float* param, int64_t count) = 0;
  virtual absl::Status MuonPrepare(const optim::MuonOptions& options, const float* grad,
                                   const float* momentum, float* update, int64_t count) = 0;
  virtual absl::Status MuonApply(const optim::MuonOptions& options, int64_t rows, int64_t cols,
                                 const float* grad, const float* orthogonalized, float* momentum,
                                 float* param, int64_t count) = 0;
  // Whether every one of `count` floats at x is finite (not NaN or infinite).
  virtual absl::StatusOr<bool> AllFinite(const float* x, int64_t count) = 0;
  // The sum of the squares of `count` floats at x, accumulated in double
  // (the gradient norm, docs/architecture.md §5 "The recipe"); and x *= factor. The
  // defaults go through host copies a chunk at a time (correct on any
  // device; a device with kernels for them overrides them).
  virtual absl::StatusOr<double> SumOfSquares(const float* x, int64_t count);
  virtual absl::Status Scale(float* x, int64_t count, float factor);
  // dst += src for `count` floats (gradient accumulation).
  virtual absl::Status Add(float* dst, const float* src, int64_t count);

  // math::OrthogonalityError of the rows x cols matrix at x (Muon health).
  // The default copies it to the host and computes it there.
  virtual absl::StatusOr<double> OrthogonalityError(const float* x, int64_t rows, int64_t cols);

  // Orthogonalises the row-major rows x cols matrix x in place.
  virtual absl::Status NewtonSchulz(float* x, int64_t rows, int64_t cols,
                                    const optim::NsOptions& options) = 0;
};

// The host: worker/math on OpenBLAS (worker/runtime/cpu_device.cc).
std::unique_ptr<Device> MakeCpuDevice();

}  // namespace muonmesh::worker

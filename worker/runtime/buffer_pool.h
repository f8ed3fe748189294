#pragma once

// Device buffers kept from one unit gather (or gradient buffer) to the
// next, so that a step after the first allocates nothing: on the host a
// fresh buffer page-faults as it is first written, on a GPU cudaMalloc and
// cudaFree synchronise the device. A buffer is reused only for the same
// size.
//
// Bound: the bytes taken and not given back (live) plus the bytes pooled
// never exceed the most that were live at once so far (the high-water
// mark). A buffer given back is pooled only while that holds, else freed;
// a Take that must allocate first frees pooled buffers, largest first, until
// it holds again. So the pool costs no memory beyond the peak the steps
// reach without it; a step whose distinct buffer sizes add up to more than
// its peak allocates the difference again each step.
//
// Thread-safe: a rank's step and its reduction thread (UnitStream) share it.

#include <cstdint>
#include <map>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "worker/runtime/device.h"

namespace muonmesh::worker {

class BufferPool {
 public:
  explicit BufferPool(Device* dev) : dev_(dev) {}
  // The device of a pool that has handed out nothing yet.
  void SetDevice(Device* dev) { dev_ = dev; }

  // A buffer of exactly `count` floats (contents unspecified): a pooled one
  // of that size, else a new one from the device (its error, after a retry
  // with the pool emptied).
  absl::StatusOr<DeviceBuffer> Take(int64_t count);
  // Hands a buffer from Take back.
  void Give(DeviceBuffer b);

  int64_t live_floats() const {
    absl::MutexLock lock(&mu_);
    return live_;
  }
  int64_t pooled_floats() const {
    absl::MutexLock lock(&mu_);
    return pooled_;
  }
  int64_t high_water_floats() const {
    absl::MutexLock lock(&mu_);
    return high_;
  }
  int64_t allocations() const {  // Device::Allocate calls
    absl::MutexLock lock(&mu_);
    return allocations_;
  }

 private:
  // Frees pooled buffers, largest first, until pooled + live <= limit.
  void Trim(int64_t limit) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  Device* dev_;
  mutable absl::Mutex mu_;
  std::map<int64_t, std::vector<DeviceBuffer>> free_ ABSL_GUARDED_BY(mu_);  // by size in floats
  int64_t live_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t pooled_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t high_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t allocations_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace muonmesh::worker

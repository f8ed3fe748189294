#include "worker/runtime/buffer_pool.h"

#include <algorithm>
#include <utility>

namespace muonmesh::worker {

absl::StatusOr<DeviceBuffer> BufferPool::Take(int64_t count) {
  absl::MutexLock lock(&mu_);
  auto it = free_.find(count);
  if (it != free_.end() && !it->second.empty()) {
    DeviceBuffer b = std::move(it->second.back());
    it->second.pop_back();
    pooled_ -= count;
    live_ += count;
    return b;
  }
  const int64_t need = live_ + count;
  Trim(std::max(high_, need) - count);
  absl::StatusOr<DeviceBuffer> b = dev_->Allocate(count);
  if (!b.ok() && pooled_ > 0) {
    Trim(live_);  // everything pooled back to the device, then once more
    b = dev_->Allocate(count);
  }
  if (!b.ok()) return b.status();
  ++allocations_;
  live_ = need;
  high_ = std::max(high_, live_);
  return b;
}

void BufferPool::Give(DeviceBuffer b) {
  absl::MutexLock lock(&mu_);
  const int64_t count = b.size();
  live_ -= count;
  if (live_ + pooled_ + count > high_) return;  // b frees itself
  pooled_ += count;
  free_[count].push_back(std::move(b));
}

void BufferPool::Trim(int64_t limit) {
  while (pooled_ + live_ > limit && !free_.empty()) {
    auto largest = std::prev(free_.end());
    if (largest->second.empty()) {
      free_.erase(largest);
      continue;
    }
    pooled_ -= largest->first;
    largest->second.pop_back();  // frees it
  }
}

}  // namespace muonmesh::worker

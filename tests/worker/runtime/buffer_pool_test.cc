// BufferPool (worker/runtime/buffer_pool.h) on the CPU device: reuse by size,
// and its bound (live + pooled never above the most live at once), checked
// against a count kept here over random sequences.

#include "worker/runtime/buffer_pool.h"

#include <algorithm>
#include <memory>
#include <random>
#include <utility>
#include <vector>

#include "gtest/gtest.h"
#include "worker/runtime/device.h"

namespace muonmesh::worker {
namespace {

TEST(BufferPoolTest, ReusesABufferOfTheSameSize) {
  std::unique_ptr<Device> dev = MakeCpuDevice();
  BufferPool pool(dev.get());
  absl::StatusOr<DeviceBuffer> a = pool.Take(100);
  ASSERT_TRUE(a.ok());
  const float* first = a->data();
  pool.Give(*std::move(a));
  EXPECT_EQ(pool.pooled_floats(), 100);
  absl::StatusOr<DeviceBuffer> b = pool.Take(100);
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(b->data(), first);
  EXPECT_EQ(b->size(), 100);
  EXPECT_EQ(pool.allocations(), 1);
  EXPECT_EQ(pool.live_floats(), 100);
}

// A step's pattern (two units held at once, then a third of the second's
// size after both are given back) allocates only in the first step.
TEST(BufferPoolTest, ARepeatedStepAllocatesOnce) {
  std::unique_ptr<Device> dev = MakeCpuDevice();
  BufferPool pool(dev.get());
  for (int step = 0; step < 5; ++step) {
    absl::StatusOr<DeviceBuffer> a = pool.Take(300);
    absl::StatusOr<DeviceBuffer> b = pool.Take(70);
    ASSERT_TRUE(a.ok() && b.ok());
    pool.Give(*std::move(a));
    pool.Give(*std::move(b));
    absl::StatusOr<DeviceBuffer> c = pool.Take(70);  // b's buffer again
    ASSERT_TRUE(c.ok());
    pool.Give(*std::move(c));
    EXPECT_EQ(pool.allocations(), 2) << "step " << step;
  }
}

// A size no longer used is freed rather than kept past the high-water mark.
TEST(BufferPoolTest, FreesPooledBuffersItCannotKeep) {
  std::unique_ptr<Device> dev = MakeCpuDevice();
  BufferPool pool(dev.get());
  absl::StatusOr<DeviceBuffer> a = pool.Take(100);
  ASSERT_TRUE(a.ok());
  pool.Give(*std::move(a));
  absl::StatusOr<DeviceBuffer> b = pool.Take(60);  // 100 pooled + 60 > 100: the 100 goes
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(pool.pooled_floats(), 0);
  EXPECT_EQ(pool.live_floats(), 60);
  EXPECT_EQ(pool.high_water_floats(), 100);
}

TEST(BufferPoolTest, NeverHoldsMoreThanTheMostLiveAtOnce) {
  std::unique_ptr<Device> dev = MakeCpuDevice();
  std::mt19937 gen(5);
  for (int trial = 0; trial < 20; ++trial) {
    BufferPool pool(dev.get());
    std::vector<DeviceBuffer> held;
    int64_t live = 0;
    int64_t most = 0;
    for (int op = 0; op < 400; ++op) {
      if (!held.empty() && gen() % 2 == 0) {
        const size_t k = gen() % held.size();
        live -= held[k].size();
        pool.Give(std::move(held[k]));
        held.erase(held.begin() + static_cast<std::ptrdiff_t>(k));
      } else {
        const int64_t size = 8 * static_cast<int64_t>(1 + gen() % 6);
        absl::StatusOr<DeviceBuffer> b = pool.Take(size);
        ASSERT_TRUE(b.ok());
        ASSERT_EQ(b->size(), size);
        live += size;
        most = std::max(most, live);
        held.push_back(*std::move(b));
      }
      ASSERT_EQ(pool.live_floats(), live);
      ASSERT_EQ(pool.high_water_floats(), most);
      ASSERT_LE(pool.live_floats() + pool.pooled_floats(), most) << "trial " << trial;
    }
    for (DeviceBuffer& b : held) pool.Give(std::move(b));
    EXPECT_EQ(pool.live_floats(), 0);
  }
}

}  // namespace
}  // namespace muonmesh::worker

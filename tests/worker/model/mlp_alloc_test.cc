// Mlp::ForwardBackward allocates nothing after its first call with the
// largest batch: every global operator new in this binary is counted while
// the calls run. (OpenBLAS's own internal buffers are malloc'd inside the
// library and are outside this check; tests/worker/alloc_test.cc covers
// them for the math.)

#include <atomic>
#include <cstdlib>
#include <new>
#include <vector>

#include "gtest/gtest.h"
#include "worker/model/mlp.h"

namespace {
std::atomic<bool> g_counting{false};
std::atomic<long> g_news{0};
}  // namespace

void* operator new(std::size_t size) {
  if (g_counting.load(std::memory_order_relaxed)) g_news.fetch_add(1);
  if (void* p = std::malloc(size == 0 ? 1 : size)) return p;
  throw std::bad_alloc();
}
void* operator new[](std::size_t size) { return ::operator new(size); }
void operator delete(void* p) noexcept { std::free(p); }
void operator delete[](void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t) noexcept { std::free(p); }

namespace muonmesh::worker {
namespace {

TEST(MlpAllocTest, NoAllocationAfterTheLargestBatch) {
  const std::vector<int64_t> dims = {16, 64, 64, 8};
  absl::StatusOr<Mlp> mlp = Mlp::FromTeacher(dims, 1, 256);
  ASSERT_TRUE(mlp.ok()) << mlp.status();
  absl::StatusOr<std::vector<std::vector<float>>> params =
      MlpInitialParams(dims, 5);  // not the teacher (2)
  ASSERT_TRUE(params.ok());
  std::vector<std::vector<float>> grads = *params;
  std::vector<const float*> pp;
  std::vector<float*> gp;
  for (auto& v : *params) pp.push_back(v.data());
  for (auto& v : grads) gp.push_back(v.data());
  std::vector<int64_t> big(128), small(32);
  for (int64_t i = 0; i < 128; ++i) big[i] = (i * 7) % 256;
  for (int64_t i = 0; i < 32; ++i) small[i] = i;

  ASSERT_TRUE(mlp->ForwardBackward(0, pp, big, gp).ok());  // warm-up: sizes the scratch
  g_news = 0;
  g_counting = true;
  bool ok = true;
  for (int rep = 0; rep < 3; ++rep) {
    ok = ok && mlp->ForwardBackward(rep, pp, small, gp).ok();
    ok = ok && mlp->ForwardBackward(rep, pp, big, gp).ok();
  }
  g_counting = false;
  EXPECT_TRUE(ok);
  EXPECT_EQ(g_news.load(), 0);

  // The counter works: a call with a larger batch grows the scratch.
  std::vector<int64_t> bigger(200, 3);
  g_counting = true;
  ok = mlp->ForwardBackward(0, pp, bigger, gp).ok();
  g_counting = false;
  EXPECT_TRUE(ok);
  EXPECT_GT(g_news.load(), 0);
}

}  // namespace
}  // namespace muonmesh::worker

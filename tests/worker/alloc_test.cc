// No heap allocation per call after warm-up: Newton-Schulz and the Muon step
// are run with every allocation path of the process counted (global operator
// new, and malloc/calloc/realloc/aligned allocation interposed, which also
// sees what OpenBLAS allocates inside the call). Each allocation is
// attributed to its immediate caller's shared object:
//  - ours (this binary, libstdc++, Abseil, ...) must be zero per call;
//  - OpenBLAS's own: Debian's OpenBLAS 0.3.21 threaded level-3 driver
//    (driver/level3/level3_thread.c, built with a large MAX_CPU_NUMBER, hence
//    USE_ALLOC_HEAP) mallocs and frees a 512 KiB job array inside every
//    multithreaded sgemm/ssyrk/ssymm call, including plain sgemm. That is
//    outside this code's control; the tests bound it (at most one per BLAS
//    call) and print it.
// Its own binary, so the interposition touches no other test.

#include <cblas.h>
#include <dlfcn.h>
#include <malloc.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <new>
#include <vector>

#include "gtest/gtest.h"
#include "tests/worker/ns_reference.h"
#include "worker/math/muon.h"
#include "worker/math/newton_schulz.h"
#include "core/optim/ns_coefficients.h"

// glibc's own entry points, which the interposers below forward to.
extern "C" {
void* __libc_malloc(size_t size);
void* __libc_calloc(size_t count, size_t size);
void* __libc_realloc(void* p, size_t size);
void* __libc_memalign(size_t alignment, size_t size);
void __libc_free(void* p);
}

namespace {

std::atomic<bool> g_counting{false};
std::atomic<long> g_ours{0};
std::atomic<long> g_openblas{0};
thread_local bool t_in_count = false;  // dladdr must not recurse into Count

inline void Count(void* caller) {
  if (!g_counting.load(std::memory_order_relaxed) || t_in_count) return;
  t_in_count = true;
  Dl_info info;
  const bool openblas = dladdr(caller, &info) != 0 && info.dli_fname != nullptr &&
                        std::strstr(info.dli_fname, "openblas") != nullptr;
  (openblas ? g_openblas : g_ours).fetch_add(1);
  t_in_count = false;
}

#define MUONMESH_CALLER __builtin_return_address(0)

}  // namespace

extern "C" {
void* malloc(size_t size) {
  Count(MUONMESH_CALLER);
  return __libc_malloc(size);
}
void* calloc(size_t count, size_t size) {
  Count(MUONMESH_CALLER);
  return __libc_calloc(count, size);
}
void* realloc(void* p, size_t size) {
  Count(MUONMESH_CALLER);
  return __libc_realloc(p, size);
}
void* aligned_alloc(size_t alignment, size_t size) {
  Count(MUONMESH_CALLER);
  return __libc_memalign(alignment, size);
}
void* memalign(size_t alignment, size_t size) {
  Count(MUONMESH_CALLER);
  return __libc_memalign(alignment, size);
}
int posix_memalign(void** out, size_t alignment, size_t size) {
  Count(MUONMESH_CALLER);
  void* p = __libc_memalign(alignment, size);
  if (p == nullptr) return ENOMEM;
  *out = p;
  return 0;
}
void free(void* p) { __libc_free(p); }
}

// Replaced so the caller seen is the code that called new (libstdc++'s
// aligned new reaches aligned_alloc above, attributed to libstdc++: ours).
void* operator new(size_t size) {
  Count(MUONMESH_CALLER);
  if (void* p = __libc_malloc(size == 0 ? 1 : size)) return p;
  throw std::bad_alloc();
}
void* operator new[](size_t size) {
  Count(MUONMESH_CALLER);
  if (void* p = __libc_malloc(size == 0 ? 1 : size)) return p;
  throw std::bad_alloc();
}
void operator delete(void* p) noexcept { __libc_free(p); }
void operator delete[](void* p) noexcept { __libc_free(p); }
void operator delete(void* p, size_t) noexcept { __libc_free(p); }
void operator delete[](void* p, size_t) noexcept { __libc_free(p); }

namespace muonmesh::math {
namespace {

struct Allocations {
  long ours = 0;
  long openblas = 0;
};

// Allocations made while f runs, by origin.
template <typename F>
Allocations AllocationsDuring(F&& f) {
  g_ours = 0;
  g_openblas = 0;
  g_counting = true;
  f();
  g_counting = false;
  return {g_ours.load(), g_openblas.load()};
}

TEST(AllocationTest, CounterSeesAndAttributesAllocations) {
  // Guards the guard: the interposers are live and tell callers apart.
  const Allocations own = AllocationsDuring([] {
    std::vector<float>* v = new std::vector<float>(100);
    void* p = std::malloc(64);
    std::free(p);
    delete v;
  });
  EXPECT_GE(own.ours, 3);
  EXPECT_EQ(own.openblas, 0);
  // A threaded sgemm large enough to use OpenBLAS's level-3 thread driver.
  const int n = 512;
  std::vector<float> a(n * n, 0.5f), c(n * n);
  const Allocations blas = AllocationsDuring([&] {
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, n, n, n, 1.0f, a.data(), n, a.data(),
                n, 0.0f, c.data(), n);
  });
  EXPECT_EQ(blas.ours, 0);
  std::printf("OpenBLAS allocations inside one %dx%dx%d sgemm: %ld\n", n, n, n, blas.openblas);
}

// Our code allocates nothing; OpenBLAS at most once per level-3 call (three
// per iteration).
void ExpectNoOwnAllocations(const Allocations& a, int blas_calls, const char* what) {
  EXPECT_EQ(a.ours, 0) << what;
  EXPECT_LE(a.openblas, blas_calls) << what;
  std::printf("%-40s ours %ld, inside OpenBLAS %ld (of %d level-3 calls)\n", what, a.ours,
              a.openblas, blas_calls);
}

TEST(AllocationTest, NewtonSchulzAllocatesOnlyToGrow) {
  NewtonSchulz ns;
  optim::NsOptions options;
  const int calls = 3 * options.steps;
  std::vector<float> x = testing::Gaussian(96 * 160, 1);
  const std::vector<float> x0 = x;
  // First call on a fresh object grows the workspace: the counter sees it.
  EXPECT_GT(AllocationsDuring([&] { ASSERT_TRUE(ns.Run(x.data(), 96, 160, options).ok()); }).ours,
            0);
  for (int i = 0; i < 3; ++i) {
    x = x0;
    ExpectNoOwnAllocations(
        AllocationsDuring([&] { ASSERT_TRUE(ns.Run(x.data(), 96, 160, options).ok()); }), calls,
        "Run 96x160");
    // Same size the other way round, a smaller one and a batch: no growth.
    x = x0;
    ExpectNoOwnAllocations(
        AllocationsDuring([&] { ASSERT_TRUE(ns.Run(x.data(), 160, 96, options).ok()); }), calls,
        "Run 160x96");
    ExpectNoOwnAllocations(
        AllocationsDuring([&] { ASSERT_TRUE(ns.Run(x.data(), 40, 50, options).ok()); }), calls,
        "Run 40x50");
    x = x0;
    ExpectNoOwnAllocations(AllocationsDuring([&] {
                             ASSERT_TRUE(ns.RunBatched(x.data(), 6, 32, 80, options).ok());
                           }),
                           6 * calls, "RunBatched 6 x 32x80");
  }
}

TEST(AllocationTest, NewtonSchulzReserveMeansNoAllocationOnFirstRun) {
  NewtonSchulz ns;
  // The form auto runs on this shape (the spectral one, which has buffers of
  // its own).
  ASSERT_TRUE(ns.Reserve(64, 128, optim::NsFormFor(optim::NsOptions{}, 128, 64)).ok());
  std::vector<float> x = testing::Gaussian(64 * 128, 2);
  ExpectNoOwnAllocations(
      AllocationsDuring([&] { ASSERT_TRUE(ns.Run(x.data(), 128, 64, optim::NsOptions{}).ok()); }), 15,
      "first Run after Reserve 128x64");
}

TEST(AllocationTest, MuonStepAllocatesOnlyOnWarmUp) {
  Muon muon;
  optim::MuonOptions options;
  const int64_t rows = 48, cols = 80, n = rows * cols;
  const std::vector<float> g = testing::Gaussian(n, 3);
  std::vector<float> p = testing::Gaussian(n, 4), m(n, 0.0f);
  EXPECT_GT(AllocationsDuring([&] {
              ASSERT_TRUE(
                  muon.Step(options, rows, cols, g, absl::MakeSpan(m), absl::MakeSpan(p)).ok());
            }).ours,
            0);
  for (int i = 0; i < 3; ++i) {
    ExpectNoOwnAllocations(AllocationsDuring([&] {
                             ASSERT_TRUE(muon.Step(options, rows, cols, g, absl::MakeSpan(m),
                                                   absl::MakeSpan(p))
                                             .ok());
                           }),
                           15, "Muon::Step 48x80");
  }
}

}  // namespace
}  // namespace muonmesh::math

// The shuffled sample order (core/model/sample_order.h), by its properties:
// each epoch's order is a permutation of [0, N) for every N (small ones
// exhaustively, large ones on a window), epochs and seeds differ, and the
// order is a function of the global index alone.

#include "core/model/sample_order.h"

#include <cstdint>
#include <set>
#include <vector>

#include "gtest/gtest.h"

namespace muonmesh::model {
namespace {

TEST(SampleOrderTest, EveryEpochIsAPermutationOfTheSamples) {
  for (int64_t n = 1; n <= 300; ++n) {
    for (uint64_t epoch : {0u, 1u, 7u}) {
      std::vector<int> seen(static_cast<size_t>(n), 0);
      for (int64_t q = 0; q < n; ++q) {
        const int64_t p = ShuffledIndex(q, n, /*seed=*/42, epoch);
        ASSERT_GE(p, 0);
        ASSERT_LT(p, n);
        ++seen[static_cast<size_t>(p)];
      }
      for (int64_t p = 0; p < n; ++p) ASSERT_EQ(seen[p], 1) << "n " << n << " sample " << p;
    }
  }
}

TEST(SampleOrderTest, LargeDomainsStayInRangeWithoutCollisions) {
  // GPT-2's FineWeb windows and beyond: no table of N entries is ever made.
  for (int64_t n : {int64_t{1} << 20, int64_t{9'765'625'003}, (int64_t{1} << 40) + 17}) {
    std::set<int64_t> seen;
    for (int64_t q = 0; q < 20000; ++q) {
      const int64_t p = ShuffledIndex(q, n, 3, 0);
      ASSERT_GE(p, 0);
      ASSERT_LT(p, n);
      ASSERT_TRUE(seen.insert(p).second) << "n " << n << ": two indices give " << p;
    }
  }
}

TEST(SampleOrderTest, OrdersDependOnSeedAndEpochAndAreNotTheIdentity) {
  const int64_t n = 1000;
  auto order = [n](uint64_t seed, uint64_t epoch) {
    std::vector<int64_t> o;
    for (int64_t q = 0; q < n; ++q) o.push_back(ShuffledIndex(q, n, seed, epoch));
    return o;
  };
  std::vector<int64_t> identity;
  for (int64_t q = 0; q < n; ++q) identity.push_back(q);
  EXPECT_NE(order(1, 0), identity);
  EXPECT_NE(order(1, 0), order(2, 0));
  EXPECT_NE(order(1, 0), order(1, 1));
  EXPECT_EQ(order(1, 0), order(1, 0));
  // Fixed points of a random permutation: about 1 expected, never most.
  int fixed = 0;
  for (int64_t q = 0; q < n; ++q) fixed += order(5, 3)[q] == q;
  EXPECT_LT(fixed, 10);
}

TEST(SampleOrderTest, GlobalIndicesWalkEpochsInTurn) {
  const int64_t n = 37;
  for (int64_t k = 0; k < 5 * n; ++k) {
    EXPECT_EQ(SampleOf(k, n, /*shuffle=*/false, 9), k % n);
    EXPECT_EQ(SampleOf(k, n, /*shuffle=*/true, 9), ShuffledIndex(k % n, n, 9, k / n));
  }
  // Each run of N consecutive indices, starting at an epoch, covers every sample.
  std::set<int64_t> epoch2;
  for (int64_t k = 2 * n; k < 3 * n; ++k) epoch2.insert(SampleOf(k, n, true, 9));
  EXPECT_EQ(epoch2.size(), static_cast<size_t>(n));
}

}  // namespace
}  // namespace muonmesh::model

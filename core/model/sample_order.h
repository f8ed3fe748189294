#pragma once

// The order a job's training samples are drawn in (docs/architecture.md §6,
// "Sample order"). Global sample i of step s is k = s G + i (G the global
// batch); with N samples (a language model's windows, a data set's rows),
// k reads sample k mod N in order, or, with data.shuffle {seed: S}, sample
//   pi_{S, e}(k mod N),   e = floor(k / N) (the epoch),
// a permutation of [0, N) drawn afresh for each epoch: every sample once
// per epoch, in an order that depends on S and e only, so it is the same
// for every layout and every world size, and computed per index in O(1)
// memory whatever N is.
//
// pi_{S, e} is a Feistel network with cycle walking. With h = max(1,
// ceil(bit_width(N - 1) / 2)) and m = 2^h - 1, a value x < 4^h is the pair
// (L, R) = (x >> h, x & m); four rounds r = 0..3 map (L, R) to
// (R, L xor (H(K_r xor R) & m)) with K_r = H(H(S) xor (4 e + r)) and H the
// SplitMix64 hash (core/base/splitmix64.h),
// giving (L << h) | R. This bijection of [0, 4^h) is applied to q, and
// again while the result is >= N (fewer than 4 times on average, as
// 4^h < 4 N); the first result below N is pi_{S, e}(q).
//
// Header-only, pure: any thread.

#include <bit>
#include <cstdint>

#include "core/base/splitmix64.h"

namespace muonmesh::model {

// pi_{seed, epoch}(q) for q in [0, n), n >= 1 (see above).
constexpr int64_t ShuffledIndex(int64_t q, int64_t n, uint64_t seed, uint64_t epoch) {
  const int bits = std::bit_width(static_cast<uint64_t>(n - 1));
  const int h = bits < 2 ? 1 : (bits + 1) / 2;
  const uint64_t mask = (uint64_t{1} << h) - 1;
  uint64_t keys[4];
  for (uint64_t r = 0; r < 4; ++r) {
    keys[r] = SplitMix64Hash(SplitMix64Hash(seed) ^ (4 * epoch + r));
  }
  uint64_t x = static_cast<uint64_t>(q);
  do {
    uint64_t left = x >> h;
    uint64_t right = x & mask;
    for (uint64_t key : keys) {
      const uint64_t next = left ^ (SplitMix64Hash(key ^ right) & mask);
      left = right;
      right = next;
    }
    x = (left << h) | right;
  } while (x >= static_cast<uint64_t>(n));
  return static_cast<int64_t>(x);
}

// The sample that global index k reads among n: k mod n, or shuffled.
constexpr int64_t SampleOf(int64_t k, int64_t n, bool shuffle, uint64_t seed) {
  if (!shuffle) return k % n;
  return ShuffledIndex(k % n, n, seed, static_cast<uint64_t>(k / n));
}

}  // namespace muonmesh::model

#pragma once

// The SplitMix64 hash (Steele, Lea and Flood, "Fast splittable pseudorandom
// number generators", OOPSLA 2014; Vigna's public-domain splitmix64.c): the
// one definition behind the workloads' generators (worker/model/rng.h) and
// the shuffled sample order (core/model/sample_order.h). Pure, constexpr.

#include <cstdint>

namespace muonmesh {

inline constexpr uint64_t kSplitMix64Gamma = 0x9E3779B97F4A7C15ULL;

// The SplitMix64 finaliser (the last three lines of the algorithm).
constexpr uint64_t SplitMix64Mix(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

// H(x): the output of one SplitMix64 call whose state was x before the call.
constexpr uint64_t SplitMix64Hash(uint64_t x) { return SplitMix64Mix(x + kSplitMix64Gamma); }

}  // namespace muonmesh

#pragma once

// The pseudo-random numbers behind every built-in workload's weights and
// data, specified exactly so that anyone can reproduce them (in any language)
// from a seed.
//
// SplitMix64 (Steele, Lea and Flood, "Fast splittable pseudorandom number
// generators", OOPSLA 2014; Vigna's public-domain splitmix64.c). With
// G = 0x9E3779B97F4A7C15 and all arithmetic modulo 2^64, one call on state s:
//
//   s += G
//   z  = s
//   z  = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
//   z  = (z ^ (z >> 27)) * 0x94D049BB133111EB
//   return z ^ (z >> 31)
//
// H(x) below is the value one such call returns from state x, i.e.
// Mix(x + G) where Mix is the three-line finaliser.
//
// Uniform floats: from 64 random bits u, take the top 24 bits
// t = u >> 40 (an integer in [0, 2^24)) and return t * 2^-23 - 1, a float in
// [-1, 1) on a grid of spacing 2^-23. Every such value is exactly
// representable as an IEEE float, so there is no rounding anywhere.
//
// Counter-based access: UniformAt(seed, stream, index) is
//
//   UniformFromBits(H(H(H(seed) ^ stream) ^ index))
//
// so element `index` of tensor `stream` can be generated without generating
// anything else (a rank holding a shard of a tensor, or a test checking one
// element, computes exactly the value an unsharded run computes).
//
// Everything here is a pure function (SplitMix64 the object is a value):
// thread-safe.

#include <cstdint>

#include "core/base/splitmix64.h"

namespace muonmesh::worker {

using ::muonmesh::kSplitMix64Gamma;
using ::muonmesh::SplitMix64Hash;
using ::muonmesh::SplitMix64Mix;

// The top 24 bits of `bits` as a float in [-1, 1): (bits >> 40) * 2^-23 - 1.
constexpr float UniformFromBits(uint64_t bits) {
  return static_cast<float>(static_cast<int64_t>(bits >> 40) - (int64_t{1} << 23)) *
         (1.0f / 8388608.0f);
}

// A sequential SplitMix64 generator (the reference algorithm, state advanced
// by G per call).
class SplitMix64 {
 public:
  explicit constexpr SplitMix64(uint64_t seed) : state_(seed) {}

  constexpr uint64_t Next() {
    state_ += kSplitMix64Gamma;
    return SplitMix64Mix(state_);
  }

  // UniformFromBits(Next()).
  constexpr float NextUniform() { return UniformFromBits(Next()); }

  constexpr uint64_t state() const { return state_; }

 private:
  uint64_t state_;
};

// Fixes (seed, stream) once so that consecutive elements of one tensor cost
// one hash each: At(index) == UniformAt(seed, stream, index).
class UniformStream {
 public:
  constexpr UniformStream(uint64_t seed, uint64_t stream)
      : key_(SplitMix64Hash(SplitMix64Hash(seed) ^ stream)) {}

  constexpr float At(uint64_t index) const { return UniformFromBits(SplitMix64Hash(key_ ^ index)); }
  // H(H(seed) ^ stream): what At hashes each index with (GPU kernels take it).
  constexpr uint64_t key() const { return key_; }

  // Writes At(first + i) * factor, rounded to float, to out[i] for
  // i < count (the product is formed in double: float(double(u) * factor)).
  void Fill(uint64_t first, int64_t count, double factor, float* out) const;

 private:
  uint64_t key_;
};

// UniformFromBits(H(H(H(seed) ^ stream) ^ index)), in [-1, 1).
constexpr float UniformAt(uint64_t seed, uint64_t stream, uint64_t index) {
  return UniformStream(seed, stream).At(index);
}

}  // namespace muonmesh::worker

// The PRNG is a specification: its values are checked against numbers
// computed outside this code base (Vigna's published splitmix64 outputs and a
// Python transcription of the documented formulas).

#include "worker/model/rng.h"

#include <cmath>
#include <cstdint>

#include "gtest/gtest.h"

namespace muonmesh::worker {
namespace {

TEST(SplitMix64Test, MatchesPublishedOutputs) {
  // splitmix64.c seeded with 1234567 (the values Java's SplittableRandom
  // and many ports test against).
  SplitMix64 rng(1234567);
  EXPECT_EQ(rng.Next(), 6457827717110365317ULL);
  EXPECT_EQ(rng.Next(), 3203168211198807973ULL);
  EXPECT_EQ(rng.Next(), 9817491932198370423ULL);
  EXPECT_EQ(rng.Next(), 4593380528125082431ULL);
  EXPECT_EQ(rng.Next(), 16408922859458223821ULL);
  EXPECT_EQ(SplitMix64(0).Next(), 0xE220A8397B1DCDAFULL);
}

TEST(SplitMix64Test, HashIsOneCallFromThatState) {
  for (uint64_t x : {uint64_t{0}, uint64_t{1}, uint64_t{42}, ~uint64_t{0}}) {
    EXPECT_EQ(SplitMix64Hash(x), SplitMix64(x).Next());
  }
}

TEST(UniformTest, TopTwentyFourBitsOnMinusOneToOne) {
  EXPECT_EQ(UniformFromBits(0), -1.0f);
  EXPECT_EQ(UniformFromBits(~uint64_t{0}), 1.0f - std::ldexp(1.0f, -23));
  EXPECT_EQ(UniformFromBits(uint64_t{1} << 63), 0.0f);
  // The low 40 bits do not matter.
  EXPECT_EQ(UniformFromBits((uint64_t{1} << 63) | ((uint64_t{1} << 40) - 1)), 0.0f);
  EXPECT_EQ(UniformFromBits(uint64_t{1} << 40), -1.0f + std::ldexp(1.0f, -23));
}

TEST(UniformTest, UniformAtMatchesIndependentTranscription) {
  // Python: U(H(H(H(seed) ^ stream) ^ index)), exact binary values.
  EXPECT_EQ(UniformAt(0, 0, 0), -0x1.71f62cp-1f);
  EXPECT_EQ(UniformAt(7, 2, 5), -0x1.d0f84p-5f);
  EXPECT_EQ(UniformAt(11, 1'000'000, 123), 0x1.db629p-3f);
  EXPECT_EQ(UniformAt(~uint64_t{0}, uint64_t{1} << 20, 99), -0x1.5e2794p-1f);
}

TEST(UniformTest, UniformAtIsTheComposedHash) {
  for (uint64_t seed : {uint64_t{3}, uint64_t{1} << 40}) {
    for (uint64_t stream : {uint64_t{0}, uint64_t{9}}) {
      for (uint64_t index : {uint64_t{0}, uint64_t{1}, uint64_t{123456789}}) {
        const uint64_t bits = SplitMix64Hash(SplitMix64Hash(SplitMix64Hash(seed) ^ stream) ^ index);
        EXPECT_EQ(UniformAt(seed, stream, index), UniformFromBits(bits));
      }
    }
  }
}

TEST(UniformTest, StreamFillMatchesUniformAt) {
  const UniformStream stream(5, 17);
  float out[8];
  stream.Fill(100, 8, 0.5, out);
  for (int i = 0; i < 8; ++i) {
    EXPECT_EQ(stream.At(100 + i), UniformAt(5, 17, 100 + i));
    EXPECT_EQ(out[i], static_cast<float>(static_cast<double>(UniformAt(5, 17, 100 + i)) * 0.5));
  }
}

TEST(UniformTest, LooksUniform) {
  // Mean 0 and variance 1/3 within a few standard errors; every value in
  // [-1, 1); neighbouring streams and seeds uncorrelated.
  constexpr int kN = 200000;
  double sum = 0, sum_sq = 0, cross_stream = 0, cross_seed = 0;
  for (int i = 0; i < kN; ++i) {
    const double u = UniformAt(1, 0, i);
    ASSERT_GE(u, -1.0);
    ASSERT_LT(u, 1.0);
    sum += u;
    sum_sq += u * u;
    cross_stream += u * UniformAt(1, 1, i);
    cross_seed += u * UniformAt(2, 0, i);
  }
  // Standard errors: mean sqrt(1/3/N) ~ 0.0013, variance ~ 0.0006, products ~ 0.00075.
  EXPECT_NEAR(sum / kN, 0.0, 0.007);
  EXPECT_NEAR(sum_sq / kN, 1.0 / 3.0, 0.004);
  EXPECT_NEAR(cross_stream / kN, 0.0, 0.004);
  EXPECT_NEAR(cross_seed / kN, 0.0, 0.004);
}

}  // namespace
}  // namespace muonmesh::worker

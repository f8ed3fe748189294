// worker/math/elementwise.h against double precision: ExpF's relative
// error over its whole clamped range, GELU and its slope against the tanh
// formula in double (and the slope against central differences of it).

#include "worker/math/elementwise.h"

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>

#include "gtest/gtest.h"

namespace muonmesh::math {
namespace {

// Units in the last place of float at `want`'s magnitude.
double Ulps(double got, double want) {
  int exponent = 0;
  std::frexp(want, &exponent);  // want = m 2^exponent, m in [0.5, 1)
  return std::abs(got - want) / std::ldexp(1.0, exponent - 24);
}

// Every float in [-87.3, 88.3] with a zero low byte of its bits (about
// 8 million values, all exponents) within 1 ulp of exp in double.
TEST(ElementwiseTest, ExpFWithinTwoUlp) {
  double worst = 0.0;
  float worst_at = 0.0f;
  int64_t checked = 0;
  for (uint64_t bits = 0; bits < (uint64_t{1} << 32); bits += 256) {
    const uint32_t b = static_cast<uint32_t>(bits);
    float x;
    std::memcpy(&x, &b, sizeof x);
    if (!(x >= -87.3f && x <= 88.3f)) continue;
    const double u = Ulps(ExpF(x), std::exp(static_cast<double>(x)));
    ++checked;
    if (u > worst) {
      worst = u;
      worst_at = x;
    }
  }
  std::printf("ExpF: worst %.3f ulp at x = %.9g over %lld values\n", worst, worst_at,
              static_cast<long long>(checked));
  EXPECT_GT(checked, 8000000);
  EXPECT_LE(worst, 1.0) << "at x = " << worst_at;
}

// Clamped ends: finite, normal, never zero.
TEST(ElementwiseTest, ExpFClampsToNormalFiniteValues) {
  for (float x : {-1000.0f, -87.3f, 88.3f, 1000.0f, -INFINITY, INFINITY}) {
    const float e = ExpF(x);
    EXPECT_TRUE(std::isnormal(e)) << x << " -> " << e;
  }
  EXPECT_EQ(ExpF(0.0f), 1.0f);
}

double GeluDouble(double x) {
  return 0.5 * x * (1.0 + std::tanh(0.7978845608028654 * (x + 0.044715 * x * x * x)));
}

// GELU and its slope within a few float roundings of the formula in
// double (absolute 2e-7 (1 + |x|), tanh's 1 - 2/(1 + e^{2z}) losing its
// relative precision near 0 but not its absolute), and the slope the
// derivative of GELU (central differences in double).
TEST(ElementwiseTest, GeluAndSlopeMatchDouble) {
  double worst_value = 0.0;
  double worst_slope = 0.0;
  for (int i = -40000; i <= 40000; ++i) {
    const float x = static_cast<float>(i) * 2.5e-4f;  // [-10, 10]
    const double xd = x;
    const double h = 1e-5;
    const double slope = (GeluDouble(xd + h) - GeluDouble(xd - h)) / (2 * h);
    worst_value = std::max(worst_value, std::abs(Gelu(x) - GeluDouble(xd)) / (1.0 + std::abs(xd)));
    worst_slope = std::max(worst_slope, std::abs(GeluSlope(x) - slope) / (1.0 + std::abs(xd)));
  }
  std::printf("Gelu: worst %.3g, GeluSlope: worst %.3g (absolute, over 1 + |x|)\n", worst_value,
              worst_slope);
  EXPECT_LE(worst_value, 2e-7);
  EXPECT_LE(worst_slope, 1e-6);
}

}  // namespace
}  // namespace muonmesh::math

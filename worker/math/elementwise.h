#pragma once

// Elementwise float functions shared by the CPU gpt (worker/model/gpt.cc),
// its CUDA kernels (worker/cuda/gpt_kernels.cu) and their CPU stand-in: one
// definition, so every device computes the same formula. Branch-free plain
// float arithmetic, so the compiler vectorises loops over them; exact as
// written only without contraction into fused multiply-adds (the CPU build
// passes -ffp-contract=off, nvcc --fmad=false for the kernels that use
// these).

#include <bit>
#include <cstdint>

#if defined(__CUDACC__)
#define MUONMESH_HOST_DEVICE __host__ __device__
#else
#define MUONMESH_HOST_DEVICE
#endif

// Run-time dispatch for the host's hot loops: GCC compiles the function twice,
// for generic x86-64 (SSE2, what the build targets) and for AVX2, and the
// loader binds calls to the one the CPU supports (an ifunc). The two clones
// compute the same IEEE operations in the same order (no contraction into
// fused multiply-adds: -ffp-contract=off, and AVX2 alone does not enable FMA;
// no reassociation), so results are bit-identical whichever runs; only the
// vector width differs. Elsewhere (other compilers or architectures, nvcc) a
// plain function. Put it on the function that holds the loop: a clone is
// called through the ifunc and so is never inlined.
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && !defined(__CUDACC__) && \
    defined(__linux__)
#define MUONMESH_VECTOR_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define MUONMESH_VECTOR_CLONES
#endif

namespace muonmesh::math {

// 1 when x is an infinity or a NaN (every exponent bit set), else 0: integer
// arithmetic, so that a loop OR-ing it over elements vectorises, where
// std::isfinite with an early exit does not.
MUONMESH_HOST_DEVICE inline uint32_t NonFiniteBit(float x) {
#if defined(__CUDA_ARCH__)
  const uint32_t bits = static_cast<uint32_t>(__float_as_int(x));
#else
  const uint32_t bits = std::bit_cast<uint32_t>(x);
#endif
  return (bits & 0x7f800000u) == 0x7f800000u ? 1u : 0u;
}

// a where mask is all ones, b where it is zero, by bits: a branch-free
// select, so that a loop choosing between two formulas by a loop-invariant
// flag still vectorises (both are computed; the chosen one's bits are kept).
MUONMESH_HOST_DEVICE inline float SelectBits(uint32_t mask, float a, float b) {
#if defined(__CUDA_ARCH__)
  return mask != 0 ? a : b;
#else
  return std::bit_cast<float>((std::bit_cast<uint32_t>(a) & mask) |
                              (std::bit_cast<uint32_t>(b) & ~mask));
#endif
}

// e^x in float: x clamped to [-87.3, 88.3], then x = n ln 2 + r with n =
// round(x / ln 2) (the 1.5 * 2^23 rounding trick) and ln 2 split in two
// (Cody and Waite), e^r from Cephes's degree-6 polynomial on |r| <= ln2 / 2,
// scaled by 2^n through the exponent bits. Within 1 ulp of the true value
// over the clamped range (0.97 at worst, against double exp, in
// tests/worker/elementwise_test.cc); 2^-126 and about 2^127.4 at the ends,
// never denormal or infinite.
MUONMESH_HOST_DEVICE inline float ExpF(float x) {
  x = x > -87.3f ? x : -87.3f;
  x = x < 88.3f ? x : 88.3f;
  // t's low mantissa bits hold n = round(x / ln 2): 1.5 * 2^23 + n.
  const float t = x * 1.44269504088896341f + 12582912.0f;
  const float n = t - 12582912.0f;
  float r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * (r * r) + r + 1.0f;
  // 2^n from n's bits in t (no float-to-int conversion, which may trap and
  // so keeps compilers from vectorising).
#if defined(__CUDA_ARCH__)
  const int32_t t_bits = __float_as_int(t);
#else
  const int32_t t_bits = std::bit_cast<int32_t>(t);
#endif
  const int32_t bits = (t_bits - 0x4B400000 + 127) << 23;
#if defined(__CUDA_ARCH__)
  const float scale = __int_as_float(bits);
#else
  const float scale = std::bit_cast<float>(bits);
#endif
  return p * scale;
}

inline constexpr float kGeluScale = 0.7978845608f;  // sqrt(2 / pi)
inline constexpr float kGeluCubic = 0.044715f;

// tanh(sqrt(2/pi) (x + 0.044715 x^3)) as 1 - 2 / (1 + e^{2z}).
MUONMESH_HOST_DEVICE inline float GeluTanh(float x) {
  const float z = kGeluScale * (x + kGeluCubic * x * x * x);
  return 1.0f - 2.0f / (1.0f + ExpF(2.0f * z));
}

// GELU, tanh form: 0.5 x (1 + tanh(...)).
MUONMESH_HOST_DEVICE inline float Gelu(float x) { return 0.5f * x * (1.0f + GeluTanh(x)); }

// Its derivative: 0.5 (1 + t) + 0.5 x (1 - t^2) sqrt(2/pi) (1 + 3 0.044715 x^2).
MUONMESH_HOST_DEVICE inline float GeluSlope(float x) {
  const float t = GeluTanh(x);
  return 0.5f * (1.0f + t) +
         0.5f * x * (1.0f - t * t) * kGeluScale * (1.0f + 3.0f * kGeluCubic * x * x);
}

}  // namespace muonmesh::math

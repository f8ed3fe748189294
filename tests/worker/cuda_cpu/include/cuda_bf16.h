#pragma once

// CPU stand-in for CUDA's cuda_bf16.h (tests/worker/cuda_cpu/README.md): the
// bfloat16 storage type and the two conversions the host code and the
// stand-in kernels use, with CUDA's rounding (to nearest, ties to even).

#include <cstdint>
#include <cstring>

struct __nv_bfloat16 {
  uint16_t bits;
};

inline __nv_bfloat16 __float2bfloat16_rn(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) return {0x7fff};  // NaN: CUDA's canonical one
  u += 0x7fffu + ((u >> 16) & 1u);
  return {static_cast<uint16_t>(u >> 16)};
}

inline float __bfloat162float(__nv_bfloat16 b) {
  const uint32_t u = static_cast<uint32_t>(b.bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

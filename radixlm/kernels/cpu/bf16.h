// float32 <-> bfloat16 (as uint16_t bits) for the CPU kernels: widening is a 16-bit shift,
// narrowing rounds to nearest even as torch does, NaN stays a (quiet) NaN.
#pragma once

#include <stdint.h>
#include <string.h>

namespace radixlm {

inline float to_f(float x) { return x; }
inline float to_f(uint16_t x) {
  uint32_t u = (uint32_t)x << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}
template <typename T> inline T from_f(float f);
template <> inline float from_f<float>(float f) { return f; }
template <> inline uint16_t from_f<uint16_t>(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return (uint16_t)(u >> 16);
}

}  // namespace radixlm

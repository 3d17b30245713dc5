// bfloat16 <-> float32 one value at a time, the two conversions every kernel of ours needs on
// its scalar paths (the vector paths shift/convert 16 lanes at once). bf16 is the top half of a
// float32, so widening is exact; narrowing rounds to nearest even, as torch does, and keeps a
// NaN a (quiet) NaN instead of letting the rounding carry turn it into an infinity.
#pragma once

#include <cstdint>
#include <cstring>

inline float bf16_widen(uint16_t x) {
  const uint32_t u = uint32_t(x) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

inline uint16_t bf16_narrow(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);
  return uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

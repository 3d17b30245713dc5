// The arithmetic ceiling of one core: how many GFLOP/s float32 FMAs and bf16 dot products
// (AVX512-BF16 `vdpbf16ps`) reach when nothing else limits them: 16 independent chains of
// 16-lane operations, no memory traffic. bench.py prints both next to the kernel's rate.
#include <chrono>
#include <cstdint>

#include "isa.h"  // kernel_isa() (lesson 14's folder, on the include path)
#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace {
typedef float vec16 __attribute__((vector_size(64)));

#if defined(__aarch64__)
// The empty asm below says "x may have changed", so the compiler cannot fold the loop away. On
// x86 one vector register ("v") holds x; a NEON register ("w") holds 4 floats: four of them.
typedef float vec4 __attribute__((vector_size(16)));
inline void opaque(vec16& x) {
  vec4 part[4];
  __builtin_memcpy(part, &x, sizeof part);
  __asm__ volatile("" : "+w"(part[0]), "+w"(part[1]), "+w"(part[2]), "+w"(part[3]));
  __builtin_memcpy(&x, part, sizeof part);
}
#endif

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}
}  // namespace

extern "C" {

double peak_fp32_fma_gflops(int64_t iters) {
  vec16 acc[16] = {}, x = {}, y = {};
  for (int i = 0; i < 16; ++i) x[i] = 1.0001f, y[i] = 1e-7f;
  const auto t0 = std::chrono::steady_clock::now();
  for (int64_t it = 0; it < iters; ++it) {
    for (int j = 0; j < 16; ++j) acc[j] = acc[j] * x + y;  // one FMA each: 16 lanes x 2 FLOPs
#if defined(__aarch64__)
    opaque(x);
#else
    __asm__ volatile("" : "+v"(x));                         // keep the loop from being folded away
#endif
  }
  const double secs = seconds_since(t0);
  float sink = 0.f;
  for (int j = 0; j < 16; ++j) sink += acc[j][0];
  return sink == 12345.f ? 0.0 : double(iters) * 16 * 16 * 2 / secs / 1e9;
}

double peak_bf16_dot_gflops(int64_t iters) {
#if defined(__AVX512BF16__)
  __m512 acc[16];
  for (int j = 0; j < 16; ++j) acc[j] = _mm512_setzero_ps();
  __m512i x = _mm512_set1_epi32(0x3f803f80), y = x;  // pairs of bf16 1.0
  const auto t0 = std::chrono::steady_clock::now();
  for (int64_t it = 0; it < iters; ++it) {
    for (int j = 0; j < 16; ++j) acc[j] = _mm512_dpbf16_ps(acc[j], (__m512bh)x, (__m512bh)y);  // 32 products
    __asm__ volatile("" : "+v"(x));
  }
  const double secs = seconds_since(t0);
  float sink = 0.f;
  for (int j = 0; j < 16; ++j) sink += _mm512_reduce_add_ps(acc[j]);
  return sink == 12345.f ? 0.0 : double(iters) * 16 * 32 * 2 / secs / 1e9;
#else
  (void)iters;
  return -1.0;  // this CPU (or compiler) has no AVX512-BF16
#endif
}

}  // extern "C"

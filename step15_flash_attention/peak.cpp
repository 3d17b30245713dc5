// The arithmetic ceiling of one core: how many GFLOP/s float32 FMAs and bf16 dot products
// (AVX512-BF16 `vdpbf16ps`) reach when nothing else limits them: independent chains of
// full-width vector operations, no memory traffic. bench.py prints both next to the kernel's rate.
#include <chrono>
#include <cstdint>

#include "isa.h"  // kernel_isa() (lesson 14's folder, on the include path)
#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace {
// The target's own vector of floats, and as many independent FMA chains as leave two of its
// registers free (for x and y): 16 of 32 AVX-512 registers, 12 of 16 AVX2 ones, 24 of 32 NEON.
#if defined(__AVX512F__)
typedef float vnative __attribute__((vector_size(64)));
constexpr int kChains = 16;
#elif defined(__AVX__)
typedef float vnative __attribute__((vector_size(32)));
constexpr int kChains = 12;
#else
typedef float vnative __attribute__((vector_size(16)));
constexpr int kChains = 24;
#endif
constexpr int kLanes = sizeof(vnative) / sizeof(float);

// An empty asm that says "x may have changed", so the compiler cannot fold the loop away; x
// stays in a vector register ("v" on x86, "w" on ARM).
inline void opaque(vnative& x) {
#if defined(__aarch64__)
  __asm__ volatile("" : "+w"(x));
#else
  __asm__ volatile("" : "+v"(x));
#endif
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}
}  // namespace

extern "C" {

double peak_fp32_fma_gflops(int64_t iters) {
  vnative acc[kChains] = {}, x = {}, y = {};
  for (int i = 0; i < kLanes; ++i) x[i] = 1.0001f, y[i] = 1e-7f;
  const auto t0 = std::chrono::steady_clock::now();
  for (int64_t it = 0; it < iters; ++it) {
    for (int j = 0; j < kChains; ++j) acc[j] = acc[j] * x + y;  // one FMA each: kLanes x 2 FLOPs
    opaque(x);
  }
  const double secs = seconds_since(t0);
  float sink = 0.f;
  for (int j = 0; j < kChains; ++j) sink += acc[j][0];
  return sink == 12345.f ? 0.0 : double(iters) * kChains * kLanes * 2 / secs / 1e9;
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

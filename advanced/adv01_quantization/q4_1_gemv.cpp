// y [M, N] = x [M, K] @ W^T with W in GGUF's Q4_1 blocks, read as the file stores them.
//
// One block: 32 consecutive weights of one row, w_i = d * q_i + m, q_i in 0..15; 16 bytes of
// nibbles (byte j: weight j in the low half, weight j + 16 in the high half), d and m kept here
// as float32 arrays beside them ([N, K/32] each). Per block and row of x the sum splits in two:
//
//   sum_i w_i x_i = d * (sum_i q_i x_i) + m * (sum_i x_i)
//
// The second factor is the same for every row of W, so each 32-value block sum of x is taken
// once per call; the inner loop only turns nibbles into floats and multiplies them with x. A
// decode step streams 20 bytes of nibbles and scales per 32 weights where bf16 streams 64, and the
// arithmetic (about 12 instructions a block) is what bounds it on two cores.
//
// Sums in float32, each output rounded once to bf16 (q4_1_linear) or kept in float32 (q4_1_linear_f32,
// for a model run in float32 where the CPU has no bf16 arithmetic). Rows of W are split among the threads in
// contiguous ranges (one sequential stream each); rows of x are taken four at a time. The
// AVX-512 build does 16 weights an instruction; elsewhere the compiler vectorises plain loops.
// Both have lesson 16's plan signature (decode_step.cpp's Linear), so the one-call decode step
// runs Q4_1 layers through them.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include <omp.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "bf16.h"  // bf16_widen, bf16_narrow (lesson 14)
#include "isa.h"

typedef uint16_t bf16;

struct Q41Matrix {          // mirrors Q41Matrix in q4_1_kernel.py
  const uint8_t* qs;        // [N, K/32, 16]
  const float* d;           // [N, K/32]
  const float* m;           // [N, K/32]
};

namespace {

inline void store(bf16* y, float v) { *y = bf16_narrow(v); }
inline void store(float* y, float v) { *y = v; }
inline float widen(bf16 v) { return bf16_widen(v); }
inline float widen(float v) { return v; }

#if defined(__AVX512F__)

template <int R, typename Out>
void rows_q4_1(const Q41Matrix& w, const float* x, const float* xsum, int64_t K, int64_t n0, int64_t n1,
               Out* y, int64_t N) {
  const int64_t nb = K / 32;
  const __m128i low = _mm_set1_epi8(0x0F);
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* qs = w.qs + n * nb * 16;
    const float* d = w.d + n * nb;
    const float* m = w.m + n * nb;
    __m512 acc[R];
    float msum[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps(), msum[r] = 0.f;
    for (int64_t b = 0; b < nb; ++b) {
      const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs + b * 16));
      const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(bytes, low)));
      const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(bytes, 4), low)));
      const __m512 db = _mm512_set1_ps(d[b]);
      for (int r = 0; r < R; ++r) {
        const float* xr = x + r * K + b * 32;
        const __m512 dot = _mm512_fmadd_ps(lo, _mm512_loadu_ps(xr), _mm512_mul_ps(hi, _mm512_loadu_ps(xr + 16)));
        acc[r] = _mm512_fmadd_ps(db, dot, acc[r]);
        msum[r] += m[b] * xsum[r * nb + b];
      }
    }
    for (int r = 0; r < R; ++r) store(y + r * N + n, _mm512_reduce_add_ps(acc[r]) + msum[r]);
  }
}

#else

template <int R, typename Out>
void rows_q4_1(const Q41Matrix& w, const float* x, const float* xsum, int64_t K, int64_t n0, int64_t n1,
               Out* y, int64_t N) {
  const int64_t nb = K / 32;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* qs = w.qs + n * nb * 16;
    float total[R] = {};
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* q = qs + b * 16;
      for (int r = 0; r < R; ++r) {
        const float* xr = x + r * K + b * 32;
        float dot = 0.f;
#pragma omp simd reduction(+ : dot)
        for (int i = 0; i < 16; ++i) dot += float(q[i] & 15) * xr[i] + float(q[i] >> 4) * xr[i + 16];
        total[r] += w.d[n * nb + b] * dot + w.m[n * nb + b] * xsum[r * nb + b];
      }
    }
    for (int r = 0; r < R; ++r) store(y + r * N + n, total[r]);
  }
}

#endif

// x [M, K] (K % 32 == 0) -> y [M, N], both bf16 or both float; w: a Q41Matrix.
template <typename Act>
void linear(const void* w, const Act* x, int64_t M, int64_t K, int64_t N, Act* y) {
  const Q41Matrix& W = *static_cast<const Q41Matrix*>(w);
  const int64_t nb = K / 32;
  for (int64_t r0 = 0; r0 < M; r0 += 4) {
    const int R = int(M - r0 < 4 ? M - r0 : 4);
    std::vector<float> xf(R * K), xsum(R * nb);
    for (int r = 0; r < R; ++r) {
      for (int64_t k = 0; k < K; ++k) xf[r * K + k] = widen(x[(r0 + r) * K + k]);
      for (int64_t b = 0; b < nb; ++b) {
        float s = 0.f;
        for (int i = 0; i < 32; ++i) s += xf[r * K + b * 32 + i];
        xsum[r * nb + b] = s;
      }
    }
    Act* yr = y + r0 * N;
#pragma omp parallel
    {
      const int64_t t = omp_get_thread_num(), T = omp_get_num_threads();
      const int64_t n0 = N * t / T, n1 = N * (t + 1) / T;
      switch (R) {
        case 1: rows_q4_1<1>(W, xf.data(), xsum.data(), K, n0, n1, yr, N); break;
        case 2: rows_q4_1<2>(W, xf.data(), xsum.data(), K, n0, n1, yr, N); break;
        case 3: rows_q4_1<3>(W, xf.data(), xsum.data(), K, n0, n1, yr, N); break;
        default: rows_q4_1<4>(W, xf.data(), xsum.data(), K, n0, n1, yr, N); break;
      }
    }
  }
}

}  // namespace

extern "C" {

int64_t q4_1_available() { return 1; }

void q4_1_linear(const void* w, const bf16* x, int64_t M, int64_t K, int64_t N, bf16* y) { linear(w, x, M, K, N, y); }

void q4_1_linear_f32(const void* w, const float* x, int64_t M, int64_t K, int64_t N, float* y) {
  linear(w, x, M, K, N, y);
}

}  // extern "C"

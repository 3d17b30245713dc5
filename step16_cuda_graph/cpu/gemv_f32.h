// gemv_f32: y [M, N] = x [M, K] @ w [N, K]^T for a few float32 rows (M <= 4) against a weight
// stored as bf16, widened to float32 in registers (a shift: exact), float32 products and sums.
//
// Where the CPU has no bf16 arithmetic (AVX2, baseline mode) the engine runs float32, and a
// decode step of one to four sequences streams every weight once: 2.4 GB a step for
// Qwen3-0.6B in float32. The checkpoints are bf16, so their float32 weights hold bf16 values:
// stored as bf16 they are the same numbers in half the bytes (ops.py keeps such a copy only
// where every value survives the round trip). The walk is gemv_bf16's: each thread a contiguous
// share of the weight rows, one row at a time, a single sequential stream. K % 32 == 0.
// Included at the end of elementwise.cpp.
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#include <omp.h>

namespace {

inline __m256 widen8(const bf16* p) {  // 8 bf16 -> float32
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}

template <int M>
void gemv_f32_rows(const float* x, int64_t K, const bf16* w, int64_t n0, int64_t n1, float* y, int64_t N) {
  constexpr int U = M <= 2 ? 4 : 2;  // independent sums per row: M x U of the 16 registers
  for (int64_t n = n0; n < n1; ++n) {
    const bf16* wr = w + n * K;
    __m256 acc[M][U];
    for (int m = 0; m < M; ++m)
      for (int u = 0; u < U; ++u) acc[m][u] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k += 8 * U) {
      for (int u = 0; u < U; ++u) {
        const __m256 wv = widen8(wr + k + 8 * u);
        for (int m = 0; m < M; ++m) acc[m][u] = _mm256_fmadd_ps(_mm256_loadu_ps(x + m * K + k + 8 * u), wv, acc[m][u]);
      }
    }
    for (int m = 0; m < M; ++m) {
      __m256 s = acc[m][0];
      for (int u = 1; u < U; ++u) s = _mm256_add_ps(s, acc[m][u]);
      __m128 h = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
      h = _mm_add_ps(h, _mm_movehl_ps(h, h));
      y[m * N + n] = _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
    }
  }
}

}  // namespace

extern "C" int64_t gemv_f32_max_rows() { return 4; }

extern "C" void gemv_f32(const float* x, int64_t M, int64_t K, const bf16* w, int64_t N, float* y) {
#pragma omp parallel
  {
    const int64_t t = omp_get_thread_num(), T = omp_get_num_threads();
    const int64_t n0 = N * t / T, n1 = N * (t + 1) / T;
    switch (M) {
      case 1: gemv_f32_rows<1>(x, K, w, n0, n1, y, N); break;
      case 2: gemv_f32_rows<2>(x, K, w, n0, n1, y, N); break;
      case 3: gemv_f32_rows<3>(x, K, w, n0, n1, y, N); break;
      default: gemv_f32_rows<4>(x, K, w, n0, n1, y, N); break;
    }
  }
}
#endif

// gemm_f32: y [M, N] = x [M, K] @ W^T in float32 on AVX2 + FMA, for any number of rows, with W
// packed once at load time into panels of 16 output columns (ops.pack_f32):
//
//   panel p = columns 16p .. 16p+15, stored k after k:  [k][16]   (the last panel zero-padded)
//
//   for each panel (the threads share the panels), for each group of up to 6 rows of x:
//       12 registers hold the 6 x 16 results; for each k: the panel's 16 weights (2 registers)
//       and each row's x[m, k] broadcast to all 8 lanes: 12 fused multiply-adds
//
// The outer-product shape every fast CPU matmul uses (BLIS calls it the micro-kernel): per k it
// loads 16 weights and 6 inputs for 12 FMAs, and every load is a sequential stream (a panel is
// K x 16 contiguous values, x is repacked per call into the same k-after-k order). Run as a
// dot product over the plain [N, K] layout instead (gemv_bf16's walk), 4 rows x 3 columns of
// sums take 7 loads per 12 FMAs, from rows 4 KB apart that share L1 sets.
//
// Weights that hold bf16 values (a bf16 checkpoint run in float32, what an AVX2 CPU does) are
// packed as bf16: half the bytes, widened exactly in registers. Within a panel's 16 bf16 the
// columns are stored in the order 0-3, 8-11, 4-7, 12-15, so that interleaving the 256-bit load
// with zeros (unpacklo/hi, which work per 128-bit half) gives columns 0-7 and 8-15 as float32
// in one instruction each. Other weights are packed as float32. Included at the end of
// elementwise.cpp, in every x86 build with AVX2 + FMA.
//
// Where the CPU has AVX-512, the micro-kernel is 512 bits wide: a panel's 16 columns in one
// register, 12 rows of x a call (12 registers of sums; per k one weight row, widened once, and
// 12 FMAs, so the two instructions that widen bf16 cost a seventh of the issue slots). The
// widened lanes keep the stored column order; one permute a register puts them back at the end.
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#include <omp.h>

#include <vector>

namespace {

constexpr int kPanel = 16;  // output columns a panel
#if defined(__AVX512F__)
constexpr int kRows = 12;   // rows of x a micro-kernel call: 12 registers of sums
#else
constexpr int kRows = 6;    // rows of x a micro-kernel call: 6 x 2 registers of sums
#endif

// One row's contribution at k: x[m, k] broadcast, times both halves of the panel's row k.
#define GEMM_FMA(m)                                                  \
  if constexpr (R > m) {                                             \
    const __m256 a = _mm256_broadcast_ss(xp + k * R + m);            \
    lo##m = _mm256_fmadd_ps(a, w_lo, lo##m);                         \
    hi##m = _mm256_fmadd_ps(a, w_hi, hi##m);                         \
  }
#define GEMM_STORE(m)                                                \
  if constexpr (R > m) {                                             \
    _mm256_storeu_ps(out + m * ld, lo##m);                           \
    _mm256_storeu_ps(out + m * ld + 8, hi##m);                       \
  }

// R rows (packed k after k: xp[k * R + m]) times one panel; `cols` of its 16 columns are real.
template <int R, bool BF16>
void micro_kernel(const float* xp, const void* panel, int64_t K, float* y, int64_t N, int64_t cols) {
  __m256 lo0 = _mm256_setzero_ps(), lo1 = lo0, lo2 = lo0, lo3 = lo0, lo4 = lo0, lo5 = lo0;
  __m256 hi0 = lo0, hi1 = lo0, hi2 = lo0, hi3 = lo0, hi4 = lo0, hi5 = lo0;
  const __m256i zero = _mm256_setzero_si256();
  for (int64_t k = 0; k < K; ++k) {
    __m256 w_lo, w_hi;
    if constexpr (BF16) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const bf16*>(panel) + k * kPanel));
      w_lo = _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, v));   // bf16 bits in the high half: exact
      w_hi = _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, v));
    } else {
      w_lo = _mm256_loadu_ps(static_cast<const float*>(panel) + k * kPanel);
      w_hi = _mm256_loadu_ps(static_cast<const float*>(panel) + k * kPanel + 8);
    }
    GEMM_FMA(0) GEMM_FMA(1) GEMM_FMA(2) GEMM_FMA(3) GEMM_FMA(4) GEMM_FMA(5)
  }
  float tail[kRows * kPanel];                 // the last panel: only `cols` columns go to y
  float* out = cols == kPanel ? y : tail;
  const int64_t ld = cols == kPanel ? N : kPanel;
  GEMM_STORE(0) GEMM_STORE(1) GEMM_STORE(2) GEMM_STORE(3) GEMM_STORE(4) GEMM_STORE(5)
  if (cols < kPanel)
    for (int m = 0; m < R; ++m)
      for (int64_t c = 0; c < cols; ++c) y[m * N + c] = tail[m * kPanel + c];
}
#undef GEMM_FMA
#undef GEMM_STORE

#if defined(__AVX512F__)
// The AVX-512 micro-kernel: R <= 12 rows (xp[k * R + m]) times one panel, one register a row.
template <int R, bool BF16>
void micro_kernel_512(const float* xp, const void* panel, int64_t K, float* y, int64_t N, int64_t cols) {
  __m512 acc[R];
  for (int m = 0; m < R; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    __m512 w;
    if constexpr (BF16) {     // bf16 bits to the high half of each lane: exact, in stored order
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const bf16*>(panel) + k * kPanel));
      w = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
    } else {
      w = _mm512_loadu_ps(static_cast<const float*>(panel) + k * kPanel);
    }
    for (int m = 0; m < R; ++m) acc[m] = _mm512_fmadd_ps(_mm512_set1_ps(xp[k * R + m]), w, acc[m]);
  }
  // bf16 panels hold columns 0-3, 8-11, 4-7, 12-15: swapping the middle quarters undoes it
  const __m512i order = _mm512_setr_epi32(0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15);
  const __mmask16 keep = __mmask16((1u << cols) - 1);
  for (int m = 0; m < R; ++m)
    _mm512_mask_storeu_ps(y + m * N, keep, BF16 ? _mm512_permutexvar_ps(order, acc[m]) : acc[m]);
}
#endif

// Rows m0 .. m0+R-1 of x [M, K] into xp, k after k.
void pack_rows(const float* x, int64_t K, int64_t m0, int64_t R, float* xp) {
  for (int64_t k = 0; k < K; ++k)
    for (int64_t m = 0; m < R; ++m) xp[k * R + m] = x[(m0 + m) * K + k];
}

template <bool BF16>
void rows_times_panel(int64_t R, const float* xp, const void* panel, int64_t K, float* y, int64_t N, int64_t cols) {
#if defined(__AVX512F__)
  switch (R) {
    case 1: micro_kernel_512<1, BF16>(xp, panel, K, y, N, cols); break;
    case 2: micro_kernel_512<2, BF16>(xp, panel, K, y, N, cols); break;
    case 3: micro_kernel_512<3, BF16>(xp, panel, K, y, N, cols); break;
    case 4: micro_kernel_512<4, BF16>(xp, panel, K, y, N, cols); break;
    case 5: micro_kernel_512<5, BF16>(xp, panel, K, y, N, cols); break;
    case 6: micro_kernel_512<6, BF16>(xp, panel, K, y, N, cols); break;
    case 7: micro_kernel_512<7, BF16>(xp, panel, K, y, N, cols); break;
    case 8: micro_kernel_512<8, BF16>(xp, panel, K, y, N, cols); break;
    case 9: micro_kernel_512<9, BF16>(xp, panel, K, y, N, cols); break;
    case 10: micro_kernel_512<10, BF16>(xp, panel, K, y, N, cols); break;
    case 11: micro_kernel_512<11, BF16>(xp, panel, K, y, N, cols); break;
    default: micro_kernel_512<12, BF16>(xp, panel, K, y, N, cols); break;
  }
#else
  switch (R) {
    case 1: micro_kernel<1, BF16>(xp, panel, K, y, N, cols); break;
    case 2: micro_kernel<2, BF16>(xp, panel, K, y, N, cols); break;
    case 3: micro_kernel<3, BF16>(xp, panel, K, y, N, cols); break;
    case 4: micro_kernel<4, BF16>(xp, panel, K, y, N, cols); break;
    case 5: micro_kernel<5, BF16>(xp, panel, K, y, N, cols); break;
    default: micro_kernel<6, BF16>(xp, panel, K, y, N, cols); break;
  }
#endif
}

template <bool BF16>
void gemm_panels(const float* x, int64_t M, int64_t K, const void* panels, int64_t N, const float* bias, float* y) {
  static thread_local std::vector<float> packed;   // x repacked; grows to the largest step seen
  if (packed.size() < size_t(M * K)) packed.resize(M * K);
  float* xp = packed.data();
  const int64_t groups = (M + kRows - 1) / kRows, num_panels = (N + kPanel - 1) / kPanel;
  const size_t panel_bytes = size_t(K) * kPanel * (BF16 ? sizeof(bf16) : sizeof(float));
#pragma omp parallel
  {
#pragma omp for schedule(static)
    for (int64_t g = 0; g < groups; ++g) {     // group g: rows kRows g.., packed at xp + kRows g K
      const int64_t m0 = g * kRows;
      pack_rows(x, K, m0, M - m0 < kRows ? M - m0 : kRows, xp + m0 * K);
    }
    // Each thread a contiguous share of the panels; a panel stays in cache for all the rows.
    const int64_t t = omp_get_thread_num(), T = omp_get_num_threads();
    const int64_t p0 = num_panels * t / T, p1 = num_panels * (t + 1) / T;
    for (int64_t p = p0; p < p1; ++p) {
      const void* panel = static_cast<const char*>(panels) + p * panel_bytes;
      const int64_t n0 = p * kPanel, cols = N - n0 < kPanel ? N - n0 : kPanel;
      for (int64_t m0 = 0; m0 < M; m0 += kRows)
        rows_times_panel<BF16>(M - m0 < kRows ? M - m0 : kRows, xp + m0 * K, panel, K, y + m0 * N + n0, N, cols);
      if (bias != nullptr)
        for (int64_t m = 0; m < M; ++m)
          for (int64_t c = 0; c < cols; ++c) y[m * N + n0 + c] += bias[n0 + c];
    }
  }
}

}  // namespace

// Where AVX-512 is there, oneDNN's packed float32 call (its own 512-bit kernels, blocked for
// large steps) is the faster from about 48 rows up (`cpu/bench.py linears`, lesson 16's README).
extern "C" int64_t gemm_f32_max_rows() {
#if defined(__AVX512F__)
  return 48;
#else
  return INT64_MAX;
#endif
}

// panels: ops.pack_f32's layout, bf16 (panels_bf16 = 1) or float32; bias: N floats or null.
extern "C" void gemm_f32(const float* x, int64_t M, int64_t K, const void* panels, int64_t panels_bf16, int64_t N,
                         const float* bias, float* y) {
  if (panels_bf16)
    gemm_panels<true>(x, M, K, panels, N, bias, y);
  else
    gemm_panels<false>(x, M, K, panels, N, bias, y);
}
#endif

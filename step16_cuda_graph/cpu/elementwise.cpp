// Two element-wise chains of a bf16 Qwen3 layer, each as one pass over its rows.
//
// torch.compile fuses these chains too, but in bf16 the code it writes converts between bf16
// and float32 at every point where eager PyTorch rounds (so that both give the same numbers),
// with generic conversion code; the q/k one also runs as two passes with a buffer between
// them. Here a value is rounded to bf16 at the same points (round to nearest even, as PyTorch
// rounds), so the results are eager's, to the order of a float32 sum:
//
//   qk_norm_rope   q and k of each token, straight out of the fused qkv projection:
//                    RMSNorm per head (Qwen3's q_norm / k_norm; skipped without weights), then
//                    RoPE, half-split layout: out[i] = x[i] c[i] - x[i+D/2] s[i],
//                    out[i+D/2] = x[i+D/2] c[i+D/2] + x[i] s[i+D/2]
//   silu_mul       silu(gate) * up of the fused gate|up projection (SwiGLU), with an exp good
//                    to a few float32 ulp (bf16 keeps 8 bits)
//
// Two builds of each: with AVX-512 BF16, 16 lanes in intrinsics and one instruction
// (VCVTNEPS2BF16) per rounding; on every other CPU (AVX2, AVX-512 without BF16, ARM), plain
// loops over float32 that the compiler vectorises for whatever -march/-mcpu it was given, the
// rounding done with integer bit operations. kernel_isa() (isa.h) says which was built.
// And gemv_bf16 (AVX-512 BF16 build only): a linear of one to four rows, read straight off the
// weight's plain layout; gemm_f32 (gemm_f32.h, AVX2) float32 steps of any size. And, for any
// CPU and dtype, write_kv: the step's K/V rows into the pool in one call, and row_argmax_f32:
// the greedy token of each row of float32 logits (AVX-512 where the CPU has it).
#include <cmath>
#include <cstdint>
#include <cstring>

#include "bf16.h"  // bf16_widen, bf16_narrow (lesson 14)
#include "isa.h"

typedef uint16_t bf16;   // raw bits

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>

namespace {

inline __m512 load16(const bf16* p) {      // 16 bf16 -> float32 (exact)
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}
inline __m256i to_bf16(__m512 x) { return (__m256i)_mm512_cvtneps_pbh(x); }
inline __m512 round_bf16(__m512 x) {        // float32 -> nearest bf16 -> float32
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(to_bf16(x)), 16));
}
inline void store16(bf16* p, __m512 x) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), to_bf16(x)); }

// e^x for 16 lanes: 2^n e^r, n = round(x log2 e), ln 2 split in two (Cody-Waite), degree-6
// Taylor for e^r. Saturates to 0 below -87 and to inf above 88 (silu then gives 0 or x).
inline __m512 exp16(__m512 x) {
  const __m512 xc = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(xc, _mm512_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), xc);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.0f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// One head of one token: src -> dst (D values), c/s the token's cos/sin already in bf16.
inline void norm_rope_row(const bf16* src, bf16* dst, const bf16* w, const float* c, const float* s, int64_t D,
                          float eps) {
  __m512 x[16];                              // D <= 256
  const int64_t V = D / 16, H = V / 2;
  for (int64_t j = 0; j < V; ++j) x[j] = load16(src + 16 * j);
  if (w != nullptr) {                        // RMSNorm: (x * rsqrt(mean(x^2) + eps)) to bf16, times w, to bf16
    __m512 ss = _mm512_setzero_ps();
    for (int64_t j = 0; j < V; ++j) ss = _mm512_fmadd_ps(x[j], x[j], ss);
    const __m512 r = _mm512_set1_ps(1.0f / std::sqrt(_mm512_reduce_add_ps(ss) / float(D) + eps));
    for (int64_t j = 0; j < V; ++j) x[j] = round_bf16(_mm512_mul_ps(load16(w + 16 * j), round_bf16(_mm512_mul_ps(x[j], r))));
  }
  for (int64_t j = 0; j < H; ++j) {          // x*cos + rotate_half(x)*sin, each product rounded as eager rounds it
    const __m512 lo = x[j], hi = x[j + H];
    const __m512 a0 = round_bf16(_mm512_mul_ps(lo, _mm512_loadu_ps(c + 16 * j)));
    const __m512 b0 = round_bf16(_mm512_mul_ps(_mm512_sub_ps(_mm512_setzero_ps(), hi), _mm512_loadu_ps(s + 16 * j)));
    const __m512 a1 = round_bf16(_mm512_mul_ps(hi, _mm512_loadu_ps(c + 16 * (j + H))));
    const __m512 b1 = round_bf16(_mm512_mul_ps(lo, _mm512_loadu_ps(s + 16 * (j + H))));
    store16(dst + 16 * j, _mm512_add_ps(a0, b0));
    store16(dst + 16 * (j + H), _mm512_add_ps(a1, b1));
  }
}

// The token's cos/sin rounded to bf16, as apply_rope casts them (D a multiple of 16).
inline void rounded(const float* src, float* dst, int64_t D) {
  for (int64_t j = 0; j < D; j += 16) _mm512_storeu_ps(dst + j, round_bf16(_mm512_loadu_ps(src + j)));
}

// One row: silu(gate) rounded to bf16, times up, rounded (I a multiple of 16).
inline void silu_mul_row(const bf16* g, const bf16* u, bf16* out, int64_t I) {
  for (int64_t i = 0; i < I; i += 16) {
    const __m512 x = load16(g + i);
    const __m512 silu = _mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.0f), exp16(_mm512_sub_ps(_mm512_setzero_ps(), x))));
    store16(out + i, _mm512_mul_ps(round_bf16(silu), load16(u + i)));
  }
}

}  // namespace
#else   // portable: any CPU, vectorised by the compiler
namespace {

inline float round_bf16(float x) { return bf16_widen(bf16_narrow(x)); }

// e^x as in the AVX-512 build (2^n e^r, degree-6 Taylor), clamped to [-80, 88] so that 2^n
// can be made from exponent bits alone (e^-80 is 2e-35: silu's 1 + e^-x does not see it).
inline float exp_poly(float x) {
  const float xc = std::fmin(std::fmax(x, -80.0f), 88.0f);
  const float n = std::nearbyint(xc * 1.44269504f);
  float r = xc - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float p = 1.0f / 720;
  p = p * r + 1.0f / 120;
  p = p * r + 1.0f / 24;
  p = p * r + 1.0f / 6;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  int32_t bits;
  std::memcpy(&bits, &p, sizeof bits);
  bits += int32_t(n) << 23;
  std::memcpy(&p, &bits, sizeof p);
  return p;
}

inline void norm_rope_row(const bf16* src, bf16* dst, const bf16* w, const float* c, const float* s, int64_t D,
                          float eps) {
  float x[256];                              // D <= 256
  for (int64_t j = 0; j < D; ++j) x[j] = bf16_widen(src[j]);
  if (w != nullptr) {
    float ss = 0.f;
#pragma omp simd reduction(+ : ss)
    for (int64_t j = 0; j < D; ++j) ss += x[j] * x[j];
    const float r = 1.0f / std::sqrt(ss / float(D) + eps);
#pragma omp simd
    for (int64_t j = 0; j < D; ++j) x[j] = round_bf16(bf16_widen(w[j]) * round_bf16(x[j] * r));
  }
  const int64_t H = D / 2;
#pragma omp simd
  for (int64_t j = 0; j < H; ++j) {
    const float lo = x[j], hi = x[j + H];
    dst[j] = bf16_narrow(round_bf16(lo * c[j]) + round_bf16(-hi * s[j]));
    dst[j + H] = bf16_narrow(round_bf16(hi * c[j + H]) + round_bf16(lo * s[j + H]));
  }
}

inline void rounded(const float* src, float* dst, int64_t D) {
  for (int64_t j = 0; j < D; ++j) dst[j] = round_bf16(src[j]);
}

inline void silu_mul_row(const bf16* g, const bf16* u, bf16* out, int64_t I) {
#pragma omp simd
  for (int64_t i = 0; i < I; ++i) {
    const float x = bf16_widen(g[i]);
    out[i] = bf16_narrow(round_bf16(x / (1.0f + exp_poly(-x))) * bf16_widen(u[i]));
  }
}

}  // namespace
#endif

// The two kernels, the same for both builds: rows shared out among torch's OpenMP threads.
extern "C" {

// qkv [T, row] (q heads, then k heads, from column 0; v after them is not read);
// cos, sin [T, D] float32; q_out [T, nh, D], k_out [T, nkv, D]; qw, kw [D] or null.
void qk_norm_rope_bf16(const bf16* qkv, int64_t T, int64_t row, int64_t nh, int64_t nkv, int64_t D,
                       const bf16* qw, const bf16* kw, const float* cos, const float* sin, float eps,
                       bf16* q_out, bf16* k_out) {
#pragma omp parallel for if (T * (nh + nkv) >= 256)
  for (int64_t t = 0; t < T; ++t) {
    float c[256], s[256];
    rounded(cos + t * D, c, D);
    rounded(sin + t * D, s, D);
    for (int64_t h = 0; h < nh + nkv; ++h) {
      const bool is_q = h < nh;
      bf16* dst = is_q ? q_out + (t * nh + h) * D : k_out + (t * nkv + h - nh) * D;
      norm_rope_row(qkv + t * row + h * D, dst, is_q ? qw : kw, c, s, D, eps);
    }
  }
}

// gate_up [N, 2I] (gate | up) -> out [N, I].
void silu_mul_bf16(const bf16* gate_up, int64_t N, int64_t I, bf16* out) {
#pragma omp parallel for if (N * I >= 65536)
  for (int64_t n = 0; n < N; ++n) silu_mul_row(gate_up + n * 2 * I, gate_up + n * 2 * I + I, out + n * I, I);
}

}  // extern "C"

// Both builds have both kernels; kernel_isa() tells which build this is.
extern "C" int64_t elementwise_available() { return 1; }

extern "C" {

// The step's K and V rows into the head-major pool: row i of k/v is (token i / Hkv, head
// i % Hkv), at byte strides (token, head) of k and of v; it goes to pool row rows[i]. What
// two index_copy_ calls did, in one call without torch's per-call setup (any dtype).
void write_kv(const char* k, const char* v, int64_t k_token, int64_t k_head, int64_t v_token, int64_t v_head,
              int64_t Hkv, char* k_pool, char* v_pool, const int64_t* rows, int64_t n, int64_t row_bytes) {
#pragma omp parallel for if (n * row_bytes >= (1 << 20))
  for (int64_t i = 0; i < n; ++i) {
    const int64_t t = i / Hkv, h = i % Hkv;
    std::memcpy(k_pool + rows[i] * row_bytes, k + t * k_token + h * k_head, row_bytes);
    std::memcpy(v_pool + rows[i] * row_bytes, v + t * v_token + h * v_head, row_bytes);
  }
}

}  // extern "C"

// gemv_bf16: y [M, N] = x [M, K] @ w [N, K]^T for a few rows (M <= 4), w in its plain row-major
// layout, bf16 in and out, float32 sums (VDPBF16PS: 32 products a instruction). At one to four
// rows a linear only streams its weight once, and the time is the memory's: each thread takes a
// contiguous share of the weight rows and walks them in order, one row at a time, so its reads
// are a single sequential stream the prefetcher follows (a few rows interleaved would be several
// streams at a row's stride). oneDNN's call has a larger fixed cost here and its blocked layout
// interleaves rows. AVX-512 BF16 build only (where bf16 is the auto dtype); K % 32 == 0.
#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <omp.h>

namespace {

// Out: bf16, or float for logits (the sum rounded to bf16 first, then widened: the same
// numbers as a bf16 output copied into a float32 buffer, without that copy).
inline void store_out(bf16* y, float v) {
  const __m128bh r = _mm_cvtneps_pbh(_mm_set_ss(v));
  *y = static_cast<bf16>(_mm_extract_epi16((__m128i)r, 0));
}
inline void store_out(float* y, float v) {
  const __m128bh r = _mm_cvtneps_pbh(_mm_set_ss(v));
  const uint32_t bits = uint32_t(uint16_t(_mm_extract_epi16((__m128i)r, 0))) << 16;
  std::memcpy(y, &bits, sizeof bits);
}

template <int M, typename Out>
void gemv_rows(const bf16* x, int64_t K, const bf16* w, int64_t n0, int64_t n1, Out* y, int64_t N) {
  for (int64_t n = n0; n < n1; ++n) {
    const bf16* wr = w + n * K;
    __m512 acc[M][4];
    for (int m = 0; m < M; ++m)
      for (int u = 0; u < 4; ++u) acc[m][u] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 128 <= K; k += 128) {             // 4 independent sums, so the adds overlap
      for (int u = 0; u < 4; ++u) {
        const __m512bh wv = (__m512bh)_mm512_loadu_si512(wr + k + 32 * u);
        for (int m = 0; m < M; ++m)
          acc[m][u] = _mm512_dpbf16_ps(acc[m][u], (__m512bh)_mm512_loadu_si512(x + m * K + k + 32 * u), wv);
      }
    }
    for (; k < K; k += 32) {
      const __m512bh wv = (__m512bh)_mm512_loadu_si512(wr + k);
      for (int m = 0; m < M; ++m)
        acc[m][0] = _mm512_dpbf16_ps(acc[m][0], (__m512bh)_mm512_loadu_si512(x + m * K + k), wv);
    }
    for (int m = 0; m < M; ++m) {
      const __m512 sum = _mm512_add_ps(_mm512_add_ps(acc[m][0], acc[m][1]), _mm512_add_ps(acc[m][2], acc[m][3]));
      store_out(y + m * N + n, _mm512_reduce_add_ps(sum));
    }
  }
}

template <typename Out>
void gemv_parallel(const bf16* x, int64_t M, int64_t K, const bf16* w, int64_t N, Out* y) {
#pragma omp parallel
  {
    const int64_t t = omp_get_thread_num(), T = omp_get_num_threads();
    const int64_t n0 = N * t / T, n1 = N * (t + 1) / T;
    switch (M) {
      case 1: gemv_rows<1>(x, K, w, n0, n1, y, N); break;
      case 2: gemv_rows<2>(x, K, w, n0, n1, y, N); break;
      case 3: gemv_rows<3>(x, K, w, n0, n1, y, N); break;
      default: gemv_rows<4>(x, K, w, n0, n1, y, N); break;
    }
  }
}

}  // namespace

extern "C" int64_t gemv_max_rows() { return 4; }

extern "C" void gemv_bf16(const bf16* x, int64_t M, int64_t K, const bf16* w, int64_t N, bf16* y) {
  gemv_parallel(x, M, K, w, N, y);
}

// The LM head's logits straight into the sampler's float32 buffer y [M, N].
extern "C" void gemv_bf16_f32(const bf16* x, int64_t M, int64_t K, const bf16* w, int64_t N, float* y) {
  gemv_parallel(x, M, K, w, N, y);
}
#endif

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

// row_argmax_f32: out[r] = the index of the largest of the `cols` floats of row r, the first of
// equal maxima, the first NaN if the row has one (what torch's max(dim=-1) returns). A greedy
// decode step reads 64 rows of 151,936 logits (39 MB) here; rows are split between threads.
namespace {

int64_t argmax_scalar(const float* x, int64_t begin, int64_t end, int64_t best) {
  for (int64_t j = begin; j < end; ++j) {
    if (std::isnan(x[best])) break;
    if (x[j] > x[best] || std::isnan(x[j])) best = j;
  }
  return best;
}

int64_t argmax_row(const float* x, int64_t cols) {
  int64_t j = 0, best = 0;
#if defined(__AVX512F__)
  if (cols >= 32) {
    // Each of the 16 lanes keeps its own maximum and where it first saw it (strictly greater
    // replaces, so a later equal value does not); NaNs are only noted, then the row is redone.
    __m512 vmax = _mm512_loadu_ps(x);
    __m512i vidx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512i cur = vidx;
    const __m512i step = _mm512_set1_epi32(16);
    __mmask16 nan = _mm512_cmp_ps_mask(vmax, vmax, _CMP_UNORD_Q);
    for (j = 16; j + 16 <= cols; j += 16) {
      const __m512 v = _mm512_loadu_ps(x + j);
      cur = _mm512_add_epi32(cur, step);
      const __mmask16 gt = _mm512_cmp_ps_mask(v, vmax, _CMP_GT_OQ);
      nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
      vmax = _mm512_mask_mov_ps(vmax, gt, v);
      vidx = _mm512_mask_mov_epi32(vidx, gt, cur);
    }
    if (nan) return argmax_scalar(x, 1, cols, 0);
    const float m = _mm512_reduce_max_ps(vmax);   // the earliest index among the lanes holding it
    const __mmask16 at = _mm512_cmp_ps_mask(vmax, _mm512_set1_ps(m), _CMP_EQ_OQ);
    best = _mm512_mask_reduce_min_epi32(at, vidx);
  }
#endif
  return argmax_scalar(x, j == 0 ? 1 : j, cols, best);
}

}  // namespace

extern "C" void row_argmax_f32(const float* x, int64_t rows, int64_t cols, int64_t row_stride, int64_t* out) {
#pragma omp parallel for if (rows > 1 && rows * cols >= (1 << 18))
  for (int64_t r = 0; r < rows; ++r) out[r] = argmax_row(x + r * row_stride, cols);
}

#include "gemm_f32.h"  // float32 matmuls against weights packed in panels (AVX2 builds)

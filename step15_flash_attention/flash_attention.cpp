// Paged varlen FlashAttention on the CPU: prompt chunks and decodes of one step in one call.
//
// The whole batch arrives as flash-attn's "varlen" layout (see reference.py): q [T, Hq, D]
// with sequence b's queries at rows cu_seqlens_q[b] .. cu_seqlens_q[b+1]-1, being its last
// n_b positions; keys 0 .. seq_lens[b]-1 live in lesson 14's head-major pool
// [num_blocks, Hkv, block_size, D] and are read in place, block by block, through the table.
//
// Work items, shared out among torch's OpenMP threads:
//   prefill tile  (sequence, KV head, up to `q_tile` queries): the tile's queries times the
//                 `group` query heads of that KV head make M rows; K/V are walked in key
//                 tiles of whole blocks with an online softmax (running max, sum, rescale);
//                 key tiles past the tile's last query position are never touched.
//   decode        (sequence, KV head) for a one-token query: the same online softmax, one
//                 block at a time, with lesson 14's row loops (one query row per head).
// Scratch per thread is a few tiles (about 100 KB), whatever the sequence length.
//
// A prefill tile's products are small matrix multiplies done in float32 FMAs, 16 lanes wide:
//   S^T = K Q^T   computed transposed, [keys, rows]: the rows of the query tile sit in the 16
//                 lanes of a register, each key element is broadcast to all of them, so K is
//                 used as the pool stores it and the softmax's max and sum over keys are
//                 lane-wise max/add, with no horizontal reductions;
//   acc += P V    4 rows x 64 columns of the accumulator stay in registers over the key tile.
// bf16 K/V tiles are widened to float32 once per tile (exact). On this lesson's CPU, float32
// FMAs do twice the work per cycle of the AVX512-BF16 dot-product instruction (README).
#include <type_traits>

#include "paged_decode.cpp"  // lesson 14: to_f32, store, dot_row, axpy_row, prefetch

#include <vector>

namespace {

constexpr int64_t kMaxRows = 64;   // M: rows of a query tile (q_tile * group, padded to 16)
constexpr int64_t kKeyTile = 64;   // keys per key tile (rounded to whole blocks)
constexpr int64_t kMaxKeyTile = 1024;  // block_size limit: a key tile holds at least one block

// exp for the softmax, written so that `omp simd` loops vectorise it (glibc's vector expf is
// only used under full -ffast-math, which lesson 14's flags keep off to keep infinities).
// exp(x) = 2^n * e^r with n = round(x / ln 2), |r| <= ln(2)/2, e^r by a degree-6 polynomial:
// about 2 ulp. Far below the float range (x < -87.3, and -inf for masked keys) it returns 0.
inline float fast_exp(float x) {
  const float t = std::max(x, -87.3f) * 1.44269504f;
  const float n = std::nearbyint(t);
  const float r = (t - n) * 0.693147181f;
  float p = 1.f / 720;
  p = p * r + 1.f / 120;
  p = p * r + 1.f / 24;
  p = p * r + 1.f / 6;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  int32_t bits;
  std::memcpy(&bits, &p, sizeof bits);
  bits += int32_t(n) << 23;  // times 2^n
  float e;
  std::memcpy(&e, &bits, sizeof e);
  return x < -87.3f ? 0.f : e;
}

template <typename T>
inline void prefetch_l2(const T* p, int64_t n) {  // lesson 14's prefetch, into L2 rather than L1
  for (int64_t i = 0; i < n * int64_t(sizeof(T)); i += 64) __builtin_prefetch(reinterpret_cast<const char*>(p) + i, 0, 1);
}

struct Args {
  int64_t max_blocks, hkv, group, bs, D, key_tile;
  float scale;
  const int64_t *cu, *lens, *tables;
};

struct Scratch {  // one per thread, reused by every item it runs
  std::vector<float> qt, kf, vf, s, acc;
  float m[kMaxRows], l[kMaxRows], alpha[kMaxRows];
  int64_t pos[kMaxRows];
  Scratch(int64_t D, int64_t key_tile)  // key_tile >= block_size, so s also holds a decode's [group][block_size]
      : qt(D * kMaxRows), kf(key_tile * D), vf(key_tile * D), s(kMaxRows * key_tile), acc(kMaxRows * D) {}
};

// ---------------------------------------------------------------------------------------
// Tile products in float32 FMAs on 16-float vectors. bf16 tiles are widened to float32 once,
// as they are loaded; measured here, 16-lane float32 FMAs do twice the work per cycle of the
// AVX512-BF16 dot-product instruction (see README), so the wider numbers cost nothing.
//
// A vec16 is one AVX-512 register, two AVX2 ones or four NEON ones: a small struct of the
// target's own vector type (GCC/Clang vector extensions). A single 64-byte vector type would
// do on AVX-512 only: built for AVX2, GCC moved every such vector through the stack in 16-byte
// pieces, and lesson 15's prompt attention ran 20x slower than its AVX-512 build (baseline
// mode, 512-token prompt: 190 vs 8.5 ms a layer, one-off; lesson 15's README has the figures
// of `bench.py kernel`).
#if defined(__AVX512F__)
typedef float vnative __attribute__((vector_size(64), aligned(4)));
#elif defined(__AVX__)
typedef float vnative __attribute__((vector_size(32), aligned(4)));
#else
typedef float vnative __attribute__((vector_size(16), aligned(4)));
#endif
constexpr int kPieces = 64 / sizeof(vnative), kLanes = 16 / kPieces;
struct vec16 {
  vnative p[kPieces];
};
inline vec16 load16(const float* x) {
  vec16 r;
  for (int i = 0; i < kPieces; ++i) r.p[i] = *reinterpret_cast<const vnative*>(x + i * kLanes);
  return r;
}
inline void store16(float* x, const vec16& v) {
  for (int i = 0; i < kPieces; ++i) *reinterpret_cast<vnative*>(x + i * kLanes) = v.p[i];
}
inline vec16& operator+=(vec16& a, const vec16& b) {
  for (int i = 0; i < kPieces; ++i) a.p[i] += b.p[i];
  return a;
}
inline vec16 operator*(float k, const vec16& b) {
  vec16 r;
  for (int i = 0; i < kPieces; ++i) r.p[i] = k * b.p[i];
  return r;
}

// How many vec16 a micro-tile keeps in registers. AVX-512 has 32 registers of 16 floats:
// scores hold 6 keys x 4 vectors of rows, P V 4 rows x 4 vectors of columns. AVX2 has 16
// registers of 8 floats and NEON 32 of 4: there 6 keys x 1 vector and 4 rows x 1 vector fit.
// Each output element sees the same FMAs in the same order either way.
#if defined(__AVX512F__)
constexpr int kRowVectors = 4, kColVectors = 4;
#else
constexpr int kRowVectors = 1, kColVectors = 1;
#endif

template <typename T>
void widen_rows(const T* const* rows, int64_t n, int64_t D, float* dst) {  // n pool rows -> [n][D] float
  for (int64_t k = 0; k < n; ++k)
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) dst[k * D + d] = to_f32(rows[k][d]);
}

// S^T[k][m] = sum_d K[k][d] Qt[d][m] for NR keys and MV*16 rows, all in registers.
template <int NR, int MV>
inline void scores_micro(const float* kf, const float* qt, int64_t M, int64_t D, float* s) {
  vec16 acc[NR][MV] = {};
  for (int64_t d = 0; d < D; ++d) {
    vec16 qv[MV];
    for (int v = 0; v < MV; ++v) qv[v] = load16(qt + d * M + 16 * v);
    for (int r = 0; r < NR; ++r) {
      const float kd = kf[r * D + d];  // broadcast one key element to all 16 rows
      for (int v = 0; v < MV; ++v) acc[r][v] += kd * qv[v];
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int v = 0; v < MV; ++v) store16(s + r * M + 16 * v, acc[r][v]);
}

template <int MV>
void scores_mv(const float* kf, int64_t n, const float* qt, int64_t M, int64_t D, float* s) {
  int64_t k = 0;
  for (; k + 6 <= n; k += 6) scores_micro<6, MV>(kf + k * D, qt, M, D, s + k * M);
  for (; k + 2 <= n; k += 2) scores_micro<2, MV>(kf + k * D, qt, M, D, s + k * M);
  for (; k < n; ++k) scores_micro<1, MV>(kf + k * D, qt, M, D, s + k * M);
}

void scores(const float* kf, int64_t n, const float* qt, int64_t M, int64_t D, float* s) {
  for (int64_t m0 = 0; m0 < M; m0 += 16 * kRowVectors) {  // 64 rows (AVX-512) at a time; this key tile stays in L1
    switch (std::min<int64_t>(kRowVectors, (M - m0) / 16)) {
      case 1: scores_mv<1>(kf, n, qt + m0, M, D, s + m0); break;
      case 2: scores_mv<2>(kf, n, qt + m0, M, D, s + m0); break;
      case 3: scores_mv<3>(kf, n, qt + m0, M, D, s + m0); break;
      default: scores_mv<4>(kf, n, qt + m0, M, D, s + m0);
    }
  }
}

// acc[m][d] += sum_k P[k][m] V[k][d] for 4 rows x DV*16 columns, kept in registers over the keys.
template <int DV>
inline void pv_micro(const float* p, const float* vf, int64_t n, int64_t M, int64_t D, float* acc) {
  vec16 c[4][DV];
  for (int r = 0; r < 4; ++r)
    for (int v = 0; v < DV; ++v) c[r][v] = load16(acc + r * D + 16 * v);
  for (int64_t k = 0; k < n; ++k) {
    vec16 vv[DV];
    for (int v = 0; v < DV; ++v) vv[v] = load16(vf + k * D + 16 * v);
    for (int r = 0; r < 4; ++r) {
      const float pk = p[k * M + r];
      for (int v = 0; v < DV; ++v) c[r][v] += pk * vv[v];
    }
  }
  for (int r = 0; r < 4; ++r)
    for (int v = 0; v < DV; ++v) store16(acc + r * D + 16 * v, c[r][v]);
}

void pv(const float* p, const float* vf, int64_t n, int64_t M, int64_t D, float* acc) {
  // Columns outer, rows inner: one 64-column slice of V (16 KB for 64 keys) stays in L1 while
  // every row uses it. M is a multiple of 16, so rows go 4 at a time (padded rows are harmless).
  int64_t d0 = 0;
  for (; kColVectors == 4 && d0 + 64 <= D; d0 += 64)
    for (int64_t m0 = 0; m0 < M; m0 += 4) pv_micro<4>(p + m0, vf + d0, n, M, D, acc + m0 * D + d0);
  for (; d0 + 16 <= D; d0 += 16)
    for (int64_t m0 = 0; m0 < M; m0 += 4) pv_micro<1>(p + m0, vf + d0, n, M, D, acc + m0 * D + d0);
  for (; d0 < D; ++d0)  // head_dim not a multiple of 16: the last columns one by one
    for (int64_t m = 0; m < M; ++m)
      for (int64_t k = 0; k < n; ++k) acc[m * D + d0] += p[k * M + m] * vf[k * D + d0];
}

// ---------------------------------------------------------------------------------------
// One prefill tile: queries i0 .. i0+n-1 of sequence b (positions first_pos + ...), KV head h.
template <typename T>
void prefill_tile(const T* q, const T* kp, const T* vp, T* out, const Args& a, int64_t b, int64_t h, int64_t i0,
                  int64_t n, Scratch& w) {
  const int64_t D = a.D, bs = a.bs, group = a.group, rows = n * group, M = (rows + 15) / 16 * 16;
  const int64_t q0 = a.cu[b], len = a.lens[b], first_pos = len - (a.cu[b + 1] - q0) + (i0 - q0);
  const int64_t last_key = first_pos + n - 1;  // no row of this tile sees past it
  const int64_t* table = a.tables + b * a.max_blocks;
  const int64_t key_tile = a.key_tile;
  for (int64_t m = 0; m < M; ++m) {
    w.m[m] = -INFINITY;
    w.l[m] = 0.f;
    w.pos[m] = m < rows ? first_pos + m / group : last_key;  // padded rows see every key: no NaN
  }
  std::fill(w.acc.begin(), w.acc.begin() + M * D, 0.f);
  // Qt [D][M]: row m = (query i0 + m / group, head h*group + m % group), widened; padded rows zero.
  const int64_t Hq = a.hkv * group;
  std::fill(w.qt.begin(), w.qt.begin() + D * M, 0.f);
  for (int64_t m = 0; m < rows; ++m) {
    const T* row = q + ((i0 + m / group) * Hq + h * group + m % group) * D;
    for (int64_t d = 0; d < D; ++d) w.qt[d * M + m] = to_f32(row[d]);
  }
  const T* krow[kMaxKeyTile];
  const T* vrow[kMaxKeyTile];
  float* s = w.s.data();
  for (int64_t j0 = 0; j0 <= last_key; j0 += key_tile) {
    const int64_t nk = std::min(key_tile, last_key + 1 - j0);
    for (int64_t k = 0; k < nk; ++k) {  // block table -> row pointers into the pool
      const int64_t key = j0 + k, piece = (table[key / bs] * a.hkv + h) * bs + key % bs;
      krow[k] = kp + piece * D;
      vrow[k] = vp + piece * D;
    }
    // The next tile's blocks lie anywhere in the pool, so no hardware prefetcher guesses them:
    // ask for them now, into L2, while this tile's arithmetic runs (8k prompt: 1.7 -> 1.35 s).
    for (int64_t key = j0 + nk; key < std::min(j0 + nk + key_tile, last_key + 1); key += bs) {
      const int64_t piece = (table[key / bs] * a.hkv + h) * bs;
      prefetch_l2(kp + piece * D, bs * D);
      prefetch_l2(vp + piece * D, bs * D);
    }
    // S^T = K Q^T for this key tile: [nk, M].
    widen_rows(krow, nk, D, w.kf.data());
    scores(w.kf.data(), nk, w.qt.data(), M, D, s);
    if (j0 + nk - 1 > w.pos[0]) {  // the tile crosses the causal diagonal: hide the future
      for (int64_t k = 0; k < nk; ++k)
        for (int64_t m = 0; m < M; ++m)
          if (j0 + k > w.pos[m]) s[k * M + m] = -INFINITY;
    }
    // Online softmax, lane-wise over the rows: new max, rescale factor, exponentials, sums.
    float mx[kMaxRows], sum[kMaxRows];
    std::copy(w.m, w.m + M, mx);
    for (int64_t k = 0; k < nk; ++k)
#pragma omp simd
      for (int64_t m = 0; m < M; ++m) mx[m] = std::max(mx[m], s[k * M + m]);
#pragma omp simd
    for (int64_t m = 0; m < M; ++m) {
      w.alpha[m] = fast_exp((w.m[m] - mx[m]) * a.scale);
      w.m[m] = mx[m];
      sum[m] = 0.f;
    }
    for (int64_t k = 0; k < nk; ++k) {
      float* sk = s + k * M;
#pragma omp simd
      for (int64_t m = 0; m < M; ++m) {
        sk[m] = fast_exp((sk[m] - mx[m]) * a.scale);
        sum[m] += sk[m];
      }
    }
    for (int64_t m = 0; m < M; ++m) {
      w.l[m] = w.alpha[m] * w.l[m] + sum[m];
      if (w.alpha[m] != 1.f) {
        float* am = w.acc.data() + m * D;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) am[d] *= w.alpha[m];
      }
    }
    // acc += P V for this key tile.
    widen_rows(vrow, nk, D, w.vf.data());
    pv(s, w.vf.data(), nk, M, D, w.acc.data());
  }
  for (int64_t m = 0; m < rows; ++m) {
    T* o = out + ((i0 + m / group) * Hq + h * group + m % group) * D;
    const float inv = 1.f / w.l[m];
    for (int64_t d = 0; d < D; ++d) store(&o[d], w.acc[m * D + d] * inv);
  }
}

// ---------------------------------------------------------------------------------------
// A decode's two per-block loops for bf16 with AVX512-BF16, for G heads of D = 32 * NV2:
// each K row is loaded once for all G heads (the q rows sit in registers), and in P V the
// G x D accumulators stay in registers over the block's keys while each V row is widened
// once for all heads. The generic loops below load K and widen V once per head, and load
// and store the accumulator for every key; on a Xeon with AMX that made decode attention
// compute-bound below the memory's rate (advanced lesson 04 measures it).
#if defined(__AVX512BF16__)
// Four keys' dot products summed across their 16 lanes at once: the same additions, in the
// same order, as four _mm512_reduce_add_ps (halves of 256, then 128 bits, then pairs), but
// each shuffle and add serves all four keys (10 instructions for four sums, not 4 x 8).
inline __m128 reduce_add_4(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
  const __m512 u = _mm512_add_ps(_mm512_shuffle_f32x4(a0, a1, 0x44), _mm512_shuffle_f32x4(a0, a1, 0xEE));
  const __m512 v = _mm512_add_ps(_mm512_shuffle_f32x4(a2, a3, 0x44), _mm512_shuffle_f32x4(a2, a3, 0xEE));
  // 128-bit lane k now holds key k's eight half-sums folded to four: lo 128 + hi 128 of them.
  const __m512 w = _mm512_add_ps(_mm512_shuffle_f32x4(u, v, 0x88), _mm512_shuffle_f32x4(u, v, 0xDD));
  const __m512 c = _mm512_add_ps(w, _mm512_permute_ps(w, 0x4E));   // [b0+b2, b1+b3, ...] per lane
  const __m512 d = _mm512_add_ps(c, _mm512_permute_ps(c, 0xB1));   // c0 + c1 in element 0 of each lane
  return _mm512_castps512_ps128(_mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0), d));
}

// Prefetch: a fixed 8 keys ahead of the scores loop, K and V, crossing into the next block
// near this one's end. Asking for the whole next block a row per key (lesson 14's rule, kept
// by the generic loops) puts the requests a block ahead and in 4 KB pieces; on the Xeon with
// AMX the fixed distance read the pool faster (one-off test, block size 16).
template <int G, int NV2>
void scores_block_bf16(const uint16_t* qh, const uint16_t* kb, const uint16_t* vb, const uint16_t* k_next,
                       const uint16_t* v_next, int64_t cnt, int64_t bs, float scale, float* s) {
  constexpr int D = 32 * NV2;
  constexpr int64_t kAhead = 8;  // rows: K and V are asked for 8 keys (2 x 2 KB at D = 128) ahead
  __m512bh qv[G][NV2];
  for (int g = 0; g < G; ++g)
    for (int i = 0; i < NV2; ++i) qv[g][i] = (__m512bh)_mm512_loadu_si512(qh + g * D + i * 32);
  const __m128 sc = _mm_set1_ps(scale);
  int64_t t = 0;
  for (; t + 4 <= cnt; t += 4) {
    if (t + kAhead < cnt)
      prefetch(kb + (t + kAhead) * D, 4 * D), prefetch(vb + (t + kAhead) * D, 4 * D);
    else if (k_next)  // near the block's end, the next block's first rows
      prefetch(k_next + (t + kAhead - cnt) * D, 4 * D), prefetch(v_next + (t + kAhead - cnt) * D, 4 * D);
    __m512 acc[G][4];
    for (int g = 0; g < G; ++g)
      for (int r = 0; r < 4; ++r) acc[g][r] = _mm512_setzero_ps();
    for (int r = 0; r < 4; ++r)
      for (int i = 0; i < NV2; ++i) {
        const __m512bh kv = (__m512bh)_mm512_loadu_si512(kb + (t + r) * D + i * 32);
        for (int g = 0; g < G; ++g) acc[g][r] = _mm512_dpbf16_ps(acc[g][r], qv[g][i], kv);
      }
    for (int g = 0; g < G; ++g)
      _mm_storeu_ps(s + g * bs + t, _mm_mul_ps(reduce_add_4(acc[g][0], acc[g][1], acc[g][2], acc[g][3]), sc));
  }
  for (; t < cnt; ++t) {
    __m512 acc[G];
    for (int g = 0; g < G; ++g) acc[g] = _mm512_setzero_ps();
    for (int i = 0; i < NV2; ++i) {
      const __m512bh kv = (__m512bh)_mm512_loadu_si512(kb + t * D + i * 32);
      for (int g = 0; g < G; ++g) acc[g] = _mm512_dpbf16_ps(acc[g], qv[g][i], kv);
    }
    for (int g = 0; g < G; ++g) s[g * bs + t] = _mm512_reduce_add_ps(acc[g]) * scale;
  }
}

// P V with each 32-element V chunk widened by two instructions: as 16 dwords, a shift left by
// 16 gives the even elements as float32, masking the low half gives the odd ones. The
// accumulators are kept split the same way (even and odd dimensions) while the block's keys
// go by, and put back in order once a block: every element sees the same FMAs in the same
// order as before, only the widening is cheaper.
template <int G, int NV2>
void pv_block_bf16(const float* s, const uint16_t* vb, int64_t cnt, int64_t bs, float* acc) {
  constexpr int D = 32 * NV2;
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i odd = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
  const __m512i lo = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
  const __m512i hi = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
  const __m512i high_half = _mm512_set1_epi32(int32_t(0xFFFF0000u));
  __m512 re[G][NV2], ro[G][NV2];
  for (int g = 0; g < G; ++g)
    for (int i = 0; i < NV2; ++i) {
      const __m512 a = _mm512_loadu_ps(acc + g * D + i * 32), b = _mm512_loadu_ps(acc + g * D + i * 32 + 16);
      re[g][i] = _mm512_permutex2var_ps(a, even, b);
      ro[g][i] = _mm512_permutex2var_ps(a, odd, b);
    }
  for (int64_t t = 0; t < cnt; ++t) {
    __m512 p[G];
    for (int g = 0; g < G; ++g) p[g] = _mm512_set1_ps(s[g * bs + t]);
    for (int i = 0; i < NV2; ++i) {
      const __m512i raw = _mm512_loadu_si512(vb + t * D + i * 32);
      const __m512 ve = _mm512_castsi512_ps(_mm512_slli_epi32(raw, 16));
      const __m512 vo = _mm512_castsi512_ps(_mm512_and_si512(raw, high_half));
      for (int g = 0; g < G; ++g) {
        re[g][i] = _mm512_fmadd_ps(p[g], ve, re[g][i]);
        ro[g][i] = _mm512_fmadd_ps(p[g], vo, ro[g][i]);
      }
    }
  }
  for (int g = 0; g < G; ++g)
    for (int i = 0; i < NV2; ++i) {
      _mm512_storeu_ps(acc + g * D + i * 32, _mm512_permutex2var_ps(re[g][i], lo, ro[g][i]));
      _mm512_storeu_ps(acc + g * D + i * 32 + 16, _mm512_permutex2var_ps(re[g][i], hi, ro[g][i]));
    }
}

struct DecodeBlockFns {
  void (*scores)(const uint16_t*, const uint16_t*, const uint16_t*, const uint16_t*, const uint16_t*, int64_t, int64_t,
                 float, float*);
  void (*pv)(const float*, const uint16_t*, int64_t, int64_t, float*);
};

template <int G>
DecodeBlockFns block_fns_for(int64_t D) {
  if (D == 128) return {scores_block_bf16<G, 4>, pv_block_bf16<G, 4>};
  if (D == 64) return {scores_block_bf16<G, 2>, pv_block_bf16<G, 2>};
  return {nullptr, nullptr};
}

inline DecodeBlockFns decode_block_fns(int64_t group, int64_t D) {  // {nullptr, nullptr}: the generic loops
  switch (group) {
    case 1: return block_fns_for<1>(D);
    case 2: return block_fns_for<2>(D);
    case 3: return block_fns_for<3>(D);
    case 4: return block_fns_for<4>(D);
    default: return {nullptr, nullptr};
  }
}
#endif

#include "decode_bf16.h"  // one decode item with its accumulators in registers

// One block's scores s[g][0..cnt) -> probabilities, with each head's running max, sum and
// accumulator brought up to date (the online softmax of the prefill tiles, one row per head).
// m, l: each head's running max and sum (advanced lesson 04 calls it on a key range).
inline void online_rescale(float* m, float* l, float* s, int64_t cnt, int64_t bs, int64_t group, int64_t D,
                           float* acc) {
  for (int64_t g = 0; g < group; ++g) {
    float* sg = s + g * bs;
    float mx = m[g], sum = 0.f;
    for (int64_t t = 0; t < cnt; ++t) mx = std::max(mx, sg[t]);
    const float alpha = fast_exp(m[g] - mx);
    #pragma omp simd reduction(+ : sum)
    for (int64_t t = 0; t < cnt; ++t) sum += (sg[t] = fast_exp(sg[t] - mx));
    l[g] = alpha * l[g] + sum;
    m[g] = mx;
    if (alpha != 1.f)
      for (int64_t d = 0; d < D; ++d) acc[g * D + d] *= alpha;
  }
}

// One decode: the single query row of each of the `group` heads, block by block, online.
template <typename T>
void decode_item(const T* q, const T* kp, const T* vp, T* out, const Args& a, int64_t b, int64_t h, Scratch& w) {
  const int64_t D = a.D, bs = a.bs, group = a.group, len = a.lens[b], row = a.cu[b];
  const int64_t* table = a.tables + b * a.max_blocks;
  const T* qh = q + (row * a.hkv + h) * group * D;
  float* acc = w.acc.data();  // [group][D]
  float* s = w.s.data();      // [group][bs]
  T* o = out + (row * a.hkv + h) * group * D;
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, uint16_t>) {
    if (const FusedDecodeFn fused = fused_decode_fn(group, D)) {
      fused(qh, kp, vp, table, len, bs, a.hkv, h, a.scale, acc, w.l);
      for (int64_t g = 0; g < group; ++g)
        for (int64_t d = 0; d < D; ++d) store(&o[g * D + d], acc[g * D + d] / w.l[g]);
      return;
    }
  }
#endif
  std::fill(acc, acc + group * D, 0.f);
  for (int64_t g = 0; g < group; ++g) w.m[g] = -INFINITY, w.l[g] = 0.f;
#if defined(__AVX512BF16__)
  DecodeBlockFns fast{nullptr, nullptr};
  if constexpr (std::is_same_v<T, uint16_t>) fast = decode_block_fns(group, D);
#endif
  for (int64_t start = 0, j = 0; start < len; start += bs, ++j) {
    const int64_t cnt = std::min(bs, len - start), piece = (table[j] * a.hkv + h) * bs * D;
    const int64_t next = start + bs < len ? (table[j + 1] * a.hkv + h) * bs * D : -1;
    const T *kb = kp + piece, *vb = vp + piece;
#if defined(__AVX512BF16__)
    if constexpr (std::is_same_v<T, uint16_t>) {
      if (fast.scores) {
        // The next block's K and V pieces (4 KB each at block size 16, D 128: a page each, and
        // anywhere in the pool), asked for whole into L2 while this block computes, so their
        // loads overlap this block's arithmetic. Without a matrix unit a decode over scattered
        // blocks reads its pool well below the memory's rate (`bench.py decode` prints both).
        if (next >= 0) prefetch_l2(kp + next, bs * D), prefetch_l2(vp + next, bs * D);
        fast.scores(qh, kb, vb, next >= 0 ? kp + next : nullptr, next >= 0 ? vp + next : nullptr, cnt, bs, a.scale, s);
        online_rescale(w.m, w.l, s, cnt, bs, group, D, acc);
        fast.pv(s, vb, cnt, bs, acc);
        continue;
      }
    }
#endif
    for (int64_t t = 0; t < cnt; ++t) {
      if (next >= 0) prefetch(kp + next + t * D, D), prefetch(vp + next + t * D, D);
      for (int64_t g = 0; g < group; ++g) s[g * bs + t] = dot_row(qh + g * D, kb + t * D, D) * a.scale;
    }
    online_rescale(w.m, w.l, s, cnt, bs, group, D, acc);
    for (int64_t t = 0; t < cnt; ++t)
      for (int64_t g = 0; g < group; ++g) axpy_row(acc + g * D, s[g * bs + t], vb + t * D, D);
  }
  for (int64_t g = 0; g < group; ++g)
    for (int64_t d = 0; d < D; ++d) store(&o[g * D + d], acc[g * D + d] / w.l[g]);
}

int64_t key_tile(int64_t bs) { return std::max<int64_t>(1, kKeyTile / bs) * bs; }  // whole blocks

struct Item {
  int64_t b, h, i0, n;  // n == 0: a decode
};

template <typename T>
void flash(const T* q, const T* kp, const T* vp, T* out, const Args& a, int64_t B, int64_t q_tile) {
  // Most expensive first (prefill tiles late in long sequences), so the threads finish together.
  std::vector<std::pair<int64_t, Item>> work;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t q0 = a.cu[b], n = a.cu[b + 1] - q0;
    for (int64_t h = 0; h < a.hkv; ++h) {
      if (n == 1) {
        work.push_back({a.lens[b], Item{b, h, q0, 0}});
        continue;
      }
      for (int64_t i0 = q0; i0 < q0 + n; i0 += q_tile) {
        const int64_t cnt = std::min(q_tile, q0 + n - i0);
        work.push_back({(a.lens[b] - (q0 + n - i0) + cnt) * cnt, Item{b, h, i0, cnt}});
      }
    }
  }
  std::stable_sort(work.begin(), work.end(), [](const auto& x, const auto& y) { return x.first > y.first; });
  const int64_t num = int64_t(work.size());
#pragma omp parallel
  {
    Scratch w(a.D, a.key_tile);
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < num; ++i) {
      const Item& it = work[i].second;
      if (it.n == 0)
        decode_item(q, kp, vp, out, a, it.b, it.h, w);
      else
        prefill_tile(q, kp, vp, out, a, it.b, it.h, it.i0, it.n, w);
    }
  }
}

}  // namespace

extern "C" {

int64_t flash_max_rows() { return kMaxRows; }

void flash_attention_bf16(const uint16_t* q, const uint16_t* k, const uint16_t* v, const int64_t* cu,
                          const int64_t* lens, const int64_t* tables, uint16_t* out, int64_t B, int64_t max_blocks,
                          int64_t hkv, int64_t group, int64_t bs, int64_t D, float scale, int64_t q_tile) {
  flash(q, k, v, out, Args{max_blocks, hkv, group, bs, D, key_tile(bs), scale, cu, lens, tables}, B, q_tile);
}

void flash_attention_f32(const float* q, const float* k, const float* v, const int64_t* cu, const int64_t* lens,
                         const int64_t* tables, float* out, int64_t B, int64_t max_blocks, int64_t hkv,
                         int64_t group, int64_t bs, int64_t D, float scale, int64_t q_tile) {
  flash(q, k, v, out, Args{max_blocks, hkv, group, bs, D, key_tile(bs), scale, cu, lens, tables}, B, q_tile);
}

}  // extern "C"

// A prefill tile's two products in float32 FMAs, for any CPU and either dtype: bf16 K/V
// tiles are widened to float32 once per tile (exact), then
//   S^T = K Q^T   computed transposed, [keys, rows]: the rows of the query tile sit in the 16
//                 lanes of a register, each key element is broadcast to all of them;
//   acc += P V    rows x columns of the accumulator stay in registers over the key tile (6 x 32
//                 on AVX-512, 6 x 16 on AVX2), V widened into 16-column slices read in order.
// Included by flash_attention.cpp inside its namespace (it uses Scratch and to_f32).
// prefill_bf16.h does the same products with bf16 dot products, where those are faster.

// A vec16 is one AVX-512 register, two AVX2 ones or four NEON ones: a small struct of the
// target's own vector type (GCC/Clang vector extensions). A single 64-byte vector type would
// do on AVX-512 only: built for AVX2, GCC moved every such vector through the stack in 16-byte
// pieces, and lesson 15's prompt attention ran 20x slower than its AVX-512 build (baseline
// mode, 512-token prompt: 190 vs 8.5 ms a layer, one-off; lesson 15's README has the figures
// of `bench.py kernel`).
#if defined(__x86_64__)
#include <immintrin.h>
#endif
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
// acc += k * b as one fused multiply-add per piece. Written as `acc += k * b` on vec16, the
// -ffast-math of lesson 14's flags let GCC reassociate a micro-tile's chains on AVX2 (two keys'
// products summed first, then added to acc): a multiply, an FMA and an add where two FMAs do,
// and accumulators spilled to the stack.
inline void fma16(vec16& acc, float k, const vec16& b) {
#if defined(__AVX512F__)
  const __m512 kv = _mm512_set1_ps(k);
  for (int i = 0; i < kPieces; ++i) acc.p[i] = vnative(_mm512_fmadd_ps(kv, __m512(b.p[i]), __m512(acc.p[i])));
#elif defined(__AVX2__) && defined(__FMA__)
  const __m256 kv = _mm256_set1_ps(k);
  for (int i = 0; i < kPieces; ++i) acc.p[i] = vnative(_mm256_fmadd_ps(kv, __m256(b.p[i]), __m256(acc.p[i])));
#else
  for (int i = 0; i < kPieces; ++i) acc.p[i] += k * b.p[i];
#endif
}

// How many vec16 a micro-tile keeps in registers. AVX-512 has 32 registers of 16 floats:
// scores hold 6 keys x 4 vectors of rows, P V 6 rows x 2 vectors of columns (on a Zen 4 core
// 4 rows x 4 vectors ran P V slower: `bench.py kernel`). AVX2 has 16 registers of 8 floats and
// NEON 32 of 4: there 6 keys x 1 vector and 6 rows x 1 vector fit (12 of AVX2's registers for
// the sums, 2 for the loaded vector, 1 for the broadcast). Each output element sees the same
// FMAs in the same order either way.
#if defined(__AVX512F__)
constexpr int kRowVectors = 4, kColVectors = 2;
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
      for (int v = 0; v < MV; ++v) fma16(acc[r][v], kd, qv[v]);
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

void scores_tile(const float* kf, int64_t n, const float* qt, int64_t M, int64_t D, float* s) {
  for (int64_t m0 = 0; m0 < M; m0 += 16 * kRowVectors) {  // 64 rows (AVX-512) at a time; this key tile stays in L1
    switch (std::min<int64_t>(kRowVectors, (M - m0) / 16)) {
      case 1: scores_mv<1>(kf, n, qt + m0, M, D, s + m0); break;
      case 2: scores_mv<2>(kf, n, qt + m0, M, D, s + m0); break;
      case 3: scores_mv<3>(kf, n, qt + m0, M, D, s + m0); break;
      default: scores_mv<4>(kf, n, qt + m0, M, D, s + m0);
    }
  }
}

// acc[m][d] += sum_k P[k][m] V[k][d] for R rows x DV*16 columns, kept in registers over the keys.
// vs: V in 16-column slices, [D / 16][n][16] (widen_slices), from the first of the DV slices.
template <int DV, int R>
inline void pv_micro(const float* p, const float* vs, int64_t n, int64_t M, int64_t D, float* acc) {
  vec16 c[R][DV];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < DV; ++v) c[r][v] = load16(acc + r * D + 16 * v);
  for (int64_t k = 0; k < n; ++k) {
    vec16 vv[DV];
    for (int v = 0; v < DV; ++v) vv[v] = load16(vs + (v * n + k) * 16);
    for (int r = 0; r < R; ++r) {
      const float pk = p[k * M + r];
      for (int v = 0; v < DV; ++v) fma16(c[r][v], pk, vv[v]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < DV; ++v) store16(acc + r * D + 16 * v, c[r][v]);
}

// n pool rows -> V in 16-column slices: the first D16 = D / 16 * 16 columns as [D16 / 16][n][16],
// then the columns past them (head_dim not a multiple of 16) as [n][D - D16].
template <typename T>
void widen_slices(const T* const* rows, int64_t n, int64_t D, float* dst) {
  const int64_t D16 = D / 16 * 16, rest = D - D16;
  for (int64_t k = 0; k < n; ++k) {
    for (int64_t d0 = 0; d0 < D16; d0 += 16)
#pragma omp simd
      for (int64_t d = 0; d < 16; ++d) dst[(d0 / 16 * n + k) * 16 + d] = to_f32(rows[k][d0 + d]);
    for (int64_t d = 0; d < rest; ++d) dst[D16 * n + k * rest + d] = to_f32(rows[k][D16 + d]);
  }
}

// acc += P V for every row (6 at a time, then 4 or 2: M is a multiple of 16; padded rows are
// harmless) over the columns d0 .. d0 + 16 * DV - 1.
template <int DV>
void pv_rows(const float* p, const float* vs, int64_t n, int64_t M, int64_t D, int64_t d0, float* acc) {
  int64_t m0 = 0;
  for (; m0 + 6 <= M; m0 += 6) pv_micro<DV, 6>(p + m0, vs + d0 * n, n, M, D, acc + m0 * D + d0);
  for (; m0 + 4 <= M; m0 += 4) pv_micro<DV, 4>(p + m0, vs + d0 * n, n, M, D, acc + m0 * D + d0);
  for (; m0 < M; m0 += 2) pv_micro<DV, 2>(p + m0, vs + d0 * n, n, M, D, acc + m0 * D + d0);
}

void pv_tile(const float* p, const float* vs, int64_t n, int64_t M, int64_t D, float* acc) {
  // Columns outer, rows inner: one slice of V stays in L1 while every row uses it, read in
  // order (a slice's 16 columns of key k, then of key k + 1, 64 bytes on; in the pool's layout
  // rows are D floats apart, 512 bytes at D = 128, and fall on a few of L1's sets).
  const int64_t D16 = D / 16 * 16;
  int64_t d0 = 0;
  for (; d0 + 16 * kColVectors <= D16; d0 += 16 * kColVectors) pv_rows<kColVectors>(p, vs, n, M, D, d0, acc);
  for (; d0 < D16; d0 += 16) pv_rows<1>(p, vs, n, M, D, d0, acc);
  for (; d0 < D; ++d0)  // head_dim not a multiple of 16: the last columns one by one
    for (int64_t m = 0; m < M; ++m)
      for (int64_t k = 0; k < n; ++k) acc[m * D + d0] += p[k * M + m] * vs[D16 * n + k * (D - D16) + d0 - D16];
}

// The tile products as prefill_tile calls them: Q^T once per tile, then per key tile S^T from
// the K rows and acc += P V from the V rows (pointers into the pool, one per key).
template <typename T>
struct F32Tiles {
  Scratch& w;
  int64_t M, D;

  void load_q(const T* const* qrow, int64_t rows) {  // Qt [D][M] float; padded rows zero
    std::fill(w.qt.begin(), w.qt.begin() + D * M, 0.f);
    for (int64_t m = 0; m < rows; ++m)
      for (int64_t d = 0; d < D; ++d) w.qt[d * M + m] = to_f32(qrow[m][d]);
  }
  void scores(const T* const* krow, int64_t nk, float* s) {
    widen_rows(krow, nk, D, w.kf.data());
    scores_tile(w.kf.data(), nk, w.qt.data(), M, D, s);
  }
  void pv(const float* p, const T* const* vrow, int64_t nk, float* acc) {
    widen_slices(vrow, nk, D, w.vf.data());
    pv_tile(p, w.vf.data(), nk, M, D, acc);
  }
};

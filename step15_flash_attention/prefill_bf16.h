// A prefill tile's two products with AVX512-BF16 dot products, for bf16 q and pool: the same
// tile shapes as prefill_f32.h, but `vdpbf16ps` multiplies 32 pairs of bf16 and adds them in
// pairs into 16 float32 lanes, where an FMA does 16 products. Where a core runs it at the FMA's
// instruction rate it does twice the arithmetic per cycle (`bench.py kernel` prints both rates;
// flash_cpu.py measures them once to choose). Included by flash_attention.cpp inside its
// namespace (it uses Scratch).
//
// Each 32-bit lane holds a PAIR of bf16 that share an output element:
//   S^T = K Q^T   Q^T stored as [D/2][M] pairs (two consecutive d of one row); each K row
//                 is read straight from the pool, two d at a time broadcast to all 16 rows:
//                 no widening of K, and the rows of the query tile stay in the lanes.
//   acc += P V    P rounded to bf16 and V regrouped as key pairs [keys/2][D] (two consecutive
//                 keys of one column: one shuffle pass over the V tile, in place of widening
//                 it); each row's pair of probabilities is broadcast over 16 columns. The sums
//                 over keys are float32, as on a GPU's FlashAttention, which also rounds P.
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
inline __m512bh broadcast_pair(const uint16_t* p) {  // p[0], p[1] in every 32-bit lane
  int32_t x;
  std::memcpy(&x, p, sizeof x);
  return (__m512bh)_mm512_set1_epi32(x);
}

// S^T[k][m] = sum_d K[k][d] Qt[d][m] for NR keys and MV*16 rows, all in registers.
template <int NR, int MV>
inline void scores_micro_bf16(const uint16_t* const* krow, const uint32_t* qt, int64_t M, int64_t D2, float* s) {
  __m512 acc[NR][MV];
  for (int r = 0; r < NR; ++r)
    for (int v = 0; v < MV; ++v) acc[r][v] = _mm512_setzero_ps();
  for (int64_t j = 0; j < D2; ++j) {
    __m512bh qv[MV];
    for (int v = 0; v < MV; ++v) qv[v] = (__m512bh)_mm512_loadu_si512(qt + j * M + 16 * v);
    for (int r = 0; r < NR; ++r) {
      const __m512bh kd = broadcast_pair(krow[r] + 2 * j);
      for (int v = 0; v < MV; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], qv[v], kd);
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int v = 0; v < MV; ++v) _mm512_storeu_ps(s + r * M + 16 * v, acc[r][v]);
}

template <int MV>
void scores_mv_bf16(const uint16_t* const* krow, int64_t n, const uint32_t* qt, int64_t M, int64_t D2, float* s) {
  int64_t k = 0;
  for (; k + 6 <= n; k += 6) scores_micro_bf16<6, MV>(krow + k, qt, M, D2, s + k * M);
  for (; k + 2 <= n; k += 2) scores_micro_bf16<2, MV>(krow + k, qt, M, D2, s + k * M);
  for (; k < n; ++k) scores_micro_bf16<1, MV>(krow + k, qt, M, D2, s + k * M);
}

void scores_tile_bf16(const uint16_t* const* krow, int64_t n, const uint32_t* qt, int64_t M, int64_t D2, float* s) {
  for (int64_t m0 = 0; m0 < M; m0 += 64) {
    switch (std::min<int64_t>(4, (M - m0) / 16)) {
      case 1: scores_mv_bf16<1>(krow, n, qt + m0, M, D2, s + m0); break;
      case 2: scores_mv_bf16<2>(krow, n, qt + m0, M, D2, s + m0); break;
      case 3: scores_mv_bf16<3>(krow, n, qt + m0, M, D2, s + m0); break;
      default: scores_mv_bf16<4>(krow, n, qt + m0, M, D2, s + m0);
    }
  }
}

// Element i of x and of y side by side: the index lists of vpermw / vpermt2w that interleave.
struct PairIndex {
  alignas(64) uint16_t two_halves[32], low[32], high[32];
  PairIndex() {
    for (int i = 0; i < 16; ++i) {
      two_halves[2 * i] = i, two_halves[2 * i + 1] = 16 + i;  // [x0..x15 | y0..y15] -> x0 y0 x1 y1 ...
      low[2 * i] = i, low[2 * i + 1] = 32 + i;                  // x, y of 32 each: elements 0..15
      high[2 * i] = 16 + i, high[2 * i + 1] = 48 + i;           // and 16..31
    }
  }
};
inline const PairIndex kPairIndex;

// P [nk][M] float -> [ceil(nk/2)][M] pairs of bf16 (keys 2j and 2j+1 of a row; a missing last key is 0).
inline void pair_probs(const float* p, int64_t nk, int64_t M, uint32_t* pp) {
  const __m512i idx = _mm512_load_si512(kPairIndex.two_halves);
  for (int64_t j = 0; 2 * j < nk; ++j)
    for (int64_t m = 0; m < M; m += 16) {
      const __m512 x = _mm512_loadu_ps(p + 2 * j * M + m);
      const __m512 y = 2 * j + 1 < nk ? _mm512_loadu_ps(p + (2 * j + 1) * M + m) : _mm512_setzero_ps();
      const __m512i xy = (__m512i)_mm512_cvtne2ps_pbh(y, x);  // round to nearest even; x low, y high
      _mm512_storeu_si512(pp + j * M + m, _mm512_permutexvar_epi16(idx, xy));
    }
}

// V rows (pool pointers) -> [ceil(nk/2)][D] pairs of bf16 (D a multiple of 16; a missing last key is 0).
inline void pair_rows(const uint16_t* const* vrow, int64_t nk, int64_t D, uint32_t* vp) {
  const __m512i low = _mm512_load_si512(kPairIndex.low), high = _mm512_load_si512(kPairIndex.high);
  for (int64_t j = 0; 2 * j < nk; ++j)
    for (int64_t d = 0; d < D; d += 32) {
      const __mmask32 live = D - d >= 32 ? ~__mmask32(0) : __mmask32(0xFFFF);
      const __m512i x = _mm512_maskz_loadu_epi16(live, vrow[2 * j] + d);
      const __m512i y = 2 * j + 1 < nk ? _mm512_maskz_loadu_epi16(live, vrow[2 * j + 1] + d) : _mm512_setzero_si512();
      _mm512_storeu_si512(vp + j * D + d, _mm512_permutex2var_epi16(x, low, y));
      if (D - d > 16) _mm512_storeu_si512(vp + j * D + d + 16, _mm512_permutex2var_epi16(x, high, y));
    }
}

// acc[m][d] += sum_j P2[j][m] . V2[j][d] for 4 rows x DV*16 columns, kept in registers over the key pairs.
template <int DV>
inline void pv_micro_bf16(const uint32_t* pp, const uint32_t* vp, int64_t n2, int64_t M, int64_t D, float* acc) {
  __m512 c[4][DV];
  for (int r = 0; r < 4; ++r)
    for (int v = 0; v < DV; ++v) c[r][v] = _mm512_loadu_ps(acc + r * D + 16 * v);
  for (int64_t j = 0; j < n2; ++j) {
    __m512bh vv[DV];
    for (int v = 0; v < DV; ++v) vv[v] = (__m512bh)_mm512_loadu_si512(vp + j * D + 16 * v);
    for (int r = 0; r < 4; ++r) {
      const __m512bh pj = (__m512bh)_mm512_set1_epi32(int32_t(pp[j * M + r]));
      for (int v = 0; v < DV; ++v) c[r][v] = _mm512_dpbf16_ps(c[r][v], pj, vv[v]);
    }
  }
  for (int r = 0; r < 4; ++r)
    for (int v = 0; v < DV; ++v) _mm512_storeu_ps(acc + r * D + 16 * v, c[r][v]);
}

void pv_tile_bf16(const uint32_t* pp, const uint32_t* vp, int64_t n2, int64_t M, int64_t D, float* acc) {
  int64_t d0 = 0;  // columns outer, as in pv_tile: a 64-column slice of the V pairs stays in L1
  for (; d0 + 64 <= D; d0 += 64)
    for (int64_t m0 = 0; m0 < M; m0 += 4) pv_micro_bf16<4>(pp + m0, vp + d0, n2, M, D, acc + m0 * D + d0);
  for (; d0 < D; d0 += 16)
    for (int64_t m0 = 0; m0 < M; m0 += 4) pv_micro_bf16<1>(pp + m0, vp + d0, n2, M, D, acc + m0 * D + d0);
}

// The tile products as prefill_tile calls them (see F32Tiles); D must be a multiple of 16.
// kBf16PV false: P V stays in float32 FMAs on widened V (prefill_f32.h), only S^T uses pairs.
template <bool kBf16PV>
struct Bf16Tiles {
  Scratch& w;
  int64_t M, D;

  uint32_t* qt() { return w.pairs.data(); }                        // [D/2][M]
  uint32_t* vpairs() { return qt() + D / 2 * kMaxRows; }             // [key_tile/2 + 1][D]
  uint32_t* ppairs() { return vpairs() + (w.key_tile / 2 + 1) * D; }  // [key_tile/2 + 1][M]

  void load_q(const uint16_t* const* qrow, int64_t rows) {
    const size_t need = size_t(D / 2 * kMaxRows + (w.key_tile / 2 + 1) * (D + kMaxRows));
    if (w.pairs.size() < need) w.pairs.resize(need);
    std::fill(qt(), qt() + D / 2 * M, 0u);
    for (int64_t m = 0; m < rows; ++m)
      for (int64_t j = 0; j < D / 2; ++j) std::memcpy(qt() + j * M + m, qrow[m] + 2 * j, 4);
  }
  void scores(const uint16_t* const* krow, int64_t nk, float* s) { scores_tile_bf16(krow, nk, qt(), M, D / 2, s); }
  void pv(const float* p, const uint16_t* const* vrow, int64_t nk, float* acc) {
    if constexpr (kBf16PV) {
      pair_probs(p, nk, M, ppairs());
      pair_rows(vrow, nk, D, vpairs());
      pv_tile_bf16(ppairs(), vpairs(), (nk + 1) / 2, M, D, acc);
    } else {
      widen_slices(vrow, nk, D, w.vf.data());
      pv_tile(p, w.vf.data(), nk, M, D, acc);
    }
  }
};
#endif

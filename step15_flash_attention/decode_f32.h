// A decode item (a sequence's single query row, for the `group` query heads of one KV head)
// in float32 with AVX2 + FMA: the fused loop of decode_bf16.h for CPUs and runs without bf16
// arithmetic (an AVX2-only CPU, baseline mode, --dtype float32). Included by
// flash_attention.cpp inside its namespace (it uses fast_exp and prefetch_l2).
//
// A float32 decode reads 1 KB of K and V per key at D = 128 and does 4 flops per byte, so it
// should run at the memory's rate. The generic loops of decode_item do not: they load each K
// row once per head, reduce every dot product across its lanes on its own, and load and store
// the accumulator for every key and head. Here the keys go by in chunks of 16:
//
//   scores  R keys x G heads at a time, each K row loaded once for all heads; the R x G sums
//           reduced across lanes together (hadd trees, one per R keys)
//   softmax 16 keys per head in two registers: max, exp, sum as vector ops
//   P V     the G x D accumulator lives in L1 (16 ymm registers cannot hold G x 128 floats);
//           it is walked in column slices that do stay in registers while the chunk's keys go
//           by, so each slice is loaded and stored once per 16 keys and each V element is
//           read once
//
// An item here is a sequence's query row for several KV heads (decode_f32_heads): block by
// block and, within a block, head after head, so that the pool (head-major blocks) is read in
// runs of nh x 8 KB of K and of V rather than 8 KB pieces scattered over it. The block after
// next is asked for into L2 at the pace its keys are used: a few lines of K and of V with each
// slice of the current keys' scores, so that the requests in flight stay few and steady.
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#include <omp.h>

inline float hmax8(__m256 v) {
  __m128 x = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_max_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_max_ss(x, _mm_movehdup_ps(x)));
}

inline float hsum8(__m256 v) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_add_ss(x, _mm_movehdup_ps(x)));
}

// The 8-lane exp of fast_exp: clamp, 2^n split, degree-6 polynomial, exponent add.
inline __m256 fast_exp8(__m256 x) {
  const __m256 t = _mm256_mul_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(1.44269504f));
  const __m256 n = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 r = _mm256_mul_ps(_mm256_sub_ps(t, n), _mm256_set1_ps(0.693147181f));
  __m256 p = _mm256_set1_ps(1.f / 720);
  for (const float c : {1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f}) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
  const __m256i e = _mm256_add_epi32(_mm256_castps_si256(p), _mm256_slli_epi32(_mm256_cvtps_epi32(n), 23));
  const __m256 tiny = _mm256_cmp_ps(x, _mm256_set1_ps(-87.3f), _CMP_LT_OQ);
  return _mm256_andnot_ps(tiny, _mm256_castsi256_ps(e));
}

// Scores of `cnt` (<= 16) keys from kb for G heads: s[g * 16 + t] = scale * q_g . k_t.
template <int G, int NV>
void scores_chunk_f32(const float* qh, const float* kb, int64_t cnt, float scale, float* s, const float* ka,
                      const float* va) {
  constexpr int D = 8 * NV, R = G <= 2 ? 4 : 2;  // R keys at a time: G x R sums in registers
  int64_t t = 0;
  for (; t + R <= cnt; t += R) {
    __m256 acc[G][R];
    for (int g = 0; g < G; ++g)
      for (int r = 0; r < R; ++r) acc[g][r] = _mm256_setzero_ps();
    for (int i = 0; i < NV; ++i) {
      if (ka) {  // as many bytes of the keys ahead asked for as this step of i loads: R x 32 of K, of V
        const char *pk = reinterpret_cast<const char*>(ka + t * D) + i * R * 32,
                   *pv = reinterpret_cast<const char*>(va + t * D) + i * R * 32;
        for (int x = 0; x < R * 32; x += 64) __builtin_prefetch(pk + x, 0, 1), __builtin_prefetch(pv + x, 0, 1);
      }
      __m256 k[R];
      for (int r = 0; r < R; ++r) k[r] = _mm256_loadu_ps(kb + (t + r) * D + i * 8);
      for (int g = 0; g < G; ++g) {
        const __m256 q = _mm256_loadu_ps(qh + g * D + i * 8);
        for (int r = 0; r < R; ++r) acc[g][r] = _mm256_fmadd_ps(q, k[r], acc[g][r]);
      }
    }
    for (int g = 0; g < G; ++g) {
      if constexpr (R == 4) {  // four keys' sums at once: [k0 k1 k2 k3] in each 128-bit half, halves added
        const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(acc[g][0], acc[g][1]), _mm256_hadd_ps(acc[g][2], acc[g][3]));
        const __m128 sum = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
        _mm_storeu_ps(s + g * 16 + t, _mm_mul_ps(sum, _mm_set1_ps(scale)));
      } else {
        for (int r = 0; r < R; ++r) s[g * 16 + t + r] = hsum8(acc[g][r]) * scale;
      }
    }
  }
  for (; t < cnt; ++t)
    for (int g = 0; g < G; ++g) {
      __m256 a = _mm256_setzero_ps();
      for (int i = 0; i < NV; ++i) a = _mm256_fmadd_ps(_mm256_loadu_ps(qh + g * D + i * 8), _mm256_loadu_ps(kb + t * D + i * 8), a);
      s[g * 16 + t] = hsum8(a) * scale;
    }
}

// acc[g][D] += sum over the chunk's keys t of p[g][t] * v_t, a column slice of C ymm at a time.
template <int G, int NV>
void pv_chunk_f32(const float* p, const float* vb, int64_t cnt, float* acc) {
  constexpr int D = 8 * NV, C = G <= 2 ? 4 : 2;  // G x C accumulators in registers
  static_assert(NV % C == 0, "D / 8 must be a multiple of the slice width");
  for (int i0 = 0; i0 < NV; i0 += C) {
    __m256 a[G][C];
    for (int g = 0; g < G; ++g)
      for (int c = 0; c < C; ++c) a[g][c] = _mm256_loadu_ps(acc + g * D + (i0 + c) * 8);
    for (int64_t t = 0; t < cnt; ++t) {
      __m256 v[C];
      for (int c = 0; c < C; ++c) v[c] = _mm256_loadu_ps(vb + t * D + (i0 + c) * 8);
      for (int g = 0; g < G; ++g) {
        const __m256 pg = _mm256_broadcast_ss(p + g * 16 + t);
        for (int c = 0; c < C; ++c) a[g][c] = _mm256_fmadd_ps(pg, v[c], a[g][c]);
      }
    }
    for (int g = 0; g < G; ++g)
      for (int c = 0; c < C; ++c) _mm256_storeu_ps(acc + g * D + (i0 + c) * 8, a[g][c]);
  }
}

// One chunk of <= 16 keys of one KV head: scores, each of the G heads' online softmax step
// (m, l: running max and sum), then P V into acc[G][D]. s: scratch for G x 16 floats.
template <int G, int NV>
inline void chunk_f32(const float* qh, const float* kb, const float* vb, int64_t cnt, float scale, const float* ka,
                      const float* va, float* m, float* l, float* acc, float* s) {
  constexpr int D = 8 * NV;
  constexpr int64_t kChunk = 16;
  scores_chunk_f32<G, NV>(qh, kb, cnt, scale, s, ka, va);
  const __m256 live_lo = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(int32_t(cnt)),
                                                                _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
  const __m256 live_hi = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(int32_t(cnt)),
                                                                _mm256_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15)));
  const __m256 ninf = _mm256_set1_ps(-INFINITY);
  for (int g = 0; g < G; ++g) {  // lanes past the chunk's end hold -inf: they weigh 0
    const __m256 s0 = _mm256_blendv_ps(ninf, _mm256_load_ps(s + g * kChunk), live_lo);
    const __m256 s1 = _mm256_blendv_ps(ninf, _mm256_load_ps(s + g * kChunk + 8), live_hi);
    const float mx = std::max(m[g], hmax8(_mm256_max_ps(s0, s1)));
    const __m256 mv = _mm256_set1_ps(mx);
    const __m256 p0 = fast_exp8(_mm256_sub_ps(s0, mv)), p1 = fast_exp8(_mm256_sub_ps(s1, mv));
    _mm256_store_ps(s + g * kChunk, p0), _mm256_store_ps(s + g * kChunk + 8, p1);
    const float alpha = fast_exp(m[g] - mx);
    l[g] = alpha * l[g] + hsum8(_mm256_add_ps(p0, p1));
    m[g] = mx;
    if (alpha != 1.f) {
      const __m256 av = _mm256_set1_ps(alpha);
      for (int i = 0; i < NV; ++i) _mm256_storeu_ps(acc + g * D + i * 8, _mm256_mul_ps(_mm256_loadu_ps(acc + g * D + i * 8), av));
    }
  }
  pv_chunk_f32<G, NV>(s, vb, cnt, acc);
}

// KV heads h0 .. h0 + nh - 1 of one sequence (q: its query row at head h0). acc_out[nh][G][D]
// = their unnormalised outputs, l_out[nh][G] their softmax sums.
template <int G, int NV>
void decode_heads_fused_f32(const float* q, const float* kp, const float* vp, const int64_t* table, int64_t len,
                            int64_t bs, int64_t hkv, int64_t h0, int64_t nh, float scale, float* acc, float* l_out) {
  constexpr int D = 8 * NV;
  constexpr int64_t kChunk = 16;
  std::fill(acc, acc + nh * G * D, 0.f);
  float m[kMaxRows];  // nh * G <= kMaxRows (decode_f32_heads)
  for (int64_t i = 0; i < nh * G; ++i) m[i] = -INFINITY, l_out[i] = 0.f;
  alignas(32) float s[G * kChunk];
  for (int64_t start = 0, j = 0; start < len; start += bs, ++j) {
    const int64_t in_block = std::min(bs, len - start), block = (table[j] * hkv + h0) * bs * D;
    const int64_t ahead = start + 2 * bs < len ? (table[j + 2] * hkv + h0) * bs * D : -1;  // the block after next
    if (j == 0 && start + bs < len) {  // block 1 whole at the start
      const int64_t next = (table[1] * hkv + h0) * bs * D;
      prefetch_l2(kp + next, nh * bs * D), prefetch_l2(vp + next, nh * bs * D);
    }
    for (int64_t h = 0; h < nh; ++h) {
      const int64_t piece = block + h * bs * D, far = ahead >= 0 ? ahead + h * bs * D : -1;
      for (int64_t c = 0; c < in_block; c += kChunk)
        chunk_f32<G, NV>(q + h * G * D, kp + piece + c * D, vp + piece + c * D, std::min(kChunk, in_block - c), scale,
                         far >= 0 ? kp + far + c * D : nullptr, far >= 0 ? vp + far + c * D : nullptr, m + h * G,
                         l_out + h * G, acc + h * G * D, s);
    }
  }
}

using FusedDecodeF32Fn = void (*)(const float*, const float*, const float*, const int64_t*, int64_t, int64_t, int64_t,
                                  int64_t, int64_t, float, float*, float*);

template <int NV>
FusedDecodeF32Fn fused_f32_for_group(int64_t group) {
  switch (group) {
    case 1: return decode_heads_fused_f32<1, NV>;
    case 2: return decode_heads_fused_f32<2, NV>;
    case 3: return decode_heads_fused_f32<3, NV>;
    case 4: return decode_heads_fused_f32<4, NV>;
    default: return nullptr;  // above 4: the generic loops
  }
}

inline FusedDecodeF32Fn fused_decode_f32_fn(int64_t group, int64_t D) {  // nullptr: the generic loops
  if (D == 128) return fused_f32_for_group<16>(group);
  if (D == 64) return fused_f32_for_group<8>(group);
  return nullptr;
}

// KV heads in one float32 decode item of a step of B sequences: as many as still leave each
// thread about four items (a sequence alone is split over the threads); 1 where the fused
// item does not run.
inline int64_t decode_f32_heads(int64_t hkv, int64_t group, int64_t D, int64_t B) {
  if (!fused_decode_f32_fn(group, D) || hkv * group > kMaxRows) return 1;
  return std::clamp<int64_t>(hkv * B / (4 * int64_t(omp_get_max_threads())), 1, hkv);
}
#else
inline int64_t decode_f32_heads(int64_t, int64_t, int64_t, int64_t) { return 1; }
#endif

// A decode item (a sequence's single query row, for the `group` query heads of one KV head)
// in bf16 with AVX512-BF16: first its two per-block loops, then the fused item built on them,
// with everything that lives across blocks kept in registers. Included by flash_attention.cpp
// inside its namespace (it uses fast_exp, prefetch and prefetch_l2).
//
// Why a fused loop: a decode step reads every sequence's K and V once, 4 KB pieces scattered
// over the pool, with little arithmetic per byte (2 heads x 128 dims per key). The per-block
// loops (with flash_attention.cpp's online_rescale between them) spend, around each 16-key block, a pass of scalar softmax over
// the scores, a rescale of the accumulator in memory, and a load, shuffle and store of the
// accumulator to split it into even and odd dimensions. Here the keys go by in chunks of 16:
//
//   scores  16 keys x G heads, scores_block_bf16 (K rows loaded once for all heads)
//   softmax one 16-lane register per head: max, exp, sum as vector ops (lanes past the block's
//           end hold -inf, so they weigh 0)
//   rescale the G x D accumulator, held in registers (even and odd dimensions apart), by
//           alpha = exp(old max - new max)
//   P V     each V row widened once for all heads, added into the same registers
//
// and the accumulator leaves the registers once, at the end of the item.

// ---------------------------------------------------------------------------------------
// A decode's two per-block loops for bf16 with AVX512-BF16, for G heads of D = 32 * NV2:
// each K row is loaded once for all G heads (the q rows sit in registers), and in P V the
// G x D accumulators stay in registers over the block's keys while each V row is widened
// once for all heads. decode_item's generic loops load K and widen V once per head, and load
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

// fast_exp on 16 lanes: the same steps (clamp, 2^n split, degree-6 polynomial, exponent add).
inline __m512 fast_exp16(__m512 x) {
  const __m512 t = _mm512_mul_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.3f)), _mm512_set1_ps(1.44269504f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_mul_ps(_mm512_sub_ps(t, n), _mm512_set1_ps(0.693147181f));
  __m512 p = _mm512_set1_ps(1.f / 720);
  for (const float c : {1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f}) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
  const __m512i e = _mm512_add_epi32(_mm512_castps_si512(p), _mm512_slli_epi32(_mm512_cvtps_epi32(n), 23));
  const __mmask16 tiny = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.3f), _CMP_LT_OQ);
  return _mm512_mask_blend_ps(tiny, _mm512_castsi512_ps(e), _mm512_setzero_ps());
}

// acc_out[G][D] = the item's unnormalised output, l_out[G] its softmax sums.
template <int G, int NV2>
void decode_item_fused_bf16(const uint16_t* qh, const uint16_t* kp, const uint16_t* vp, const int64_t* table,
                            int64_t len, int64_t bs, int64_t hkv, int64_t h, float scale, float* acc_out,
                            float* l_out) {
  constexpr int D = 32 * NV2;
  constexpr int64_t kChunk = 16;
  const __m512i high_half = _mm512_set1_epi32(int32_t(0xFFFF0000u));
  __m512 re[G][NV2], ro[G][NV2];  // even and odd dimensions of each head's accumulator
  for (int g = 0; g < G; ++g)
    for (int i = 0; i < NV2; ++i) re[g][i] = ro[g][i] = _mm512_setzero_ps();
  float m[G], l[G];
  for (int g = 0; g < G; ++g) m[g] = -INFINITY, l[g] = 0.f;
  alignas(64) float s[G * kChunk];
  for (int64_t start = 0, j = 0; start < len; start += bs, ++j) {
    const int64_t in_block = std::min(bs, len - start), piece = (table[j] * hkv + h) * bs * D;
    const int64_t next = start + bs < len ? (table[j + 1] * hkv + h) * bs * D : -1;
    const uint16_t *kb = kp + piece, *vb = vp + piece;
    // Prefetch two blocks ahead, one K row and one V row per key as the keys go by, so the
    // requests leave at the pace the keys are used (all of a block's 128 lines asked for at
    // once fill the core's miss queue and stall it); block 1 is asked for whole at the start.
    const int64_t ahead = start + 2 * bs < len ? (table[j + 2] * hkv + h) * bs * D : -1;
    if (j == 0 && next >= 0) prefetch_l2(kp + next, bs * D), prefetch_l2(vp + next, bs * D);
    for (int64_t c = 0; c < in_block; c += kChunk) {
      const int64_t cnt = std::min(kChunk, in_block - c);
      const bool last = c + kChunk >= in_block;  // the next keys are in the next block, or none
      const uint16_t* k_next = last ? (next >= 0 ? kp + next : nullptr) : kb + (c + kChunk) * D;
      const uint16_t* v_next = last ? (next >= 0 ? vp + next : nullptr) : vb + (c + kChunk) * D;
      scores_block_bf16<G, NV2>(qh, kb + c * D, vb + c * D, k_next, v_next, cnt, kChunk, scale, s);
      const __mmask16 live = __mmask16((1u << cnt) - 1);
      for (int g = 0; g < G; ++g) {
        const __m512 sv = _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), live, s + g * kChunk);
        const float mx = std::max(m[g], _mm512_reduce_max_ps(sv));
        const __m512 p = fast_exp16(_mm512_sub_ps(sv, _mm512_set1_ps(mx)));
        _mm512_store_ps(s + g * kChunk, p);
        const float alpha = fast_exp(m[g] - mx);
        l[g] = alpha * l[g] + _mm512_reduce_add_ps(p);
        m[g] = mx;
        if (alpha != 1.f) {
          const __m512 a = _mm512_set1_ps(alpha);
          for (int i = 0; i < NV2; ++i) re[g][i] = _mm512_mul_ps(re[g][i], a), ro[g][i] = _mm512_mul_ps(ro[g][i], a);
        }
      }
      const uint16_t* vc = vb + c * D;
      for (int64_t t = 0; t < cnt; ++t) {
        if (ahead >= 0) prefetch_l2(kp + ahead + (c + t) * D, D), prefetch_l2(vp + ahead + (c + t) * D, D);
        __m512 p[G];
        for (int g = 0; g < G; ++g) p[g] = _mm512_set1_ps(s[g * kChunk + t]);
        for (int i = 0; i < NV2; ++i) {
          const __m512i raw = _mm512_loadu_si512(vc + t * D + i * 32);
          const __m512 ve = _mm512_castsi512_ps(_mm512_slli_epi32(raw, 16));
          const __m512 vo = _mm512_castsi512_ps(_mm512_and_si512(raw, high_half));
          for (int g = 0; g < G; ++g) {
            re[g][i] = _mm512_fmadd_ps(p[g], ve, re[g][i]);
            ro[g][i] = _mm512_fmadd_ps(p[g], vo, ro[g][i]);
          }
        }
      }
    }
  }
  const __m512i lo = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
  const __m512i hi = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
  for (int g = 0; g < G; ++g) {
    l_out[g] = l[g];
    for (int i = 0; i < NV2; ++i) {
      _mm512_storeu_ps(acc_out + g * D + i * 32, _mm512_permutex2var_ps(re[g][i], lo, ro[g][i]));
      _mm512_storeu_ps(acc_out + g * D + i * 32 + 16, _mm512_permutex2var_ps(re[g][i], hi, ro[g][i]));
    }
  }
}

using FusedDecodeFn = void (*)(const uint16_t*, const uint16_t*, const uint16_t*, const int64_t*, int64_t, int64_t,
                               int64_t, int64_t, float, float*, float*);

template <int NV2>
FusedDecodeFn fused_for_group(int64_t group) {
  switch (group) {
    case 1: return decode_item_fused_bf16<1, NV2>;
    case 2: return decode_item_fused_bf16<2, NV2>;
    case 3: return decode_item_fused_bf16<3, NV2>;
    case 4: return decode_item_fused_bf16<4, NV2>;
    default: return nullptr;  // above 4: the per-block loops
  }
}

inline FusedDecodeFn fused_decode_fn(int64_t group, int64_t D) {  // nullptr: the per-block loops
  if (D == 128) return fused_for_group<4>(group);
  if (D == 64) return fused_for_group<2>(group);
  return nullptr;
}
#endif

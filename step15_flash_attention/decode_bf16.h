// One decode item (a sequence's single query row, for the `group` query heads of one KV head)
// in bf16 with AVX512-BF16, with everything that lives across blocks kept in registers.
// Included by flash_attention.cpp inside its namespace, after the per-block loops it reuses
// (scores_block_bf16, reduce_add_4, fast_exp, prefetch_l2).
//
// Why a fused loop: a decode step reads every sequence's K and V once, 4 KB pieces scattered
// over the pool, with little arithmetic per byte (2 heads x 128 dims per key). The per-block
// loops of flash_attention.cpp spend, around each 16-key block, a pass of scalar softmax over
// the scores, a rescale of the accumulator in memory, and a load, shuffle and store of the
// accumulator to split it into even and odd dimensions. Here the keys go by in chunks of 16:
//
//   scores  16 keys x G heads, as before (K rows loaded once for all heads)
//   softmax one 16-lane register per head: max, exp, sum as vector ops (lanes past the block's
//           end hold -inf, so they weigh 0)
//   rescale the G x D accumulator, held in registers (even and odd dimensions apart), by
//           alpha = exp(old max - new max)
//   P V     each V row widened once for all heads, added into the same registers
//
// and the accumulator leaves the registers once, at the end of the item.
#if defined(__AVX512BF16__)
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

// Paged decode attention on the CPU: one new query token per sequence, K/V read in place.
//
// The torch version of this lesson first gathers every sequence's K/V blocks into one dense
// tensor and then multiplies against it, so each K/V byte is read, written and read again.
// This kernel walks each sequence's block table and reads every K/V row exactly once, straight
// out of the pool (vLLM's `paged_attention_v1` does the same on a GPU, one thread block per
// (sequence, head)). Work item = one sequence x one KV head; the `group` query heads that share
// that KV head are handled together, so each K/V row is loaded once for all of them.
//
// Layouts (all contiguous):
//   q, out        [B, num_kv_heads * group, head_dim]        query head h*group + g uses KV head h
//   k/v pool      [num_blocks, num_kv_heads, block_size, head_dim]
//   block_tables  [B, max_blocks] int64, seq_lens [B] int64 (keys 0 .. seq_lens[b]-1 are valid)
//   scores        [B * num_kv_heads, group, max_len] float32 scratch
//
// Softmax is the plain two-pass kind (all scores, then max and sum); the one-pass "online"
// softmax that needs no score buffer is lesson 15's subject.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "bf16.h"  // bf16_widen, bf16_narrow
#include "isa.h"  // kernel_isa(): which path this build runs
#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kMaxGroup = 16;
constexpr int64_t kMaxHeadDim = 256;

inline float to_f32(float x) { return x; }
inline float to_f32(uint16_t x) { return bf16_widen(x); }  // bf16.h

inline void store(float* p, float x) { *p = x; }
inline void store(uint16_t* p, float x) { *p = bf16_narrow(x); }  // nearest even, as torch

// The two inner loops, portable: the compiler vectorises them for any dtype.
template <typename T>
inline float dot_row(const T* q, const T* k, int64_t D) {  // q . k
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t d = 0; d < D; ++d) s += to_f32(q[d]) * to_f32(k[d]);
  return s;
}

template <typename T>
inline void axpy_row(float* acc, float p, const T* v, int64_t D) {  // acc += p * v
#pragma omp simd
  for (int64_t d = 0; d < D; ++d) acc[d] += p * to_f32(v[d]);
}

#if defined(__AVX512BF16__)
// The same two loops for bfloat16 on CPUs with AVX512-BF16: `vdpbf16ps` multiplies 32 bf16
// pairs and adds them into 16 fp32 sums in one instruction, so the keys are never converted.
inline float dot_row(const uint16_t* q, const uint16_t* k, int64_t D) {
  if (D % 32) return dot_row<uint16_t>(q, k, D);
  __m512 acc = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; d += 32)
    acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(q + d), (__m512bh)_mm512_loadu_si512(k + d));
  return _mm512_reduce_add_ps(acc);
}

inline void axpy_row(float* acc, float p, const uint16_t* v, int64_t D) {
  if (D % 16) return axpy_row<uint16_t>(acc, p, v, D);
  const __m512 pv = _mm512_set1_ps(p);
  for (int64_t d = 0; d < D; d += 16) {  // widen 16 bf16 to fp32 (shift into the top half), then FMA
    __m512i x = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(v + d)));
    __m512 vf = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
    _mm512_storeu_ps(acc + d, _mm512_fmadd_ps(pv, vf, _mm512_loadu_ps(acc + d)));
  }
}
#endif

template <typename T>
inline void prefetch(const T* row, int64_t n) {  // start loading n elements into the cache
  for (int64_t i = 0; i < n * int64_t(sizeof(T)); i += 64) __builtin_prefetch(reinterpret_cast<const char*>(row) + i);
}

template <typename T>
void decode(const T* q, const T* k_pool, const T* v_pool, const int64_t* block_tables,
            const int64_t* seq_lens, T* out, float* scores, int64_t B, int64_t max_blocks,
            int64_t num_kv_heads, int64_t group, int64_t block_size, int64_t head_dim,
            int64_t max_len, float scale) {
  const int64_t D = head_dim, bs = block_size;
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t item = 0; item < B * num_kv_heads; ++item) {
    const int64_t b = item / num_kv_heads, h = item % num_kv_heads, len = seq_lens[b];
    const int64_t* table = block_tables + b * max_blocks;
    const T* qh = q + (b * num_kv_heads + h) * group * D;  // this KV head's `group` query heads
    float* s = scores + item * group * max_len;
    // This head's 16 rows of block j: one contiguous 4 KB piece of the pool (bf16, D = 128).
    auto piece = [&](const T* pool, int64_t j) { return pool + (table[j] * num_kv_heads + h) * bs * D; };
    // The blocks of a sequence lie anywhere in the pool, so the hardware prefetcher cannot
    // guess the next one: while working on block j we ask for block j + 1, a row at a time.

    // Pass 1: a score for every key, block by block through the table.
    for (int64_t start = 0, j = 0; start < len; start += bs, ++j) {
      const T *kb = piece(k_pool, j), *next = start + bs < len ? piece(k_pool, j + 1) : nullptr;
      for (int64_t t = 0; t < std::min(bs, len - start); ++t) {
        if (next) prefetch(next + t * D, D);
        for (int64_t g = 0; g < group; ++g) s[g * max_len + start + t] = dot_row(qh + g * D, kb + t * D, D) * scale;
      }
    }
    // Softmax over the scores, per query head (max first, so exp never overflows).
    float inv_sum[kMaxGroup];
    for (int64_t g = 0; g < group; ++g) {
      float* sg = s + g * max_len;
      float m = -INFINITY, sum = 0.f;
      for (int64_t i = 0; i < len; ++i) m = std::max(m, sg[i]);
#pragma omp simd
      for (int64_t i = 0; i < len; ++i) sg[i] = std::exp(sg[i] - m);
#pragma omp simd reduction(+ : sum)
      for (int64_t i = 0; i < len; ++i) sum += sg[i];
      inv_sum[g] = 1.f / sum;
    }
    // Pass 2: the probability-weighted sum of the values, again straight from the pool.
    float acc[kMaxGroup * kMaxHeadDim];
    std::fill(acc, acc + group * D, 0.f);
    for (int64_t start = 0, j = 0; start < len; start += bs, ++j) {
      const T *vb = piece(v_pool, j), *next = start + bs < len ? piece(v_pool, j + 1) : nullptr;
      for (int64_t t = 0; t < std::min(bs, len - start); ++t) {
        if (next) prefetch(next + t * D, D);
        for (int64_t g = 0; g < group; ++g) axpy_row(acc + g * D, s[g * max_len + start + t], vb + t * D, D);
      }
    }
    for (int64_t g = 0; g < group; ++g)
      for (int64_t d = 0; d < D; ++d) store(&out[(b * num_kv_heads * group + h * group + g) * D + d], acc[g * D + d] * inv_sum[g]);
  }
}

}  // namespace

extern "C" {

int64_t paged_decode_max_group() { return kMaxGroup; }
int64_t paged_decode_max_head_dim() { return kMaxHeadDim; }

void paged_decode_bf16(const uint16_t* q, const uint16_t* k, const uint16_t* v, const int64_t* tables,
                       const int64_t* lens, uint16_t* out, float* scores, int64_t B, int64_t max_blocks,
                       int64_t hkv, int64_t group, int64_t bs, int64_t D, int64_t max_len, float scale) {
  decode(q, k, v, tables, lens, out, scores, B, max_blocks, hkv, group, bs, D, max_len, scale);
}

void paged_decode_f32(const float* q, const float* k, const float* v, const int64_t* tables,
                      const int64_t* lens, float* out, float* scores, int64_t B, int64_t max_blocks,
                      int64_t hkv, int64_t group, int64_t bs, int64_t D, int64_t max_len, float scale) {
  decode(q, k, v, tables, lens, out, scores, B, max_blocks, hkv, group, bs, D, max_len, scale);
}

}  // extern "C"

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
// A prefill tile's products are small matrix multiplies, 16 lanes wide:
//   S^T = K Q^T   computed transposed, [keys, rows]: the rows of the query tile sit in the 16
//                 lanes of a register, each key element is broadcast to all of them, so K is
//                 used as the pool stores it and the softmax's max and sum over keys are
//                 lane-wise max/add, with no horizontal reductions;
//   acc += P V    6 rows x 32 columns (AVX-512; 16 on AVX2) of the accumulator stay in registers.
// Two implementations: float32 FMAs on widened tiles (prefill_f32.h, any CPU, either dtype)
// and bf16 dot products on pairs (prefill_bf16.h, bf16 with AVX512-BF16). Which one bf16 tiles
// take is set at run time (flash_set_prefill_tiles): flash_cpu.py measures which instruction
// does more arithmetic per second on this core.
#include <atomic>
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

struct Item {
  int64_t b, h, i0, n;  // n == 0: a decode, of KV heads h .. h + nh - 1
  int64_t nh = 1;
};

struct Args {
  int64_t max_blocks, hkv, group, bs, D, key_tile;
  float scale;
  const int64_t *cu, *lens, *tables;
};

struct Scratch {  // one per thread, reused by every item it runs
  int64_t key_tile;
  std::vector<float> qt, kf, vf, s, acc;
  std::vector<uint32_t> pairs;  // bf16 pairs of the dot-product tiles, sized on first use
  float m[kMaxRows], l[kMaxRows], alpha[kMaxRows];
  int64_t pos[kMaxRows];
  Scratch(int64_t D, int64_t key_tile)  // key_tile >= block_size, so s also holds a decode's [group][block_size]
      : key_tile(key_tile), qt(D * kMaxRows), kf(key_tile * D), vf(key_tile * D), s(kMaxRows * key_tile),
        acc(kMaxRows * D) {}
};

// Which products bf16 prefill tiles use: 0 float32 FMAs, 1 bf16 dot products (scores and
// P V), 2 bf16 dot products for the scores only. Set between calls, read once per call.
std::atomic<int> g_prefill_tiles{0};

#include "prefill_f32.h"   // F32Tiles: float32 FMAs on widened tiles
#include "prefill_bf16.h"  // Bf16Tiles: bf16 dot products on pairs (AVX512-BF16)

// ---------------------------------------------------------------------------------------
// One prefill tile: queries i0 .. i0+n-1 of sequence b (positions first_pos + ...), KV head h;
// `Tiles` does its two products (F32Tiles or Bf16Tiles), the online softmax is shared.
template <typename Tiles, typename T>
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
  // Row m of the tile = (query i0 + m / group, head h*group + m % group).
  const int64_t Hq = a.hkv * group;
  const T* qrow[kMaxRows];
  for (int64_t m = 0; m < rows; ++m) qrow[m] = q + ((i0 + m / group) * Hq + h * group + m % group) * D;
  Tiles tiles{w, M, D};
  tiles.load_q(qrow, rows);
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
    tiles.scores(krow, nk, s);
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
    tiles.pv(s, vrow, nk, w.acc.data());
  }
  for (int64_t m = 0; m < rows; ++m) {
    T* o = out + ((i0 + m / group) * Hq + h * group + m % group) * D;
    const float inv = 1.f / w.l[m];
    for (int64_t d = 0; d < D; ++d) store(&o[d], w.acc[m * D + d] * inv);
  }
}

template <typename T>
void prefill_item(const T* q, const T* kp, const T* vp, T* out, const Args& a, const Item& it, int tiles, Scratch& w) {
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
  if constexpr (std::is_same_v<T, uint16_t>) {
    if (tiles == 1) return prefill_tile<Bf16Tiles<true>>(q, kp, vp, out, a, it.b, it.h, it.i0, it.n, w);
    if (tiles == 2) return prefill_tile<Bf16Tiles<false>>(q, kp, vp, out, a, it.b, it.h, it.i0, it.n, w);
  }
#endif
  (void)tiles;
  prefill_tile<F32Tiles<T>>(q, kp, vp, out, a, it.b, it.h, it.i0, it.n, w);
}


#include "decode_bf16.h"  // one decode item with its accumulators in registers
#include "decode_f32.h"   // the same for float32 on AVX2 + FMA

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
void decode_item(const T* q, const T* kp, const T* vp, T* out, const Args& a, int64_t b, int64_t h, int64_t nh,
                 Scratch& w) {  // nh > 1 only where the fused float32 item runs (decode_f32_heads)
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
#if defined(__AVX2__) && defined(__FMA__)
  if constexpr (std::is_same_v<T, float>) {
    if (const FusedDecodeF32Fn fused = fused_decode_f32_fn(group, D)) {
      fused(qh, kp, vp, table, len, bs, a.hkv, h, nh, a.scale, acc, w.l);
      for (int64_t g = 0; g < nh * group; ++g)
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

template <typename T>
void flash(const T* q, const T* kp, const T* vp, T* out, const Args& a, int64_t B, int64_t q_tile) {
  // Most expensive first (prefill tiles late in long sequences), so the threads finish together.
  std::vector<std::pair<int64_t, Item>> work;
  const int64_t nh = std::is_same_v<T, float> ? decode_f32_heads(a.hkv, a.group, a.D, B) : 1;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t q0 = a.cu[b], n = a.cu[b + 1] - q0;
    for (int64_t h = 0; h < a.hkv; ++h) {
      if (n == 1) {
        const int64_t k = std::min(nh, a.hkv - h);
        if (h % nh == 0) work.push_back({a.lens[b] * k, Item{b, h, q0, 0, k}});
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
  const int tiles = a.D % 16 == 0 ? g_prefill_tiles.load(std::memory_order_relaxed) : 0;  // pairs need D % 16 == 0
#pragma omp parallel
  {
    Scratch w(a.D, a.key_tile);
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < num; ++i) {
      const Item& it = work[i].second;
      if (it.n == 0)
        decode_item(q, kp, vp, out, a, it.b, it.h, it.nh, w);
      else
        prefill_item(q, kp, vp, out, a, it, tiles, w);
    }
  }
}

}  // namespace

extern "C" {

int64_t flash_max_rows() { return kMaxRows; }

int64_t flash_prefill_bf16_built() {  // 1: this build has the bf16 dot-product tiles
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
  return 1;
#else
  return 0;
#endif
}

void flash_set_prefill_tiles(int64_t mode) { g_prefill_tiles.store(int(mode), std::memory_order_relaxed); }

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

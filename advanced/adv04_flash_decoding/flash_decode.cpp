// Flash-decoding on the CPU: one query per sequence, each sequence's keys cut into splits that
// run in parallel, then merged with log-sum-exp weights.
//
// Lesson 15's decode makes one work item per (sequence, KV head) and walks the whole context in
// it. At batch 1 that is kv_heads items, however long the context: with more threads than
// items, the rest wait. Here an item is (sequence, KV head, split): keys
// [split * split_size, min((split + 1) * split_size, len)), whole blocks, read in place through
// the block table exactly as lesson 15 reads them. Each item leaves, per query head of the group,
//   o   = its normalised output (acc / l)   [D] float32   and   lse = m + log(l)   one float
// and a second loop over (sequence, KV head) merges them (see merge_item). A sequence that
// needs only one split writes its output directly, so with split_size >= every length this is
// lesson 15's decode, item for item.
//
// Both loops run inside one `omp parallel` region on torch's OpenMP threads (lesson 14 explains
// why the kernel shares torch's libgomp); the barrier at the end of the first `omp for` is the
// only synchronisation: every split is finished before any merge reads it.
// lesson 15: fast_exp, online_rescale, decode_block_fns; through it lesson 14's paged_decode.cpp: to_f32, store,
// dot_row, axpy_row, prefetch
#include "flash_attention.cpp"

#include <memory>

namespace {

struct DecodeArgs {
  int64_t max_blocks, hkv, group, bs, D, split;
  float scale;
  const int64_t *lens, *tables;
};

// Keys [k0, k1) of sequence b for KV head h and its `group` query heads `qh` [group][D]:
// lesson 15's decode loop (online softmax block by block, lesson 14's row loops), on a range.
// Writes o [group][D] (normalised, as O: the final bf16/float output or a float32 partial)
// and, if lse is given, lse [group].
template <typename T, typename O>
void attend_range(const T* qh, const T* kp, const T* vp, const int64_t* table, const DecodeArgs& a, int64_t h,
                  int64_t k0, int64_t k1, O* o, float* lse, float* acc, float* s) {
  const int64_t D = a.D, bs = a.bs, group = a.group;
  float m[kMaxGroup], l[kMaxGroup];
  std::fill(acc, acc + group * D, 0.f);
  for (int64_t g = 0; g < group; ++g) m[g] = -INFINITY, l[g] = 0.f;
  // bf16 with AVX512-BF16: lesson 15's per-block loops (K loaded and V widened once for the
  // whole group, accumulators in registers); the generic row loops otherwise.
  bool fast = false;
#if defined(__AVX512BF16__)
  DecodeBlockFns fns{nullptr, nullptr};
  if constexpr (std::is_same_v<T, uint16_t>) fns = decode_block_fns(group, D), fast = fns.scores != nullptr;
#endif
  for (int64_t start = k0; start < k1; start += bs) {  // k0 is a multiple of bs: whole blocks
    const int64_t j = start / bs, cnt = std::min(bs, k1 - start), piece = (table[j] * a.hkv + h) * bs * D;
    const int64_t next = start + bs < k1 ? (table[j + 1] * a.hkv + h) * bs * D : -1;
    const T *kb = kp + piece, *vb = vp + piece;
#if defined(__AVX512BF16__)
    if constexpr (std::is_same_v<T, uint16_t>)
      if (fast) fns.scores(qh, kb, vb, next >= 0 ? kp + next : nullptr, next >= 0 ? vp + next : nullptr, cnt, bs, a.scale,
                 s);
#endif
    for (int64_t t = 0; t < cnt && !fast; ++t) {
      if (next >= 0) prefetch(kp + next + t * D, D), prefetch(vp + next + t * D, D);
      for (int64_t g = 0; g < group; ++g) s[g * bs + t] = dot_row(qh + g * D, kb + t * D, D) * a.scale;
    }
    online_rescale(m, l, s, cnt, bs, group, D, acc);  // lesson 15's, on this split's own m, l
#if defined(__AVX512BF16__)
    if constexpr (std::is_same_v<T, uint16_t>)
      if (fast) {
        fns.pv(s, vb, cnt, bs, acc);
        continue;
      }
#endif
    for (int64_t t = 0; t < cnt; ++t)
      for (int64_t g = 0; g < group; ++g) axpy_row(acc + g * D, s[g * bs + t], vb + t * D, D);
  }
  for (int64_t g = 0; g < group; ++g) {
    const float inv = 1.f / l[g];
    for (int64_t d = 0; d < D; ++d) store(&o[g * D + d], acc[g * D + d] * inv);
    if (lse) lse[g] = m[g] + std::log(l[g]);
  }
}

// Merge the n splits of one (sequence, KV head): parts [n][group][D], part_lse [n][group].
//   M = max_s lse_s,  e_s = exp(lse_s - M),  out = sum_s e_s o_s / sum_s e_s,  LSE = M + log sum_s e_s
template <typename T>
void merge_item(const float* parts, const float* part_lse, int64_t n, int64_t group, int64_t D, T* out,
                float* lse, float* acc) {
  for (int64_t g = 0; g < group; ++g) {
    float M = -INFINITY, total = 0.f;
    for (int64_t sp = 0; sp < n; ++sp) M = std::max(M, part_lse[sp * group + g]);
    std::fill(acc, acc + D, 0.f);
    for (int64_t sp = 0; sp < n; ++sp) {
      const float e = std::exp(part_lse[sp * group + g] - M);
      const float* o = parts + (sp * group + g) * D;
      total += e;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) acc[d] += e * o[d];
    }
    const float inv = 1.f / total;
    for (int64_t d = 0; d < D; ++d) store(&out[g * D + d], acc[d] * inv);
    if (lse) lse[g] = M + std::log(total);
  }
}

struct Split {
  int64_t keys, b, h, split;
};

template <typename T>
void flash_decode(const T* q, const T* kp, const T* vp, T* out, float* lse_out, int64_t B, const DecodeArgs& a) {
  const int64_t hkv = a.hkv, group = a.group, D = a.D;
  // Partial results only for sequences with more than one split; `first[b]` is where theirs start
  // (in units of one (KV head, split) slot of group x D floats).
  std::vector<int64_t> nsplit(B), first(B, 0);
  int64_t slots = 0;
  std::vector<Split> work;
  std::vector<std::pair<int64_t, int64_t>> merges;  // (b, h) to merge after the splits
  for (int64_t b = 0; b < B; ++b) {
    nsplit[b] = (a.lens[b] + a.split - 1) / a.split;
    if (nsplit[b] > 1) first[b] = slots, slots += hkv * nsplit[b];
    for (int64_t h = 0; h < hkv; ++h) {
      for (int64_t sp = 0; sp < nsplit[b]; ++sp)
        work.push_back({std::min(a.split, a.lens[b] - sp * a.split), b, h, sp});
      if (nsplit[b] > 1) merges.push_back({b, h});
    }
  }
  // Longest first, so the threads finish together (as lesson 15 orders its items).
  std::stable_sort(work.begin(), work.end(), [](const Split& x, const Split& y) { return x.keys > y.keys; });
  std::unique_ptr<float[]> parts(new float[std::max<int64_t>(1, slots * group * D)]);
  std::unique_ptr<float[]> part_lse(new float[std::max<int64_t>(1, slots * group)]);
  const int64_t num = int64_t(work.size()), num_merges = int64_t(merges.size());
#pragma omp parallel
  {
    std::vector<float> acc(group * D), s(group * a.bs);  // per thread, reused by every item
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < num; ++i) {
      const Split& w = work[i];
      const T* qh = q + (w.b * hkv + w.h) * group * D;  // decode: query row b, this KV head's heads
      const int64_t* table = a.tables + w.b * a.max_blocks;
      const int64_t k0 = w.split * a.split, k1 = k0 + w.keys;
      if (nsplit[w.b] == 1) {
        attend_range(qh, kp, vp, table, a, w.h, k0, k1, out + (w.b * hkv + w.h) * group * D,
                     lse_out ? lse_out + (w.b * hkv + w.h) * group : nullptr, acc.data(), s.data());
      } else {
        const int64_t slot = first[w.b] + w.h * nsplit[w.b] + w.split;
        attend_range(qh, kp, vp, table, a, w.h, k0, k1, parts.get() + slot * group * D,
                     part_lse.get() + slot * group, acc.data(), s.data());
      }
    }  // implicit barrier: every split is written before any merge starts
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < num_merges; ++i) {
      const int64_t b = merges[i].first, h = merges[i].second, slot = first[b] + h * nsplit[b];
      merge_item(parts.get() + slot * group * D, part_lse.get() + slot * group, nsplit[b], group, D,
                 out + (b * hkv + h) * group * D, lse_out ? lse_out + (b * hkv + h) * group : nullptr, acc.data());
    }
  }
}

}  // namespace

extern "C" {

void flash_decode_bf16(const uint16_t* q, const uint16_t* k, const uint16_t* v, const int64_t* lens,
                       const int64_t* tables, uint16_t* out, float* lse, int64_t B, int64_t max_blocks, int64_t hkv,
                       int64_t group, int64_t bs, int64_t D, float scale, int64_t split) {
  flash_decode(q, k, v, out, lse, B, DecodeArgs{max_blocks, hkv, group, bs, D, split, scale, lens, tables});
}

void flash_decode_f32(const float* q, const float* k, const float* v, const int64_t* lens, const int64_t* tables,
                      float* out, float* lse, int64_t B, int64_t max_blocks, int64_t hkv, int64_t group, int64_t bs,
                      int64_t D, float scale, int64_t split) {
  flash_decode(q, k, v, out, lse, B, DecodeArgs{max_blocks, hkv, group, bs, D, split, scale, lens, tables});
}

}  // extern "C"

// Prompt-chunk attention on AMX tiles (Intel Sapphire Rapids and later), bf16.
//
// Lesson 15's kernel multiplies with float32 FMAs, 16 lanes at a time. An AMX core has eight
// tile registers of 16 rows x 64 bytes and one instruction, TDPBF16PS, that multiplies a
// 16 x 32 bf16 tile by a 32 x 16 one into a 16 x 16 float32 tile: 8,192 multiply-adds, where
// an FMA does 16. Decodes (one query row per head) cannot fill a tile and stay with lesson
// 15's kernel; prompt chunks have the rows.
//
// One call does every prompt chunk of the step (sequences with more than one query row):
//
//   1. pack   per (sequence, KV head), keys 0..L-1 are read from the paged pool once and
//             laid out the way the tile unit reads its right-hand operand ("VNNI": the two
//             bf16 of a 32-bit pair are neighbours along the reduced dimension):
//               K^T  tile (16 keys, 32 dims):  row r = key 0 dims 2r,2r+1 | key 1 ... | key 15
//               V    tile (32 keys, 16 dims):  row r = keys 2r,2r+1 of dim 0 | dim 1 | ... 15
//             Keys past L, up to the 32-key tile, are zeros (and masked).
//   2. tiles  work item = (sequence, KV head, 32/group queries): M = 32 rows (query, head),
//             keys in tiles of 32 up to the item's last position (causal), online softmax:
//               S[32 x 32]  = Q K^T       4 accumulator tiles, D/32 steps of 2 A + 2 B tiles
//               softmax     on S in AVX-512 (base 2): scale, causal mask, running max/sum, P in bf16
//               O[32 x D]  += P V         per 16 dims: 2 accumulators loaded from O, 1 B tile
//   3. out    O / sum, rounded to bf16, into the rows of the chunk.
//
// Built with -march=native: on a CPU without AMX the tile code is compiled out and
// amx_prefill_available() returns 0 (the caller then uses torch's SDPA).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <vector>

#include "bf16.h"  // bf16_widen (lesson 14's folder, on the include path)
#include "isa.h"  // kernel_isa() (lesson 14's folder, on the include path)

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define HAVE_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#else
#define HAVE_AMX 0
#endif

typedef uint16_t bf16;   // raw bits

#if HAVE_AMX
namespace {

constexpr int64_t kRows = 32;   // rows of a work item: queries x heads of one KV head
constexpr int64_t kKeys = 64;   // keys per key tile

struct TileConfig {              // the 64-byte layout LDTILECFG reads (palette 1)
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

void configure_tiles() {         // all 8 tiles: 16 rows x 64 bytes
  TileConfig c;
  for (int i = 0; i < 8; ++i) { c.colsb[i] = 64; c.rows[i] = 16; }
  _tile_loadconfig(&c);
}

// 2^z for 16 lanes: 2^n * 2^r with n = round(z), |r| <= 1/2, 2^r by its Taylor series in
// r ln 2 to degree 5 (relative error below 3e-6: P is rounded to bf16 anyway). The softmax works
// in base 2 (scores times scale * log2 e), which saves the multiply of an e^x. z = -inf
// (a masked key) gives 0.
inline __m512 exp2_16(__m512 z) {
  const __m512 lo = _mm512_set1_ps(-126.0f);
  const __m512 zc = _mm512_max_ps(z, lo);
  const __m512 n = _mm512_roundscale_ps(zc, _MM_FROUND_TO_NEAREST_INT);
  const __m512 r = _mm512_sub_ps(zc, n);
  __m512 p = _mm512_set1_ps(1.3333558e-3f);                       // ln2^5 / 120
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(9.6181291e-3f));        // ln2^4 / 24
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.5504109e-2f));        // ln2^3 / 6
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(2.4022651e-1f));        // ln2^2 / 2
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(6.9314718e-1f));        // ln2
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_maskz_scalef_ps(_mm512_cmp_ps_mask(z, lo, _CMP_GE_OQ), p, n);
}

inline void store_bf16x16(bf16* dst, __m512 x) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), (__m256i)_mm512_cvtneps_pbh(x));
}

struct Args {
  const bf16 *q, *kp, *vp;
  const int64_t *cu, *lens, *tables;
  bf16* out;
  int64_t max_blocks, Hkv, group, bs, D;
  float scale;
};

inline int64_t padded(int64_t L) { return (L + kKeys - 1) / kKeys * kKeys; }

// Step 1: keys 0..L-1 of (sequence b, KV head h) into the K^T and V tile layouts above; keys
// L..padded(L)-1 are zeros.
void pack(const Args& a, int64_t b, int64_t h, int64_t L, bf16* kt, bf16* vt) {
  const int64_t D = a.D, P = padded(L);
  const int64_t* table = a.tables + b * a.max_blocks;
  auto key_row = [&](const bf16* pool, int64_t p) { return pool + ((table[p / a.bs] * a.Hkv + h) * a.bs + p % a.bs) * D; };
  alignas(64) bf16 keys[16 * 256];
  const __m512i by_key = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                            _mm512_set1_epi32(int(D / 2)));
  for (int64_t g = 0; g < P / 16; ++g) {
    // K^T: 16 keys copied side by side, then each tile row (one dim pair of all 16 keys) is a
    // gather of one 32-bit pair per key. Tiles (group g, dims 32c..32c+31) are 16 x 16 pairs.
    for (int64_t n = 0; n < 16; ++n) {
      const int64_t p = g * 16 + n;
      if (p < L) std::memcpy(keys + n * D, key_row(a.kp, p), D * sizeof(bf16));
      else std::memset(keys + n * D, 0, D * sizeof(bf16));
    }
    const int* k32 = reinterpret_cast<const int*>(keys);
    int* kg = reinterpret_cast<int*>(kt) + g * (D / 2) * 16;
    for (int64_t j = 0; j < D / 2; ++j)
      _mm512_store_si512(kg + (j / 16) * 256 + (j % 16) * 16, _mm512_i32gather_epi32(by_key, k32 + j, 4));
  }
  const __m256i zero = _mm256_setzero_si256();
  for (int64_t p = 0; p < P; p += 2) {
    // V: keys p and p+1 interleaved, 16 dims at a time: the 64-byte row (p % 32) / 2 of tile
    // (p / 32, dims 16e..16e+15).
    const bf16* v0 = p < L ? key_row(a.vp, p) : nullptr;
    const bf16* v1 = p + 1 < L ? key_row(a.vp, p + 1) : nullptr;
    bf16* dst = vt + (p / 32) * (D / 16) * 512 + ((p % 32) / 2) * 32;
    for (int64_t e = 0; e < D / 16; ++e) {
      const __m256i x0 = v0 ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v0 + 16 * e)) : zero;
      const __m256i x1 = v1 ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v1 + 16 * e)) : zero;
      const __m512i pair = _mm512_or_si512(_mm512_cvtepu16_epi32(x0), _mm512_slli_epi32(_mm512_cvtepu16_epi32(x1), 16));
      _mm512_store_si512(dst + e * 512, pair);
    }
  }
}

// Step 2 and 3 for one work item: queries i0 .. i0+nq-1 of sequence b's chunk, KV head h.
// Tile registers: S = Q K^T in 0-3 (A: Q in 4, 5; B: K^T in 6, 7), 32 keys at a time;
// O += P V with O in 0, 1 (A: P in 4, 5 and 2, 3 for keys 0-31 and 32-63; B: V in 6, 7).
void item(const Args& a, int64_t b, int64_t h, int64_t i0, int64_t nq, const bf16* kt, const bf16* vt) {
  const int64_t D = a.D, G = a.group, s = a.cu[b], n = a.cu[b + 1] - s, L = a.lens[b];
  const int64_t first = L - n;                   // position of the chunk's first query
  const int64_t Hq = a.Hkv * G;
  alignas(64) bf16 qa[kRows * 256];              // Q rows (query, head), D <= 256
  alignas(64) float st[kRows * kKeys];           // scores of one key tile
  alignas(64) bf16 pa[kRows * kKeys];            // probabilities, bf16, the A operand of P V
  alignas(64) float o[kRows * 256];              // output accumulator
  float mx[kRows];                               // running max, base-2 units
  alignas(64) float sum[kRows * 16];             // running sums, 16 lanes each (reduced at the end)
  int64_t pos[kRows];
  const int64_t M = nq * G;
  for (int64_t m = 0; m < kRows; ++m) {
    const int64_t i = m < M ? m / G : nq - 1;    // padded rows repeat the last query
    pos[m] = first + i0 + i;
    const bf16* src = a.q + ((s + i0 + i) * Hq + h * G + (m < M ? m % G : 0)) * D;
    std::memcpy(qa + m * D, src, D * sizeof(bf16));
    mx[m] = -INFINITY;
  }
  std::memset(sum, 0, sizeof(sum));
  std::memset(o, 0, sizeof(float) * kRows * D);
  const int64_t last = first + i0 + nq - 1;
  const int64_t ktiles = last / kKeys + 1;
  const __m512 scale = _mm512_set1_ps(a.scale * 1.44269504f);   // scores to base 2
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  for (int64_t t = 0; t < ktiles; ++t) {
    for (int64_t half = 0; half < 2; ++half) {   // keys 32 * half .. + 31 of the tile
      _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
      const bf16* k0 = kt + (4 * t + 2 * half) * (D / 2) * 32;
      const bf16* k1 = k0 + (D / 2) * 32;
      for (int64_t c = 0; c < D / 32; ++c) {
        _tile_loadd(4, qa + c * 32, D * 2);
        _tile_loadd(5, qa + 16 * D + c * 32, D * 2);
        _tile_loadd(6, k0 + c * 512, 64);
        _tile_loadd(7, k1 + c * 512, 64);
        _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(2, 5, 6); _tile_dpbf16ps(3, 5, 7);
      }
      float* sh = st + 32 * half;
      _tile_stored(0, sh, kKeys * 4); _tile_stored(1, sh + 16, kKeys * 4);
      _tile_stored(2, sh + 16 * kKeys, kKeys * 4); _tile_stored(3, sh + 16 * kKeys + 16, kKeys * 4);
    }
    // Online softmax, one row at a time (64 keys = four 16-lane vectors).
    const bool diagonal = (t + 1) * kKeys - 1 > pos[0];   // some key of the tile is past some query
    for (int64_t m = 0; m < kRows; ++m) {
      __m512 x[4];
      for (int j = 0; j < 4; ++j) {
        x[j] = _mm512_mul_ps(_mm512_load_ps(st + m * kKeys + 16 * j), scale);
        if (diagonal) {
          const __m512i key = _mm512_add_epi32(lane, _mm512_set1_epi32(int(t * kKeys + 16 * j)));
          x[j] = _mm512_mask_blend_ps(_mm512_cmpgt_epi32_mask(key, _mm512_set1_epi32(int(pos[m]))), x[j],
                                      _mm512_set1_ps(-INFINITY));
        }
      }
      const float tile_mx = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_max_ps(x[0], x[1]), _mm512_max_ps(x[2], x[3])));
      const float new_mx = std::max(mx[m], tile_mx);
      const __m512 nm = _mm512_set1_ps(new_mx);
      __m512 p[4];
      for (int j = 0; j < 4; ++j) p[j] = exp2_16(_mm512_sub_ps(x[j], nm));
      __m512 sm = _mm512_load_ps(sum + 16 * m);
      if (new_mx > mx[m]) {                      // a new running max: rescale what came before
        const __m512 al = _mm512_set1_ps(mx[m] == -INFINITY ? 0.f : __builtin_exp2f(mx[m] - new_mx));
        for (int64_t d = 0; d < D; d += 16) _mm512_store_ps(o + m * D + d, _mm512_mul_ps(_mm512_load_ps(o + m * D + d), al));
        sm = _mm512_mul_ps(sm, al);
        mx[m] = new_mx;
      }
      _mm512_store_ps(sum + 16 * m, _mm512_add_ps(sm, _mm512_add_ps(_mm512_add_ps(p[0], p[1]), _mm512_add_ps(p[2], p[3]))));
      _mm512_store_si512(pa + m * kKeys, (__m512i)_mm512_cvtne2ps_pbh(p[1], p[0]));
      _mm512_store_si512(pa + m * kKeys + 32, (__m512i)_mm512_cvtne2ps_pbh(p[3], p[2]));
    }
    _tile_loadd(4, pa, kKeys * 2);
    _tile_loadd(5, pa + 16 * kKeys, kKeys * 2);
    _tile_loadd(2, pa + 32, kKeys * 2);
    _tile_loadd(3, pa + 16 * kKeys + 32, kKeys * 2);
    const bf16* v0 = vt + (2 * t) * (D / 16) * 512;
    const bf16* v1 = v0 + (D / 16) * 512;
    for (int64_t e = 0; e < D / 16; ++e) {
      _tile_loadd(0, o + e * 16, D * 4);
      _tile_loadd(1, o + 16 * D + e * 16, D * 4);
      _tile_loadd(6, v0 + e * 512, 64);
      _tile_loadd(7, v1 + e * 512, 64);
      _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 5, 6);
      _tile_dpbf16ps(0, 2, 7); _tile_dpbf16ps(1, 3, 7);
      _tile_stored(0, o + e * 16, D * 4);
      _tile_stored(1, o + 16 * D + e * 16, D * 4);
    }
  }
  for (int64_t m = 0; m < M; ++m) {
    const __m512 inv = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(_mm512_load_ps(sum + 16 * m)));
    bf16* dst = a.out + ((s + i0 + m / G) * Hq + h * G + m % G) * D;
    for (int64_t d = 0; d < D; d += 16) store_bf16x16(dst + d, _mm512_mul_ps(_mm512_load_ps(o + m * D + d), inv));
  }
}

}  // namespace
#endif

extern "C" {

// 1 when the tile code is compiled in and the kernel let this process use the tiles
// (Linux hands out the 8 KB of tile state per process, on request: arch_prctl).
int64_t amx_prefill_available() {
#if HAVE_AMX
  static const int64_t ok = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
  return ok;
#else
  return 0;
#endif
}

// Attention of every sequence b with more than one query row (cu[b+1] - cu[b] > 1): q, out
// [T, Hkv*group, D] contiguous; pools [num_blocks, Hkv, bs, D]; rows of other sequences untouched.
// Returns 0, or -1 when the packed keys could not be allocated.
int64_t amx_prefill_bf16(const bf16* q, const bf16* kp, const bf16* vp, const int64_t* cu, const int64_t* lens,
                      const int64_t* tables, bf16* out, int64_t B, int64_t max_blocks, int64_t Hkv,
                      int64_t group, int64_t bs, int64_t D, float scale) {
#if HAVE_AMX
  const Args a{q, kp, vp, cu, lens, tables, out, max_blocks, Hkv, group, bs, D, scale};
  const int64_t q_tile = kRows / group;          // queries per item
  struct Chunk { int64_t b, offset; };           // offset: of (b, head 0) in the packed buffers
  std::vector<Chunk> chunks;
  int64_t total = 0;
  for (int64_t b = 0; b < B; ++b) {
    if (cu[b + 1] - cu[b] < 2) continue;
    chunks.push_back({b, total});
    total += Hkv * padded(lens[b]) * D;
  }
  if (chunks.empty()) return 0;
  struct Free { void operator()(bf16* p) const { std::free(p); } };   // 64-byte aligned: whole-line stores
  const std::unique_ptr<bf16[], Free> kbuf(static_cast<bf16*>(std::aligned_alloc(64, total * sizeof(bf16)))),
      vbuf(static_cast<bf16*>(std::aligned_alloc(64, total * sizeof(bf16))));
  if (!kbuf || !vbuf) return -1;                // out of memory: the caller raises
  bf16 *kt = kbuf.get(), *vt = vbuf.get();
  const int64_t nc = chunks.size();
#pragma omp parallel for schedule(dynamic)
  for (int64_t w = 0; w < nc * Hkv; ++w) {
    const Chunk& c = chunks[w / Hkv];
    const int64_t h = w % Hkv, L = lens[c.b], per_head = padded(L) * D;
    pack(a, c.b, h, L, kt + c.offset + h * per_head, vt + c.offset + h * per_head);
  }
  std::vector<int64_t> items;                    // (chunk, head, first query) flattened
  for (int64_t ci = 0; ci < nc; ++ci) {
    const int64_t n = cu[chunks[ci].b + 1] - cu[chunks[ci].b];
    for (int64_t i0 = n - 1 - ((n - 1) % q_tile); i0 >= 0; i0 -= q_tile)   // longest items first
      for (int64_t h = 0; h < Hkv; ++h) { items.push_back(ci); items.push_back(h); items.push_back(i0); }
  }
  const int64_t ni = items.size() / 3;
#pragma omp parallel
  {
    configure_tiles();
#pragma omp for schedule(dynamic)
    for (int64_t w = 0; w < ni; ++w) {
      const Chunk& c = chunks[items[3 * w]];
      const int64_t h = items[3 * w + 1], i0 = items[3 * w + 2];
      const int64_t n = cu[c.b + 1] - cu[c.b], L = lens[c.b];
      const int64_t per_head = padded(L) * D;
      item(a, c.b, h, i0, std::min(q_tile, n - i0), kt + c.offset + h * per_head,
           vt + c.offset + h * per_head);
    }
    _tile_release();
  }
#endif
  return 0;
}

}  // extern "C"

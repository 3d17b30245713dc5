// Every layer of a decode step of one to four sequences, in one C call (bf16, AVX-512 BF16).
//
// At one row a layer's arithmetic is a few hundred microseconds of reading weights; what the
// compiled path adds around it is per-op cost: each layer calls seven ops through PyTorch's
// dispatcher into Python and ctypes, and inductor's wrapper checks every input's size and
// stride. Thirty layers a step, a few microseconds a call: milliseconds a step (lesson 16's
// cpu/run.py measures the step both ways). A CUDA graph removes the same kind of cost on a GPU by recording the kernel
// launches once. Here the "recording" is a plan: every pointer the step touches (each layer's
// weights and K/V pool, the step's metadata buffers, scratch rows), gathered once per bucket in
// Python (decode_step.py); the "replay" is this loop over it. The kernels are the ones the
// compiled path calls (elementwise.cpp's, included below, and lesson 15's attention through a
// function pointer), and values are rounded to bf16 at the points where eager PyTorch rounds.
//
// One layer, rows x [M, H] (M <= 4), in place:
//   a = rms_norm(x)            float32 sum of squares, x * rsqrt(mean + eps) to bf16, times w, to bf16
//   qkv = a @ Wqkv^T           the plan's linear: gemv_bf16 on a plain bf16 weight (linear_bf16
//                              below), or any function of the same signature on a weight format
//                              of its own (advanced lesson 01 plugs in its Q4_1 blocks)
//   q, k = qk_norm_rope(qkv)   elementwise.cpp
//   pool[rows] = k, v          write_kv
//   o = attention(q, pool)     lesson 15's flash_attention_bf16
//   x = x + o @ Wo^T           rounded to bf16
//   x = x + down(silu(gate) * up)(rms_norm(x))
#include "elementwise.cpp"

#if defined(__AVX512F__) && defined(__AVX512BF16__)

// lesson 15's flash_attention_bf16 (flash_attention.cpp), reached through the pointer the plan holds
typedef void (*AttentionFn)(const bf16* q, const bf16* k, const bf16* v, const int64_t* cu, const int64_t* lens,
                            const int64_t* tables, bf16* out, int64_t B, int64_t max_blocks, int64_t hkv,
                            int64_t group, int64_t bs, int64_t D, float scale, int64_t q_tile);

// y [M, N] = x [M, K] @ W^T in bf16, W in the format `fn` reads, behind `w`
typedef void (*LinearFn)(const void* w, const bf16* x, int64_t M, int64_t K, int64_t N, bf16* y);
struct Linear {
  const void* w;
  LinearFn fn;
};

struct LayerWeights {        // one layer's tensors; q_norm/k_norm null where the model has none
  const bf16 *norm1, *q_norm, *k_norm, *norm2;
  Linear qkv, o, gate_up, down;
  bf16 *k_cache, *v_cache;
};

struct DecodePlan {          // mirrors DecodePlan in decode_step.py, field for field
  int64_t layers, M, hidden, nh, nkv, D, inter;
  float eps, qk_eps, scale;
  AttentionFn attention;
  int64_t max_blocks, block_size, q_tile;
  const int64_t *rows, *cu, *lens, *tables;         // the bucket's step buffers (GraphRunner.static)
  const LayerWeights* weights;                      // [layers]
  bf16 *normed, *qkv, *q, *k, *att, *proj, *gate_up, *act;   // scratch rows
};

namespace {

void rms_norm_rows(const bf16* x, const bf16* w, bf16* out, int64_t M, int64_t H, float eps) {
  for (int64_t m = 0; m < M; ++m) {
    const bf16* xr = x + m * H;
    __m512 ss = _mm512_setzero_ps();
    for (int64_t j = 0; j < H; j += 16) {
      const __m512 v = load16(xr + j);
      ss = _mm512_fmadd_ps(v, v, ss);
    }
    const __m512 r = _mm512_set1_ps(1.0f / std::sqrt(_mm512_reduce_add_ps(ss) / float(H) + eps));
    for (int64_t j = 0; j < H; j += 16)
      store16(out + m * H + j, _mm512_mul_ps(load16(w + j), round_bf16(_mm512_mul_ps(load16(xr + j), r))));
  }
}

void add_rows(bf16* x, const bf16* d, int64_t n) {     // x = x + d, rounded to bf16
  for (int64_t j = 0; j < n; j += 16) store16(x + j, _mm512_add_ps(load16(x + j), load16(d + j)));
}

}  // namespace

extern "C" int64_t decode_step_available() { return 1; }

// The plan's linear for a plain bf16 weight [N, K] (lesson 16's OpPackedLinear.dense).
extern "C" void linear_bf16(const void* w, const bf16* x, int64_t M, int64_t K, int64_t N, bf16* y) {
  gemv_bf16(x, M, K, static_cast<const bf16*>(w), N, y);
}

// x [M, hidden]: the step's embedded tokens in, the last layer's output out (before the final
// norm). cos, sin [M, D] float32: the rotary tables at the step's positions.
extern "C" void decode_layers_bf16(const DecodePlan* p, bf16* x, const float* cos, const float* sin) {
  const int64_t M = p->M, H = p->hidden, D = p->D, qkv_row = (p->nh + 2 * p->nkv) * D;
  const int64_t kv_row = p->nkv * D * int64_t(sizeof(bf16)), v_col = (p->nh + p->nkv) * D;
  for (int64_t l = 0; l < p->layers; ++l) {
    const LayerWeights& w = p->weights[l];
    rms_norm_rows(x, w.norm1, p->normed, M, H, p->eps);
    w.qkv.fn(w.qkv.w, p->normed, M, H, qkv_row, p->qkv);
    qk_norm_rope_bf16(p->qkv, M, qkv_row, p->nh, p->nkv, D, w.q_norm, w.k_norm, cos, sin, p->qk_eps, p->q, p->k);
    write_kv(reinterpret_cast<const char*>(p->k), reinterpret_cast<const char*>(p->qkv + v_col), kv_row,
             D * sizeof(bf16), qkv_row * sizeof(bf16), D * sizeof(bf16), p->nkv,
             reinterpret_cast<char*>(w.k_cache), reinterpret_cast<char*>(w.v_cache), p->rows, M * p->nkv,
             D * sizeof(bf16));
    p->attention(p->q, w.k_cache, w.v_cache, p->cu, p->lens, p->tables, p->att, M, p->max_blocks, p->nkv,
                 p->nh / p->nkv, p->block_size, D, p->scale, p->q_tile);
    w.o.fn(w.o.w, p->att, M, p->nh * D, H, p->proj);
    add_rows(x, p->proj, M * H);
    rms_norm_rows(x, w.norm2, p->normed, M, H, p->eps);
    w.gate_up.fn(w.gate_up.w, p->normed, M, H, 2 * p->inter, p->gate_up);
    silu_mul_bf16(p->gate_up, M, p->inter, p->act);
    w.down.fn(w.down.w, p->act, M, p->inter, H, p->proj);
    add_rows(x, p->proj, M * H);
  }
}

#endif

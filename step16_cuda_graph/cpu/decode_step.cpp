// Every layer of a decode step of one to four sequences, in one C call: bf16 (AVX-512 BF16
// builds) or float32 (builds with gemm_f32: AVX2 + FMA).
//
// At one row a layer's arithmetic is a few hundred microseconds of reading weights; what the
// compiled path adds around it is per-op cost: each layer calls seven ops through PyTorch's
// dispatcher into Python and ctypes, and inductor's wrapper checks every input's size and
// stride. Thirty layers a step, a few microseconds a call: milliseconds a step (lesson 16's
// cpu/run.py measures the step both ways). A CUDA graph removes the same kind of cost on a GPU
// by recording the kernel launches once. Here the "recording" is a plan: every pointer the step
// touches (each layer's weights and K/V pool, the step's metadata buffers, scratch rows),
// gathered once per bucket in Python (decode_step.py); the "replay" is this loop over it. The
// kernels are the ones the compiled path calls (elementwise.cpp's, included below, gemm_f32,
// and lesson 15's attention through a function pointer); in bf16, values are rounded to bf16 at
// the points where eager PyTorch rounds.
//
// One layer, rows x [M, H] (M <= 4), in place:
//   a = rms_norm(x)            float32 sum of squares, x * rsqrt(mean + eps) (to bf16), times w
//   qkv = a @ Wqkv^T           the plan's linear: gemv_bf16 on a plain bf16 weight (linear_bf16
//                              below), gemm_f32 on its panels (linear_f32*), or any function of
//                              the same signature on a weight format of its own (advanced
//                              lesson 01 plugs in its Q4_1 blocks)
//   q, k = qk_norm_rope(qkv)   elementwise.cpp's pass (bf16), the float32 one below
//   pool[rows] = k, v          write_kv
//   o = attention(q, pool)     lesson 15's flash_attention_bf16 / flash_attention_f32
//   x = x + o @ Wo^T
//   x = x + down(silu(gate) * up)(rms_norm(x))
#include "elementwise.cpp"

#include <cmath>

// The plan, for activations of type T (bf16 or float): numbers and pointers only, so one layout
// serves both and decode_step.py's ctypes structures mirror it, field for field.
template <typename T>   // lesson 15's flash_attention_bf16 / _f32 (flash_attention.cpp), through a pointer
using AttentionFn = void (*)(const T* q, const T* k, const T* v, const int64_t* cu, const int64_t* lens,
                             const int64_t* tables, T* out, int64_t B, int64_t max_blocks, int64_t hkv,
                             int64_t group, int64_t bs, int64_t D, float scale, int64_t q_tile);

template <typename T>   // y [M, N] = x [M, K] @ W^T, W in the format `fn` reads, behind `w`
struct Linear {
  const void* w;
  void (*fn)(const void* w, const T* x, int64_t M, int64_t K, int64_t N, T* y);
};

template <typename T>
struct LayerWeights {        // one layer's tensors; q_norm/k_norm null where the model has none
  const T *norm1, *q_norm, *k_norm, *norm2;
  Linear<T> qkv, o, gate_up, down;
  T *k_cache, *v_cache;
};

template <typename T>
struct DecodePlan {
  int64_t layers, M, hidden, nh, nkv, D, inter;
  float eps, qk_eps, scale;
  AttentionFn<T> attention;
  int64_t max_blocks, block_size, q_tile;
  const int64_t *rows, *cu, *lens, *tables;         // the bucket's step buffers (GraphRunner.static)
  const LayerWeights<T>* weights;                   // [layers]
  T *normed, *qkv, *q, *k, *att, *proj, *gate_up, *act;   // scratch rows
};

// Each dtype's element-wise passes: rms_norm_rows, add_rows, qk_norm_rope, silu_mul.
namespace {

#if defined(__AVX512F__) && defined(__AVX512BF16__)
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

void qk_norm_rope(const bf16* qkv, int64_t T, int64_t row, int64_t nh, int64_t nkv, int64_t D, const bf16* qw,
                  const bf16* kw, const float* cos, const float* sin, float eps, bf16* q, bf16* k) {
  qk_norm_rope_bf16(qkv, T, row, nh, nkv, D, qw, kw, cos, sin, eps, q, k);
}

void silu_mul(const bf16* gate_up, int64_t N, int64_t I, bf16* out) { silu_mul_bf16(gate_up, N, I, out); }
#endif

#if defined(__AVX2__) && defined(__FMA__)
// float32: what lesson 04's modules compute in float32 (no rounding between steps), in loops
// the compiler vectorises. The sums run in another order than inductor's: equal to a few ulps.
void rms_norm_rows(const float* x, const float* w, float* out, int64_t M, int64_t H, float eps) {
  for (int64_t m = 0; m < M; ++m) {
    const float* xr = x + m * H;
    float ss = 0.f;
#pragma omp simd reduction(+ : ss)
    for (int64_t j = 0; j < H; ++j) ss += xr[j] * xr[j];
    const float r = 1.0f / std::sqrt(ss / float(H) + eps);
#pragma omp simd
    for (int64_t j = 0; j < H; ++j) out[m * H + j] = w[j] * (xr[j] * r);
  }
}

void add_rows(float* x, const float* d, int64_t n) {
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) x[j] += d[j];
}

// Each head of q and k (the first nh + nkv heads of a qkv row): rms_norm over D where w is
// given, then RoPE on the pairs (j, j + D/2), as step03's apply_rope.
void qk_norm_rope(const float* qkv, int64_t T, int64_t row, int64_t nh, int64_t nkv, int64_t D, const float* qw,
                  const float* kw, const float* cos, const float* sin, float eps, float* q, float* k) {
  const int64_t half = D / 2;
  for (int64_t t = 0; t < T; ++t) {
    const float *c = cos + t * D, *s = sin + t * D;
    for (int64_t h = 0; h < nh + nkv; ++h) {
      const bool is_q = h < nh;
      const float* w = is_q ? qw : kw;
      float* dst = is_q ? q + (t * nh + h) * D : k + (t * nkv + h - nh) * D;
      const float* src = qkv + t * row + h * D;
      float x[512];                                   // D <= 512 (decode_step.fits)
      if (w != nullptr)
        rms_norm_rows(src, w, x, 1, D, eps);
      else
        std::memcpy(x, src, D * sizeof(float));
#pragma omp simd
      for (int64_t j = 0; j < half; ++j) {
        dst[j] = x[j] * c[j] - x[j + half] * s[j];
        dst[j + half] = x[j + half] * c[j + half] + x[j] * s[j + half];
      }
    }
  }
}

void silu_mul(const float* gate_up, int64_t N, int64_t I, float* out) {
  for (int64_t n = 0; n < N; ++n) {
    const float *g = gate_up + n * 2 * I, *u = g + I;
#pragma omp simd
    for (int64_t i = 0; i < I; ++i) out[n * I + i] = g[i] / (1.0f + std::exp(-g[i])) * u[i];
  }
}
#endif

// x [M, hidden]: the step's embedded tokens in, the last layer's output out (before the final
// norm). cos, sin [M, D] float32: the rotary tables at the step's positions.
template <typename T>
void decode_layers(const DecodePlan<T>* p, T* x, const float* cos, const float* sin) {
  const int64_t M = p->M, H = p->hidden, D = p->D, qkv_row = (p->nh + 2 * p->nkv) * D;
  const int64_t kv_row = p->nkv * D * int64_t(sizeof(T)), v_col = (p->nh + p->nkv) * D;
  for (int64_t l = 0; l < p->layers; ++l) {
    const LayerWeights<T>& w = p->weights[l];
    rms_norm_rows(x, w.norm1, p->normed, M, H, p->eps);
    w.qkv.fn(w.qkv.w, p->normed, M, H, qkv_row, p->qkv);
    qk_norm_rope(p->qkv, M, qkv_row, p->nh, p->nkv, D, w.q_norm, w.k_norm, cos, sin, p->qk_eps, p->q, p->k);
    write_kv(reinterpret_cast<const char*>(p->k), reinterpret_cast<const char*>(p->qkv + v_col), kv_row,
             D * sizeof(T), qkv_row * sizeof(T), D * sizeof(T), p->nkv,
             reinterpret_cast<char*>(w.k_cache), reinterpret_cast<char*>(w.v_cache), p->rows, M * p->nkv,
             D * sizeof(T));
    p->attention(p->q, w.k_cache, w.v_cache, p->cu, p->lens, p->tables, p->att, M, p->max_blocks, p->nkv,
                 p->nh / p->nkv, p->block_size, D, p->scale, p->q_tile);
    w.o.fn(w.o.w, p->att, M, p->nh * D, H, p->proj);
    add_rows(x, p->proj, M * H);
    rms_norm_rows(x, w.norm2, p->normed, M, H, p->eps);
    w.gate_up.fn(w.gate_up.w, p->normed, M, H, 2 * p->inter, p->gate_up);
    silu_mul(p->gate_up, M, p->inter, p->act);
    w.down.fn(w.down.w, p->act, M, p->inter, H, p->proj);
    add_rows(x, p->proj, M * H);
  }
}

}  // namespace

#if defined(__AVX512F__) && defined(__AVX512BF16__)
// The plan's linear for a plain bf16 weight [N, K] (lesson 16's OpPackedLinear.dense).
extern "C" void linear_bf16(const void* w, const bf16* x, int64_t M, int64_t K, int64_t N, bf16* y) {
  gemv_bf16(x, M, K, static_cast<const bf16*>(w), N, y);
}

extern "C" void decode_layers_bf16(const DecodePlan<bf16>* p, bf16* x, const float* cos, const float* sin) {
  decode_layers(p, x, cos, sin);
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
// The plan's linears for OpPackedLinear.panels (ops.pack_f32): float32 values, or bf16 values
// kept as bf16 (half the bytes a step reads).
extern "C" void linear_f32(const void* w, const float* x, int64_t M, int64_t K, int64_t N, float* y) {
  gemm_f32(x, M, K, w, 0, N, nullptr, y);
}

extern "C" void linear_f32_bf16_panels(const void* w, const float* x, int64_t M, int64_t K, int64_t N, float* y) {
  gemm_f32(x, M, K, w, 1, N, nullptr, y);
}

extern "C" void decode_layers_f32(const DecodePlan<float>* p, float* x, const float* cos, const float* sin) {
  decode_layers(p, x, cos, sin);
}
#endif

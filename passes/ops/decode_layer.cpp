// One decoder layer's batch-1 piece between two attentions, as one parallel region:
//
//   h   = o_proj(attn);  s = h + residual;  x = rms_norm(s) * w_post
//   g,u = gate_up(x);    m = silu(g) * u;   d = down(m)
//   s2  = d + s;         x2 = rms_norm(s2) * w_in;  q,k,v = qkv(x2);  q,k = rope(q,k)
//
// Why one region: Inductor's kernel for the same piece stops streaming weights for ~13
// serial blocks and barriers (norms, SiLU, RoPE, bf16 conversions), and in minutes when
// memory is fast that costs ~10% of the layer against a bare loop over the same products
// (benchmarks/NOTES.md, section 31). Here each thread recomputes the 576-wide norms itself
// (cheaper than a barrier) and owns whole heads of q and k (RoPE needs no barrier):
// five barriers a layer.
//
// Rounding follows the unfused graph: every product, add, norm and activation result is
// rounded to bf16; accumulation and the norm's statistics are fp32.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <omp.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

// Row lengths with an unrolled product (see dot_fixed); none unless the build sets them.
#ifndef CC_DOT_SIZES
#define CC_DOT_SIZES
#endif

namespace {

typedef uint16_t bf16;

inline float to_f32(bf16 v) {
  uint32_t bits = uint32_t(v) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline bf16 to_bf16(float f) {  // round to nearest even, as torch does
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return bf16((bits >> 16) | 0x40);  // NaN stays NaN
  return bf16((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

inline float round_bf16(float f) { return to_f32(to_bf16(f)); }

#if defined(__AVX512F__)
inline __m512 round16(__m512 v) {  // round_bf16 on 16 finite values
  __m512i b = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  b = _mm512_add_epi32(b, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb));
  return _mm512_castsi512_ps(_mm512_and_si512(b, _mm512_set1_epi32(int(0xffff0000u))));
}
inline __m512 load16(const bf16* p) {
  __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
#endif

// out[i] = round_bf16(a[i] + b[i]) (b as bf16 or fp32)
template <typename B>
inline void add_round(const float* a, const B* b, float* out, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16) {
    __m512 bv;
    if constexpr (sizeof(B) == 2) bv = load16(reinterpret_cast<const bf16*>(b) + i);
    else bv = _mm512_loadu_ps(reinterpret_cast<const float*>(b) + i);
    _mm512_storeu_ps(out + i, round16(_mm512_add_ps(_mm512_loadu_ps(a + i), bv)));
  }
#endif
  for (; i < n; ++i) {
    float bi;
    if constexpr (sizeof(B) == 2) bi = to_f32(reinterpret_cast<const bf16*>(b)[i]);
    else bi = reinterpret_cast<const float*>(b)[i];
    out[i] = round_bf16(a[i] + bi);
  }
}

// One row of a product whose length K is known only when running: one accumulator.
inline float dot_loop(const float* x, const bf16* w, int64_t K) {
#if defined(__AVX512F__)
  __m512 acc = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= K; k += 16)
    acc = _mm512_add_ps(acc, _mm512_mul_ps(_mm512_loadu_ps(x + k), load16(w + k)));
  float sum = _mm512_reduce_add_ps(acc);
#else
  float sum = 0.f;
  int64_t k = 0;
#endif
  for (; k < K; ++k) sum += x[k] * to_f32(w[k]);
  return sum;
}

// How far ahead of its loads a product asks for weights (bytes), or 0; set by the build
// (passes/native.py: 4 KB on Intel CPUs). On the AMX Xeon the unrolled rows below read at
// ~0.8x a plain sum over the same bytes without it and at the sum's speed with it (the
// L2's own prefetcher falls behind a loop that does work per line); on the EPYC the same
// prefetch read slower (benchmarks/NOTES.md, sections 32 and 42).
#ifndef CC_PREFETCH
#define CC_PREFETCH 0
#endif

// The same row with K known when compiling: fully unrolled over four accumulators. A loop
// that exits after every row (~1 KB) streamed ~10% slower in minutes when memory is fast,
// and one accumulator's chain of adds caps a core near the rate such a minute delivers
// (benchmarks/NOTES.md, section 33). PF: prefetch CC_PREFETCH bytes ahead, one line at a
// time (into L2: a prefetch into L1 as well read slower).
template <int64_t K, bool PF>
inline float dot_fixed(const float* x, const bf16* w, const char* pf) {
#if defined(__AVX512F__)
  __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(),
                   _mm512_setzero_ps()};
#pragma GCC unroll 256
  for (int64_t k = 0; k < K / 16 * 16; k += 16) {
    if (PF && k % 32 == 0) _mm_prefetch(pf + 2 * k, _MM_HINT_T2);
    acc[k / 16 % 4] = _mm512_fmadd_ps(_mm512_loadu_ps(x + k), load16(w + k), acc[k / 16 % 4]);
  }
  float sum = _mm512_reduce_add_ps(
      _mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3])));
  for (int64_t k = K / 16 * 16; k < K; ++k) sum += x[k] * to_f32(w[k]);
  return sum;
#else
  return dot_loop(x, w, K);
#endif
}

// decode_layer.py builds this file per model with the row lengths of its products
// (passes/native.py: `-DCC_DOT_SIZES="CC_DOT(576) CC_DOT(1536)"`); other lengths loop.
template <bool PF>
inline float dot(const float* x, const bf16* w, int64_t K, const char* pf = nullptr) {
#define CC_DOT(n) \
  if (K == (n)) return dot_fixed<(n), PF && CC_PREFETCH != 0>(x, w, pf);
  CC_DOT_SIZES
#undef CC_DOT
  return dot_loop(x, w, K);
}

// out[r - r0] = bf16(x . w[r]) for rows r0 <= r < r1 of w [*, K]. `stop`: the end of
// what this thread reads of w; past it the prefetches run on into `next`, where this
// thread's rows of the next product start (or stop there, with none).
inline void product_rows(const float* x, const bf16* w, int64_t K, int64_t r0, int64_t r1,
                         const bf16* stop, float* out, const bf16* next = nullptr) {
  for (int64_t r = r0; r < r1; ++r) {
    const bf16* row = w + r * K;
    const char* pf = reinterpret_cast<const char*>(row) + CC_PREFETCH;
    const char* end = reinterpret_cast<const char*>(stop);
    if (pf + 2 * K > end)
      pf = next ? reinterpret_cast<const char*>(next) + (pf > end ? pf - end : 0) : nullptr;
    out[r - r0] = round_bf16(pf ? dot<true>(x, row, K, pf) : dot<false>(x, row, K));
  }
}

// out = bf16(rms_norm(s) * weight) as fp32, s already bf16-rounded.
inline void rms_norm(const float* s, const bf16* weight, float eps, int64_t n, float* out) {
  int64_t i = 0;
  float sq = 0.f;
#if defined(__AVX512F__)
  __m512 acc = _mm512_setzero_ps();
  for (; i + 16 <= n; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(s + i), _mm512_loadu_ps(s + i), acc);
  sq = _mm512_reduce_add_ps(acc);
#endif
  for (; i < n; ++i) sq += s[i] * s[i];
  const float scale = 1.f / std::sqrt(sq / float(n) + eps);
  i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16) {
    const __m512 normed = round16(_mm512_mul_ps(_mm512_loadu_ps(s + i), _mm512_set1_ps(scale)));
    _mm512_storeu_ps(out + i, round16(_mm512_mul_ps(load16(weight + i), normed)));
  }
#endif
  for (; i < n; ++i) out[i] = round_bf16(to_f32(weight[i]) * round_bf16(s[i] * scale));
}

#if defined(__AVX512F__)
// exp to ~2 ulp of fp32 (range reduction by ln 2, degree-6 polynomial): SiLU's result is
// rounded to bf16, and glibc's scalar exp in this loop cost more than the rows' reads.
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.3f)), _mm512_set1_ps(-88.3f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145752f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860677e-6f), r);
  __m512 p = _mm512_set1_ps(1.f / 720);
  static const float coef[6] = {1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f};
  for (float c : coef) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
  return _mm512_scalef_ps(p, n);
}

// bf16(bf16(silu(g)) * u) for 16 values already rounded to bf16.
inline void silu_mul16(const float* g, const float* u, float* out) {
  const __m512 gv = _mm512_loadu_ps(g);
  const __m512 s = _mm512_div_ps(gv, _mm512_add_ps(_mm512_set1_ps(1.f), exp16(_mm512_sub_ps(_mm512_setzero_ps(), gv))));
  _mm512_storeu_ps(out, round16(_mm512_mul_ps(round16(s), _mm512_loadu_ps(u))));
}
#endif
inline float silu(float g) { return g / (1.f + std::exp(-g)); }

struct Piece {
  const bf16 *attn, *residual, *w_o, *w_post, *w_gate_up, *w_down, *w_in, *w_qkv;
  const float* cos_sin;     // [max_position, rotary_dim]: cos halves, then sin halves
  const int64_t* position;  // [1]
  bf16 *q, *k, *v, *residual_out;
  float* scratch;  // per thread: residual, normed input, a row block; then shared buffers
  int64_t hidden, q_size, kv_size, inter, head_dim, rotary_dim, threads;
  float eps;
};

// A head of q or k, rotated in place (neox style: the two halves of rotary_dim).
inline void rope(float* x, const float* cos_sin, int64_t rotary_dim) {
  const int64_t half = rotary_dim / 2;
  for (int64_t i = 0; i < half; ++i) {
    const float c = round_bf16(cos_sin[i]), s = round_bf16(cos_sin[half + i]);
    const float x1 = x[i], x2 = x[half + i];
    x[i] = round_bf16(round_bf16(x1 * c) - round_bf16(x2 * s));
    x[half + i] = round_bf16(round_bf16(x2 * c) + round_bf16(x1 * s));
  }
}

// The layer on the calling thread's share of the team: every thread of a parallel region
// calls it (from `decode_layer_bf16`'s own region, or from a CPU graph's team region that
// also runs the step's attention, so the threads never leave between layers).
void run_in_team(const Piece& p) {
  const int64_t H = p.hidden, I = p.inter, D = p.head_dim;
  const int64_t local = 3 * H + (p.q_size > H ? p.q_size : H);
  float* shared_h = p.scratch + p.threads * local;  // o_proj output, then down's
  float* shared_m = shared_h + (I > H ? I : H);     // silu(g) * u
  float* shared_gu = shared_m + I;                   // gate_up's output
  const int64_t t = omp_get_thread_num(), T = omp_get_num_threads();
  float* s = p.scratch + t * local;  // this thread's copy of the residual stream
  float* x = s + H;                  // its normalized input to the next product
  float* a = x + H;                  // attention output (fp32), then a head's rows
  for (int64_t i = 0; i < p.q_size; ++i) a[i] = to_f32(p.attn[i]);
  // Where this thread's rows of each product start: the product before runs its
  // prefetches on into them, so the stream does not restart cold after each barrier.
  const int64_t q_heads = p.q_size / D, kv_heads = p.kv_size / D;
  const int64_t heads = q_heads + 2 * kv_heads;
  const bf16* my_gate_up = p.w_gate_up + 2 * I * t / T * H;
  const bf16* my_down = p.w_down + H * t / T * I;
  const bf16* my_qkv = p.w_qkv + heads * t / T * D * H;
  {
    const int64_t r0 = H * t / T, r1 = H * (t + 1) / T;
    product_rows(a, p.w_o, p.q_size, r0, r1, p.w_o + r1 * p.q_size, shared_h + r0, my_gate_up);
  }
#pragma omp barrier
  add_round(shared_h, p.residual, s, H);
  rms_norm(s, p.w_post, p.eps, H, x);
  // gate_up split by rows like any product (one sequential run per thread: reading
  // gate and up rows in turn split each thread's stream and read slower), then SiLU.
  {
    const int64_t r0 = 2 * I * t / T, r1 = 2 * I * (t + 1) / T;
    product_rows(x, p.w_gate_up, H, r0, r1, p.w_gate_up + r1 * H, shared_gu + r0, my_down);
  }
#pragma omp barrier
  {
    int64_t j = I * t / T;
    const int64_t j1 = I * (t + 1) / T;
#if defined(__AVX512F__)
    for (; j + 16 <= j1; j += 16) silu_mul16(shared_gu + j, shared_gu + I + j, shared_m + j);
#endif
    for (; j < j1; ++j) shared_m[j] = round_bf16(round_bf16(silu(shared_gu[j])) * shared_gu[I + j]);
  }
#pragma omp barrier
  {
    const int64_t r0 = H * t / T, r1 = H * (t + 1) / T;
    product_rows(shared_m, p.w_down, I, r0, r1, p.w_down + r1 * I, shared_h + r0, my_qkv);
  }
#pragma omp barrier
  add_round(shared_h, s, s, H);
  if (t == 0)
    for (int64_t i = 0; i < H; ++i) p.residual_out[i] = to_bf16(s[i]);
  rms_norm(s, p.w_in, p.eps, H, x);
  // Whole heads per thread: q heads, then k heads, then v heads.
  const float* cos_sin = p.cos_sin + p.position[0] * p.rotary_dim;
  const int64_t h1 = heads * (t + 1) / T;
  for (int64_t hd = heads * t / T; hd < h1; ++hd) {
    product_rows(x, p.w_qkv, H, hd * D, (hd + 1) * D, p.w_qkv + h1 * D * H, a);
    bf16* out = hd < q_heads ? p.q + hd * D
                : hd < q_heads + kv_heads ? p.k + (hd - q_heads) * D
                                          : p.v + (hd - q_heads - kv_heads) * D;
    if (hd < q_heads + kv_heads) rope(a, cos_sin, p.rotary_dim);
    for (int64_t i = 0; i < D; ++i) out[i] = to_bf16(a[i]);
  }
}

Piece make_piece(const bf16* attn, const bf16* residual, const bf16* w_o, const bf16* w_post,
                 const bf16* w_gate_up, const bf16* w_down, const bf16* w_in,
                 const bf16* w_qkv, const float* cos_sin, const int64_t* position, bf16* q,
                 bf16* k, bf16* v, bf16* residual_out, float* scratch, int64_t hidden,
                 int64_t q_size, int64_t kv_size, int64_t inter, int64_t head_dim,
                 int64_t rotary_dim, int64_t eps_bits, int64_t threads) {
  float eps;
  const uint32_t bits = uint32_t(eps_bits);
  std::memcpy(&eps, &bits, 4);
  return Piece{attn, residual, w_o, w_post, w_gate_up, w_down, w_in, w_qkv, cos_sin, position,
               q, k, v, residual_out, scratch, hidden, q_size, kv_size, inter, head_dim,
               rotary_dim, threads, eps};
}

}  // namespace

extern "C" {

// Whether this build has an unrolled copy of the product for rows of length K.
int64_t decode_layer_unrolled(int64_t K) {
#define CC_DOT(n) \
  if (K == (n)) return 1;
  CC_DOT_SIZES
#undef CC_DOT
  return 0;
}

int64_t decode_layer_available() {
#if defined(__AVX512F__)
  return 1;
#else
  return 0;  // the op runs its torch reference; the pass does not fire (see decode_layer.py)
#endif
}

// Scratch floats `decode_layer_bf16` needs for these sizes.
int64_t decode_layer_scratch(int64_t hidden, int64_t q_size, int64_t inter, int64_t threads) {
  const int64_t local = 3 * hidden + (q_size > hidden ? q_size : hidden);
  return threads * local + (inter > hidden ? inter : hidden) + 3 * inter;
}

// Pointers and sizes as int64, so a CPU graph records the call like any other.
#define DECODE_LAYER_PARAMS                                                                  \
  const bf16 *attn, const bf16 *residual, const bf16 *w_o, const bf16 *w_post,               \
      const bf16 *w_gate_up, const bf16 *w_down, const bf16 *w_in, const bf16 *w_qkv,        \
      const float *cos_sin, const int64_t *position, bf16 *q, bf16 *k, bf16 *v,              \
      bf16 *residual_out, float *scratch, int64_t hidden, int64_t q_size, int64_t kv_size,   \
      int64_t inter, int64_t head_dim, int64_t rotary_dim, int64_t eps_bits, int64_t threads
#define DECODE_LAYER_ARGS                                                                     \
  attn, residual, w_o, w_post, w_gate_up, w_down, w_in, w_qkv, cos_sin, position, q, k, v,   \
      residual_out, scratch, hidden, q_size, kv_size, inter, head_dim, rotary_dim, eps_bits,  \
      threads

void decode_layer_bf16(DECODE_LAYER_PARAMS) {
  const Piece p = make_piece(DECODE_LAYER_ARGS);
#pragma omp parallel num_threads(threads)
  run_in_team(p);
}

// The same layer as a team function (passes/native.py: `record_native_call(team=...)`):
// called on every thread of a region the caller opened with at most `threads` threads.
void decode_layer_team_bf16(DECODE_LAYER_PARAMS) { run_in_team(make_piece(DECODE_LAYER_ARGS)); }

}  // extern "C"

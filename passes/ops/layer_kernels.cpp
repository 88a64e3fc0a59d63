// The CPU kernels of a decoder layer's batch-1 ops, each a team function: the batch-1
// product (`compilecore.linear`), add + RMSNorm, SiLU-and-mul and QKV split + RoPE.
//
// Every function here is called on every thread of a parallel region and splits its work by
// `omp_get_thread_num()`: a CPU graph (compilecore/cpu_graph.py) calls a run of them in one
// OpenMP team with a barrier between calls, so a piece's ops and the attention between
// pieces run as one parallel region; `*_bf16` opens a region of its own for eager calls.
// Why a region and not one op per layer: docs/kernel-choices.md, The layer region.
//
// Rounding follows the unfused graph: every product, add, norm and activation result is
// rounded to bf16; accumulation and the norm's statistics are fp32.
#include <cmath>

#include "bf16_dot.h"
#include "exp16.h"

namespace {

#if defined(__AVX512F__)
inline __m512 round16(__m512 v) {  // round_bf16 on 16 finite values
  __m512i b = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  b = _mm512_add_epi32(b, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb));
  return _mm512_castsi512_ps(_mm512_and_si512(b, _mm512_set1_epi32(int(0xffff0000u))));
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

// out[r - r0] = x . w[r] (rounded to bf16 unless `round` is false) for rows r0 <= r < r1
// of w [*, K]. `stop`: the end of what this thread reads of w; the prefetches stop there.
inline void product_rows(const float* x, const bf16* w, int64_t K, int64_t r0, int64_t r1,
                         const bf16* stop, float* out, bool round = true) {
  for (int64_t r = r0; r < r1; ++r) {
    const bf16* row = w + r * K;
    const char* pf = reinterpret_cast<const char*>(row) + CC_PREFETCH;
    if (pf + 2 * K > reinterpret_cast<const char*>(stop)) pf = nullptr;
    const float sum = pf ? dot<true>(x, row, K, pf) : dot<false>(x, row, K);
    out[r - r0] = round ? round_bf16(sum) : sum;
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
// bf16(bf16(silu(g)) * u) for 16 values already rounded to bf16.
inline __m512 silu_mul16(__m512 g, __m512 u) {
  const __m512 one = _mm512_set1_ps(1.f);
  const __m512 s = _mm512_div_ps(g, _mm512_add_ps(one, exp16(_mm512_sub_ps(_mm512_setzero_ps(), g))));
  return round16(_mm512_mul_ps(round16(s), u));
}

// 16 values already rounded to bf16, stored as bf16 (their upper halves).
inline void store16(bf16* p, __m512 rounded) {
  const __m512i bits = _mm512_srli_epi32(_mm512_castps_si512(rounded), 16);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(bits));
}
#endif
inline float silu(float g) { return g / (1.f + std::exp(-g)); }

// A head of q or k, rotated in place (neox style: the two halves of rotary_dim).
inline void rope(float* x, const float* cos_sin, int64_t rotary_dim) {
  const int64_t half = rotary_dim / 2;
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= half; i += 16) {
    const __m512 c = round16(_mm512_loadu_ps(cos_sin + i));
    const __m512 s = round16(_mm512_loadu_ps(cos_sin + half + i));
    const __m512 x1 = _mm512_loadu_ps(x + i), x2 = _mm512_loadu_ps(x + half + i);
    const __m512 a = _mm512_sub_ps(round16(_mm512_mul_ps(x1, c)), round16(_mm512_mul_ps(x2, s)));
    const __m512 b = _mm512_add_ps(round16(_mm512_mul_ps(x2, c)), round16(_mm512_mul_ps(x1, s)));
    _mm512_storeu_ps(x + i, round16(a));
    _mm512_storeu_ps(x + half + i, round16(b));
  }
#endif
  for (; i < half; ++i) {
    const float c = round_bf16(cos_sin[i]), s = round_bf16(cos_sin[half + i]);
    const float x1 = x[i], x2 = x[half + i];
    x[i] = round_bf16(round_bf16(x1 * c) - round_bf16(x2 * s));
    x[half + i] = round_bf16(round_bf16(x2 * c) + round_bf16(x1 * s));
  }
}

inline void to_f32_row(const bf16* in, float* out, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(out + i, load16(in + i));
#endif
  for (; i < n; ++i) out[i] = to_f32(in[i]);
}

// Values already rounded to bf16, stored as bf16.
inline void to_bf16_row(const float* in, bf16* out, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16) store16(out + i, _mm512_loadu_ps(in + i));
#endif
  for (; i < n; ++i) out[i] = to_bf16(in[i]);
}

}  // namespace

extern "C" {

int64_t layer_kernels_available() {
#if defined(__AVX512F__)
  return 1;
#else
  return 0;  // the ops run their torch references; the passes do not fire (passes/config.py)
#endif
}

// Whether this build has an unrolled copy of the product for rows of length K.
int64_t layer_kernels_unrolled(int64_t K) {
#define CC_DOT(n) \
  if (K == (n)) return 1;
  CC_DOT_SIZES
#undef CC_DOT
  return 0;
}

// y [1, N] = bf16(x [1, K] . w[n] (+ bias[n])), w [N, K] row-major, bias null or [N]; each
// thread a few sequential runs of rows (one weight stream at a time:
// docs/kernel-choices.md, Prefetch), handed out by the guided schedule (`guided_rows`).
void linear_team_bf16(const bf16* x, const bf16* w, const bf16* bias, bf16* y, int64_t N,
                      int64_t K) {
  float* xf = scratch(K + 64);
  float* row = xf + K;
  to_f32_row(x, xf, K);
  const int64_t blocks = (N + 63) / 64, per = guided_rows(2 * K) / 64;
#pragma omp for schedule(guided, per > 1 ? per : 1) nowait
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t r0 = b * 64, r1 = r0 + 64 < N ? r0 + 64 : N;
    product_rows(xf, w, K, r0, r1, w + N * K, row, false);
    for (int64_t r = r0; r < r1; ++r)  // the bias added in fp32, one rounding (as addmm)
      y[r] = to_bf16(bias ? row[r - r0] + to_f32(bias[r]) : row[r - r0]);
  }
}

// out = bf16(rms_norm(s) * weight), residual_out = s = bf16(x + residual), rows [M, H].
// One row: every thread computes the row's statistic and writes its share of columns
// (cheaper than a barrier); more rows: rows split.
void add_rms_norm_team_bf16(const bf16* x, const bf16* residual, const bf16* weight,
                            bf16* out, bf16* residual_out, int64_t M, int64_t H,
                            int64_t eps_bits) {
  const float eps = bits_to_float(eps_bits);
  float* buf = scratch(3 * H);
  float *xf = buf, *s = buf + H, *n = buf + 2 * H;
  const Share rows = M == 1 ? Share{0, 1} : share(M);
  const Share cols = M == 1 ? share(H) : Share{0, H};
  for (int64_t m = rows.begin; m < rows.end; ++m) {
    to_f32_row(x + m * H, xf, H);
    add_round(xf, residual + m * H, s, H);
    rms_norm(s, weight, eps, H, n);
    to_bf16_row(n + cols.begin, out + m * H + cols.begin, cols.end - cols.begin);
    to_bf16_row(s + cols.begin, residual_out + m * H + cols.begin, cols.end - cols.begin);
  }
}

// out [M, I] = bf16(bf16(silu(x[:, :I])) * x[:, I:]), x [M, 2I]; one row: columns split,
// more rows: rows split.
void silu_and_mul_team_bf16(const bf16* x, bf16* out, int64_t M, int64_t I) {
  const Share rows = M == 1 ? Share{0, 1} : share(M);
  const Share cols = M == 1 ? share(I) : Share{0, I};
  for (int64_t m = rows.begin; m < rows.end; ++m) {
    const bf16 *g = x + m * 2 * I, *u = g + I;
    int64_t j = cols.begin;
#if defined(__AVX512F__)
    for (; j + 16 <= cols.end; j += 16)
      store16(out + m * I + j, silu_mul16(load16(g + j), load16(u + j)));
#endif
    for (; j < cols.end; ++j)
      out[m * I + j] = to_bf16(round_bf16(round_bf16(silu(to_f32(g[j]))) * to_f32(u[j])));
  }
}

// q, k, v = split(qkv [M, (H + 2 KV) D], row stride ld); q and k rotated by the positions'
// rows of cos_sin [*, rotary_dim] (fp32); whole heads split across threads.
void qkv_rope_team_bf16(const bf16* qkv, int64_t ld, const int64_t* positions,
                        const float* cos_sin, bf16* q, bf16* k, bf16* v, int64_t M, int64_t H,
                        int64_t KV, int64_t D, int64_t rotary_dim) {
  float* a = scratch(D);
  const int64_t heads = H + 2 * KV;
  const Share s = share(M * heads);
  for (int64_t u = s.begin; u < s.end; ++u) {
    const int64_t m = u / heads, hd = u % heads;
    to_f32_row(qkv + m * ld + hd * D, a, D);
    bf16* out = hd < H ? q + (m * H + hd) * D
                : hd < H + KV ? k + (m * KV + hd - H) * D
                              : v + (m * KV + hd - H - KV) * D;
    if (hd < H + KV) rope(a, cos_sin + positions[m] * rotary_dim, rotary_dim);
    to_bf16_row(a, out, D);
  }
}

// The same functions for eager calls: each opens a region of `threads` threads.
#define CC_REGION(name, params, args)                 \
  void name##_bf16 params {                            \
    _Pragma("omp parallel num_threads(threads)") name##_team_bf16 args; \
  }
CC_REGION(linear, (const bf16* x, const bf16* w, const bf16* bias, bf16* y, int64_t N,
                   int64_t K, int64_t threads), (x, w, bias, y, N, K))
CC_REGION(add_rms_norm, (const bf16* x, const bf16* residual, const bf16* weight, bf16* out,
                         bf16* residual_out, int64_t M, int64_t H, int64_t eps_bits,
                         int64_t threads), (x, residual, weight, out, residual_out, M, H, eps_bits))
CC_REGION(silu_and_mul, (const bf16* x, bf16* out, int64_t M, int64_t I, int64_t threads),
          (x, out, M, I))
CC_REGION(qkv_rope, (const bf16* qkv, int64_t ld, const int64_t* positions,
                     const float* cos_sin, bf16* q, bf16* k, bf16* v, int64_t M, int64_t H,
                     int64_t KV, int64_t D, int64_t rotary_dim, int64_t threads),
          (qkv, ld, positions, cos_sin, q, k, v, M, H, KV, D, rotary_dim))
#undef CC_REGION

}  // extern "C"

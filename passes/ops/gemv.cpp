// y[m, n] = sum_k x[m, k] * w[n, k] for bf16 x and w (both row-major), in fp32: the LM
// head's matrix-vector product at batch 1, on the weight as loaded.
//
// One weight row at a time, so each thread reads one sequential run of rows: interleaving
// rows split the stream and lost ~30% (docs/kernel-choices.md, The LM head). `vdpbf16ps`
// takes 32 weights and 32 x values a load (pairs multiplied exactly, summed in fp32) into
// four independent accumulators, so neither conversions nor one accumulator's latency chain
// slow a thread when memory delivers at its fastest: over the LM head's 56.6 MB this loop
// read at the speed of a plain sum, where Inductor's loop (bf16 -> fp32 conversions, one
// dependent add per 16 weights) read at ~0.75 of it in the same minutes
// (docs/kernel-choices.md).
#include <cmath>

#include "bf16_dot.h"

namespace {

#if defined(__AVX512BF16__) && defined(__AVX512VNNI__)
#define CC_SCREEN 1
// x split into two int8 limbs, x ~ sx * (hi + lo / 256), each stored +128 as u8 for
// vpdpbusd (u8 x s8); the +128 comes back out through the row's sum of weights.
struct Limbs {
  alignas(64) uint8_t hi[8192];
  alignas(64) uint8_t lo[8192];
  float sx, x_norm, x_err;  // the scale, |x|, |x - its limbs' value|
};

inline bool make_limbs(const bf16* x, int64_t K, int64_t Kp, Limbs* out) {
  float v[8192], amax = 0.f, sq = 0.f;
  for (int64_t k = 0; k < K; ++k) {
    v[k] = to_f32(x[k]);
    amax = v[k] > amax ? v[k] : (-v[k] > amax ? -v[k] : amax);
    sq += v[k] * v[k];
  }
  if (!(sq < 3e38f)) return false;  // inf or NaN: the full product decides
  const float sx = amax > 0.f ? amax / 127.f : 1.f;
  float err = 0.f;
  for (int64_t k = 0; k < Kp; ++k) {
    const float t = k < K ? v[k] / sx : 0.f;
    const float hi = __builtin_nearbyintf(t);
    float lo = __builtin_nearbyintf((t - hi) * 256.f);
    lo = lo > 127.f ? 127.f : lo;
    out->hi[k] = uint8_t(int(hi) + 128);
    out->lo[k] = uint8_t(int(lo) + 128);
    const float d = k < K ? v[k] - sx * (hi + lo / 256.f) : 0.f;
    err += d * d;
  }
  out->sx = sx, out->x_norm = __builtin_sqrtf(sq), out->x_err = __builtin_sqrtf(err);
  return true;
}

// sum_k (hi_k + 128) * q_k and the same for lo, over Kp (a multiple of 64) int8 weights;
// `ahead`: prefetch as dot_fixed does.
inline void dot_limbs(const Limbs& x, const int8_t* q, int64_t Kp, bool ahead, int32_t* hi,
                      int32_t* lo) {
  __m512i h = _mm512_setzero_si512(), l = _mm512_setzero_si512();
  for (int64_t k = 0; k < Kp; k += 64) {
    if (CC_PREFETCH != 0 && ahead) prefetch_line(q + k);
    const __m512i w = _mm512_loadu_si512(q + k);
    h = _mm512_dpbusd_epi32(h, _mm512_load_si512(x.hi + k), w);
    l = _mm512_dpbusd_epi32(l, _mm512_load_si512(x.lo + k), w);
  }
  *hi = _mm512_reduce_add_epi32(h), *lo = _mm512_reduce_add_epi32(l);
}
#endif

}  // namespace

extern "C" {

void gemv_bf16_f32(const bf16* x, int64_t ldx, const bf16* w, int64_t ldw, float* y,
                   int64_t M, int64_t N, int64_t K, int64_t threads);

// Whether this build has the screened head (`gemv_head_bf16` with argmax_only set).
int64_t gemv_screen_available() {
#if defined(CC_SCREEN)
  return 1;
#else
  return 0;
#endif
}

// The LM head for one row of x, fp32 logits y [N], when the step only takes their argmax
// (greedy, no logprobs: *argmax_only != 0); otherwise (or M > 1) the full product.
//
// Screened: an int8 copy of w (q [N, Kp], per row `meta` = scale, |w - q * scale|, |q *
// scale|, sum of q) bounds every logit; rows whose upper bound cannot reach the largest
// lower bound get -inf, the rest their exact logit from w. A row left out is below some row
// kept even after rounding (`slack` covers both loops' fp32 error), so the argmax -- ties
// included, the first index wins -- is the full product's. Reads the half-size copy, not w:
// ~0.5x the head's bytes (docs/kernel-choices.md, The LM head).
void gemv_head_bf16(const bf16* x, int64_t ldx, const bf16* w, int64_t ldw, float* y,
                    int64_t M, int64_t N, int64_t K, int64_t threads, const int8_t* q,
                    int64_t Kp, const float* meta, int64_t slack_bits,
                    const int64_t* argmax_only) {
#if defined(CC_SCREEN)
  // a float's bits, so a CPU graph records the call as integers
  const float slack_per_norm = bits_to_float(uint32_t(slack_bits));
  Limbs limbs;  // filled before the region, read by the whole team
  if (M == 1 && *argmax_only && Kp <= 8192 && make_limbs(x, K, Kp, &limbs)) {
    const float slack = slack_per_norm * limbs.x_norm + 1e-6f;
    float lower[64];
    const int64_t T = threads < 64 ? threads : 64;
#pragma omp parallel num_threads(T) if (T > 1)
    {
      const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
      const int64_t n0 = N * t / nt, n1 = N * (t + 1) / nt;
      float best = -INFINITY;
      for (int64_t n = n0; n < n1; ++n) {
        int32_t hi, lo;
        dot_limbs(limbs, q + n * Kp, Kp, (n + 1) * Kp + CC_PREFETCH <= n1 * Kp, &hi, &lo);
        const float* m = meta + 4 * n;
        const float off = 128.f * m[3];
        const float approx = limbs.sx * m[0] * ((float(hi) - off) + (float(lo) - off) / 256.f);
        const float bound = limbs.x_norm * m[1] + limbs.x_err * m[2];
        y[n] = approx + bound;
        best = approx - bound > best ? approx - bound : best;
      }
      lower[t] = best;
#pragma omp barrier
      float floor_ = -INFINITY;
      for (int64_t i = 0; i < nt; ++i) floor_ = lower[i] > floor_ ? lower[i] : floor_;
      for (int64_t n = n0; n < n1; ++n)
        y[n] = y[n] + slack >= floor_ ? dot<false>(x, w + n * ldw, K) : -INFINITY;
    }
    return;
  }
#endif
  gemv_bf16_f32(x, ldx, w, ldw, y, M, N, K, threads);
}

// Whether this build has an unrolled copy of the product for rows of length K.
int64_t gemv_unrolled(int64_t K) {
#define CC_DOT(n) \
  if (K == (n)) return 1;
  CC_DOT_SIZES
#undef CC_DOT
  return 0;
}

int64_t gemv_available() {
#if defined(__AVX512BF16__)
  return 1;
#else
  return 0;  // no AVX512-BF16: callers keep Inductor's reduction loop
#endif
}

// x [M, K] (row stride ldx), w [N, K] (row stride ldw), y [M, N] fp32 contiguous.
void gemv_bf16_f32(const bf16* x, int64_t ldx, const bf16* w, int64_t ldw, float* y,
                   int64_t M, int64_t N, int64_t K, int64_t threads) {
#if defined(__AVX512BF16__)
#pragma omp parallel num_threads(threads) if (threads > 1)
  {
    const auto [n0, n1] = share(N);
    for (int64_t n = n0; n < n1; ++n) {
      const bf16* row = w + n * ldw;
      const bool ahead = row + K + CC_PREFETCH / 2 <= w + (n1 - 1) * ldw + K;
      for (int64_t m = 0; m < M; ++m)
        y[m * N + n] = ahead ? dot<true>(x + m * ldx, row, K, reinterpret_cast<const char*>(row) +
                                                                  CC_PREFETCH)
                             : dot<false>(x + m * ldx, row, K);
    }
  }
#endif
}

}  // extern "C"

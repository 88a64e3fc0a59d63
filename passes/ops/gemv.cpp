// y[m, n] = sum_k x[m, k] * w[n, k] for bf16 x and w (both row-major), in fp32: the LM
// head's matrix-vector product at batch 1, on the weight as loaded.
//
// One weight row at a time, so each thread reads one sequential run of rows: interleaving
// rows split the stream and lost ~30% (NOTES section 15). `vdpbf16ps` takes 32 weights
// and 32 x values a load (pairs multiplied exactly, summed in fp32) into four independent
// accumulators, so neither conversions nor one accumulator's latency chain slow a thread
// when memory delivers at its fastest: over the LM head's 56.6 MB this loop read at the
// speed of a plain sum, where Inductor's loop (bf16 -> fp32 conversions, one dependent
// add per 16 weights) read at ~0.75 of it in the same minutes (NOTES section 30).
#include <cstdint>
#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

// Row lengths with an unrolled product (see dot_fixed); none unless the build sets them.
#ifndef CC_DOT_SIZES
#define CC_DOT_SIZES
#endif

namespace {

typedef uint16_t bf16;

#if defined(__AVX512BF16__)
inline __m512bh load(const bf16* p, __mmask32 mask) {
  return (__m512bh)_mm512_maskz_loadu_epi16(mask, p);
}

inline float dot_loop(const bf16* x, const bf16* w, int64_t K) {
  __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(),
                   _mm512_setzero_ps()};
  int64_t k = 0;
  for (; k + 128 <= K; k += 128)
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c)
      acc[c] = _mm512_dpbf16_ps(acc[c], load(w + k + 32 * c, ~0u), load(x + k + 32 * c, ~0u));
  for (; k < K; k += 32) {  // the tail: masked loads read zeros past K
    const __mmask32 mask = K - k >= 32 ? ~0u : (1u << (K - k)) - 1;
    acc[0] = _mm512_dpbf16_ps(acc[0], load(w + k, mask), load(x + k, mask));
  }
  return _mm512_reduce_add_ps(
      _mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3])));
}

// The same row with K known when compiling, fully unrolled: a loop whose exit
// mispredicts once a row (~1 KB) streamed slower in minutes when memory is fast (NOTES
// section 33). gemv.py builds this file per model with the head's row length
// (passes/native.py: `-DCC_DOT_SIZES="CC_DOT(576)"`); other lengths loop.
template <int64_t K>
inline float dot_fixed(const bf16* x, const bf16* w) {
  __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(),
                   _mm512_setzero_ps()};
#pragma GCC unroll 256
  for (int64_t k = 0; k < K / 32 * 32; k += 32)
    acc[k / 32 % 4] = _mm512_dpbf16_ps(acc[k / 32 % 4], load(w + k, ~0u), load(x + k, ~0u));
  if constexpr (K % 32 != 0) {
    const __mmask32 mask = (1u << (K % 32)) - 1;
    acc[0] = _mm512_dpbf16_ps(acc[0], load(w + K / 32 * 32, mask), load(x + K / 32 * 32, mask));
  }
  return _mm512_reduce_add_ps(
      _mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3])));
}

inline float dot(const bf16* x, const bf16* w, int64_t K) {
#define CC_DOT(n) \
  if (K == (n)) return dot_fixed<(n)>(x, w);
  CC_DOT_SIZES
#undef CC_DOT
  return dot_loop(x, w, K);
}

#endif

}  // namespace

extern "C" {

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
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
  for (int64_t n = 0; n < N; ++n)
    for (int64_t m = 0; m < M; ++m) y[m * N + n] = dot(x + m * ldx, w + n * ldw, K);
#endif
}

}  // extern "C"

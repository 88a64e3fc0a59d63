// One row's product x . w over bf16 weights, for the batch-1 products of the layer kernels
// (`layer_kernels.cpp`: fp32 x, fused multiply-adds) and of the LM head (`gemv.cpp`: bf16
// x, `vdpbf16ps`): one engine, two lane types (`Lanes<X>`).
//
// With K known when compiling (`CC_DOT_SIZES`, one build per model: passes/native.py), the
// row is fully unrolled over four independent accumulators: a loop that exits after every
// row (~1 KB) streamed ~10% slower in minutes when memory is fast, and one accumulator's
// chain of adds caps a core near the rate such a minute delivers (docs/kernel-choices.md,
// Quantized row products). PF: prefetch CC_PREFETCH bytes ahead, one cache line at a time,
// into L2 (a prefetch into L1 as well read slower; docs/kernel-choices.md, Prefetch).
// Other lengths loop (`dot_loop`, each lane type its own). Each caller's arithmetic is
// what it was before the two shared this file (objdump identical).
#pragma once
#include "cc_common.h"
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

// Row lengths with an unrolled product; none unless the build sets them.
#ifndef CC_DOT_SIZES
#define CC_DOT_SIZES
#endif
// How far ahead of its loads a product asks for weights (bytes), or 0; set by the build
// (passes/native.py: 4 KB on Intel CPUs).
#ifndef CC_PREFETCH
#define CC_PREFETCH 0
#endif

namespace {

#if defined(__AVX512F__)
inline __m512 load16(const bf16* p) {
  __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

inline void prefetch_line(const void* p) {
  _mm_prefetch(static_cast<const char*>(p) + CC_PREFETCH, _MM_HINT_T2);
}
#endif

template <typename X>
struct Lanes;

#if defined(__AVX512F__)
// fp32 x: 16 values a step, fused multiply-adds; the tail after the reduction, scalar.
template <>
struct Lanes<float> {
  static constexpr int64_t N = 16;
  static __m512 step(__m512 acc, const float* x, const bf16* w) {
    return _mm512_fmadd_ps(_mm512_loadu_ps(x), load16(w), acc);
  }
  static __m512 tail_in(__m512 acc, const float*, const bf16*, int64_t) { return acc; }
  static float tail_out(float sum, const float* x, const bf16* w, int64_t n) {
    for (int64_t k = 0; k < n; ++k) sum += x[k] * to_f32(w[k]);
    return sum;
  }
};
#endif

#if defined(__AVX512BF16__)
inline __m512bh load_bf16(const bf16* p, __mmask32 mask) {
  return (__m512bh)_mm512_maskz_loadu_epi16(mask, p);
}

// bf16 x: 32 pairs a step multiplied exactly and summed in fp32 (`vdpbf16ps`); the tail
// as one masked step before the reduction (masked loads read zeros).
template <>
struct Lanes<bf16> {
  static constexpr int64_t N = 32;
  static __m512 step(__m512 acc, const bf16* x, const bf16* w) {
    return _mm512_dpbf16_ps(acc, load_bf16(w, ~0u), load_bf16(x, ~0u));
  }
  static __m512 tail_in(__m512 acc, const bf16* x, const bf16* w, int64_t n) {
    const __mmask32 mask = (1u << n) - 1;
    return _mm512_dpbf16_ps(acc, load_bf16(w, mask), load_bf16(x, mask));
  }
  static float tail_out(float sum, const bf16*, const bf16*, int64_t) { return sum; }
};

// A row whose length K is known only when running: four accumulators over 128 values.
inline float dot_loop(const bf16* x, const bf16* w, int64_t K) {
  __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(),
                   _mm512_setzero_ps()};
  int64_t k = 0;
  for (; k + 128 <= K; k += 128)
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c)
      acc[c] = _mm512_dpbf16_ps(acc[c], load_bf16(w + k + 32 * c, ~0u),
                                load_bf16(x + k + 32 * c, ~0u));
  for (; k < K; k += 32) {  // the tail: masked loads read zeros past K
    const __mmask32 mask = K - k >= 32 ? ~0u : (1u << (K - k)) - 1;
    acc[0] = _mm512_dpbf16_ps(acc[0], load_bf16(w + k, mask), load_bf16(x + k, mask));
  }
  return _mm512_reduce_add_ps(
      _mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3])));
}
#endif

// fp32 x, K known only when running: one accumulator (portable past AVX-512's loop).
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

// The row with K known when compiling; `pf`: the weights CC_PREFETCH bytes ahead of w.
template <typename X, int64_t K, bool PF>
inline float dot_fixed(const X* x, const bf16* w, const char* pf) {
#if defined(__AVX512F__)
  using L = Lanes<X>;
  constexpr int64_t body = K / L::N * L::N;
  __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(),
                   _mm512_setzero_ps()};
#pragma GCC unroll 256
  for (int64_t k = 0; k < body; k += L::N) {
    if (PF && (2 * k) % 64 == 0) _mm_prefetch(pf + 2 * k, _MM_HINT_T2);
    acc[k / L::N % 4] = L::step(acc[k / L::N % 4], x + k, w + k);
  }
  if constexpr (K % L::N != 0) acc[0] = L::tail_in(acc[0], x + body, w + body, K % L::N);
  const float sum = _mm512_reduce_add_ps(
      _mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3])));
  if constexpr (K % L::N != 0) return L::tail_out(sum, x + body, w + body, K % L::N);
  return sum;
#else
  return dot_loop(x, w, K);
#endif
}

// x . w over K values; `pf` as dot_fixed's (PF: prefetch, where the build sets a distance).
template <bool PF, typename X>
inline float dot(const X* x, const bf16* w, int64_t K, const char* pf = nullptr) {
#define CC_DOT(n) \
  if (K == (n)) return dot_fixed<X, (n), PF && CC_PREFETCH != 0>(x, w, pf);
  CC_DOT_SIZES
#undef CC_DOT
  return dot_loop(x, w, K);
}

}  // namespace

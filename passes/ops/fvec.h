// Float vectors for the CPU attention kernels (runtime/attention/cpu_kernels.cpp,
// cpu_prefill.cpp) in GCC's vector extensions, so the source stays portable: bf16 <-> fp32
// as torch rounds, loads, horizontal sums and maxima, and exp.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>

namespace {

using bf16 = uint16_t;

inline float to_float(float x) { return x; }
inline float to_float(bf16 x) {
  uint32_t bits = uint32_t(x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

inline void store(float* dst, float x) { *dst = x; }
inline void store(bf16* dst, float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  if ((bits & 0x7fffffffu) > 0x7f800000u) {  // NaN stays a (quiet) NaN
    *dst = bf16((bits >> 16) | 0x40);
    return;
  }
  bits += 0x7fffu + ((bits >> 16) & 1u);  // round to nearest even, as torch does
  *dst = bf16(bits >> 16);
}

// The widest native vector of floats: W lanes. GCC's 16-float vectors, which an AVX2 build
// splits in pairs, went through memory there: decode 2.3-6.7x and prefill 16x slower than
// this width (both built for haswell on a Zen 4; docs/kernel-choices.md, Prefill attention).
#if defined(__AVX512F__)
constexpr int64_t W = 16;
#else
constexpr int64_t W = 8;
#endif
typedef float vf __attribute__((vector_size(W * 4)));
typedef int32_t vi __attribute__((vector_size(W * 4)));
typedef uint16_t vh __attribute__((vector_size(W * 2)));
typedef uint32_t vu __attribute__((vector_size(W * 4)));

inline vf loadv(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline vf loadv(const bf16* p) {
  vh half;
  std::memcpy(&half, p, sizeof half);
  const vu bits = __builtin_convertvector(half, vu) << 16;
  vf v;
  std::memcpy(&v, &bits, sizeof v);
  return v;
}
typedef float f32x8 __attribute__((vector_size(32)));
typedef float f32x4 __attribute__((vector_size(16)));

// W lanes folded to 8 (a no-op at W = 8): the two halves combined by `op`.
template <typename Op>
inline f32x8 fold8(vf v, Op op) {
#if defined(__AVX512F__)
  return op(__builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7),
            __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15));
#else
  (void)op;
  return v;
#endif
}

inline float hsum(vf v) {
  const f32x8 a = fold8(v, [](f32x8 x, f32x8 y) { return x + y; });
  f32x4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  b += __builtin_shufflevector(b, b, 2, 3, 0, 1);
  b += __builtin_shufflevector(b, b, 1, 0, 3, 2);
  return b[0];
}

inline float hmax(vf v) {
  const f32x8 a = fold8(v, [](f32x8 x, f32x8 y) { return x > y ? x : y; });
  const f32x4 b1 = __builtin_shufflevector(a, a, 0, 1, 2, 3);
  const f32x4 b2 = __builtin_shufflevector(a, a, 4, 5, 6, 7);
  float m = -INFINITY;
  for (int i = 0; i < 4; ++i) m = b1[i] > m ? b1[i] : m, m = b2[i] > m ? b2[i] : m;
  return m;
}

// exp for x <= 0 in fp32: 2^n * p(r) with r = x - n ln 2 in [-ln2 / 2, ln2 / 2] and p the
// degree-6 Taylor polynomial (relative error ~2e-7); below -87 (and -inf) it is exactly 0.
// A scalar libm call per score cost more than the dot products it follows.
template <typename V>  // vf, or any GCC vector of floats
inline V vexp(V x) {
  typedef int32_t IV __attribute__((vector_size(sizeof(V))));
  const IV underflow = x < -87.f;
  x = x < -87.f ? V{} - 87.f : x;
  // Round x / ln 2 to nearest by truncating (x / ln 2 - 1/2): valid as x <= 0. (-ffast-math
  // would fold the usual add-and-subtract-a-magic-number trick away.)
  const IV ni = __builtin_convertvector(x * 1.44269504f - 0.5f, IV);
  const V n = __builtin_convertvector(ni, V);
  const V r = (x - n * 0.693145752f) - n * 1.42860677e-6f;
  V p = V{} + (1.f / 720);
  p = p * r + (1.f / 120);
  p = p * r + (1.f / 24);
  p = p * r + (1.f / 6);
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  const IV bits = (ni + 127) << 23;
  V scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return underflow ? V{} : p * scale;
}

}  // namespace

// 16-float vectors in GCC's vector extensions for the CPU attention kernels
// (runtime/attention/cpu_kernels.cpp, cpu_prefill.cpp): one AVX-512 register with
// -march=native on an AVX-512 CPU, two AVX2 ones elsewhere (GCC splits them), so the
// source stays portable. bf16 <-> fp32 as torch rounds, loads, horizontal sums and maxima,
// and exp.
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

typedef float f32x16 __attribute__((vector_size(64)));
typedef uint16_t u16x16 __attribute__((vector_size(32)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));

inline f32x16 load16(const float* p) {
  f32x16 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline f32x16 load16(const bf16* p) {
  u16x16 half;
  std::memcpy(&half, p, sizeof half);
  const u32x16 bits = __builtin_convertvector(half, u32x16) << 16;
  f32x16 v;
  std::memcpy(&v, &bits, sizeof v);
  return v;
}
typedef float f32x8 __attribute__((vector_size(32)));
typedef float f32x4 __attribute__((vector_size(16)));

inline float hsum(f32x16 v) {
  const f32x8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                  __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  f32x4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  b += __builtin_shufflevector(b, b, 2, 3, 0, 1);
  b += __builtin_shufflevector(b, b, 1, 0, 3, 2);
  return b[0];
}

inline float hmax(f32x16 v) {
  const f32x8 a1 = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7);
  const f32x8 a2 = __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  const f32x8 a = a1 > a2 ? a1 : a2;
  const f32x4 b1 = __builtin_shufflevector(a, a, 0, 1, 2, 3);
  const f32x4 b2 = __builtin_shufflevector(a, a, 4, 5, 6, 7);
  float m = -INFINITY;
  for (int i = 0; i < 4; ++i) m = b1[i] > m ? b1[i] : m, m = b2[i] > m ? b2[i] : m;
  return m;
}

// exp for x <= 0 in fp32: 2^n * p(r) with r = x - n ln 2 in [-ln2 / 2, ln2 / 2] and p the
// degree-6 Taylor polynomial (relative error ~2e-7); below -87 (and -inf) it is exactly 0.
// A scalar libm call per score cost more than the dot products it follows.
template <typename V>  // f32x16, or any GCC vector of floats
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

// exp on 16 floats with AVX-512, shared by the kernels that need it (SiLU in
// layer_kernels.cpp, the softmax of runtime/attention/cpu_prefill.cpp).
#pragma once

#if defined(__AVX512F__)
#include <immintrin.h>

namespace {

// exp to ~2 ulp of fp32 (range reduction by ln 2, degree-6 polynomial), clamped to
// +-88.3: glibc's scalar exp, a call per value, cost more than the loops it sat in.
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

}  // namespace

#endif

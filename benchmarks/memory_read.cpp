// A sum over n floats on `threads` threads, each over its own contiguous part, four
// accumulators, optionally with a software prefetch `prefetch` bytes ahead (a line at a
// time, into L2). The ceiling's read at its fastest: on the AMX Xeon the engine's products
// read at a plain sum's speed only with such a prefetch, and the same prefetch also
// speeds up a sum a little, so a ceiling measured only by torch's sum would flatter the
// engine (docs/kernel-choices.md, Prefetch).
#include <cstdint>
#include <omp.h>
#if defined(__AVX512F__)
#include <immintrin.h>

extern "C" float memory_read_sum(const float* p, int64_t n, int64_t threads, int64_t prefetch) {
  float parts[256] = {0.f};
  const int64_t T = threads < 256 ? (threads > 0 ? threads : 1) : 256;
#pragma omp parallel num_threads(T)
  {
    const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
    const int64_t i0 = n * t / nt / 64 * 64, i1 = t + 1 == nt ? n : n * (t + 1) / nt / 64 * 64;
    __m512 s0 = _mm512_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
    int64_t i = i0;
    for (; i + 64 <= i1; i += 64) {
      if (prefetch > 0) {  // the same every iteration: predicted, no cost without it
        const char* ahead = reinterpret_cast<const char*>(p + i) + prefetch;
        for (int line = 0; line < 4; ++line) _mm_prefetch(ahead + 64 * line, _MM_HINT_T2);
      }
      s0 = _mm512_add_ps(s0, _mm512_loadu_ps(p + i));
      s1 = _mm512_add_ps(s1, _mm512_loadu_ps(p + i + 16));
      s2 = _mm512_add_ps(s2, _mm512_loadu_ps(p + i + 32));
      s3 = _mm512_add_ps(s3, _mm512_loadu_ps(p + i + 48));
    }
    float rest = 0.f;
    for (; i < i1; ++i) rest += p[i];
    parts[t] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(s0, s1), _mm512_add_ps(s2, s3))) + rest;
  }
  float total = 0.f;
  for (int64_t t = 0; t < T; ++t) total += parts[t];
  return total;
}
#endif

// Whether this build can run (AVX-512F); callers keep torch's sum otherwise.
extern "C" int64_t memory_read_available() {
#if defined(__AVX512F__)
  return 1;
#else
  return 0;
#endif
}

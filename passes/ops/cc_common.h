// What every kernel source shares: bf16 <-> fp32 as torch rounds, a thread's share of
// an OpenMP team's work, a thread's scratch. passes/native.py pastes this file where a
// source includes it, so a build's cache key changes when this file does.
#pragma once
#include <cstdint>
#include <cstring>
#include <omp.h>

namespace {

typedef uint16_t bf16;

// A float from its bits (also how a float argument arrives as a recorded integer).
inline float bits_to_float(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline float to_f32(bf16 v) { return bits_to_float(uint32_t(v) << 16); }

inline bf16 to_bf16(float f) {  // round to nearest even, as torch does
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return bf16((bits >> 16) | 0x40);  // NaN stays NaN
  return bf16((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

inline float round_bf16(float f) { return to_f32(to_bf16(f)); }

// [begin, end) of n items for the calling thread of its team.
struct Share {
  int64_t begin, end;
};
inline Share share(int64_t n) {
  const int64_t t = omp_get_thread_num(), T = omp_get_num_threads();
  return {n * t / T, n * (t + 1) / T};
}

// The smallest run of weight rows, as a count of rows, that `schedule(guided, ...)` hands a
// thread: 16 KB, so each run is a stream the prefetcher follows. Why guided and not a
// static half each: which of two threads finishes a product first changes from call to call
// (the memory serves them unevenly), and the other waited at the barrier after it; guided
// hands out half, then a quarter, ... and the first thread done takes what is left, a
// handful of shared counter updates a product (a Q8_0 batch-1 step 1.06-1.10x in a slow
// hour, 1.00x in a fast one; fixed chunks had lost: docs/kernel-choices.md, Quantized row
// products).
inline int64_t guided_rows(int64_t row_bytes) {
  return 16384 / row_bytes > 1 ? 16384 / row_bytes : 1;
}

// A thread's fp32 scratch of at least n floats (grows, never shrinks; one per thread).
inline float* scratch(int64_t n) {
  thread_local float* buf = nullptr;
  thread_local int64_t size = 0;
  if (n > size) {
    delete[] buf;
    buf = new float[n];
    size = n;
  }
  return buf;
}

}  // namespace

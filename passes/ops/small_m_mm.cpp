// y[M, N] = x[M, K] @ w[N, K]^T in bf16 with fp32 accumulation, for a decode batch of a
// few rows (M <= 8): each weight row is read once, in order, for all M rows of x (which
// stay in L1), so the weights stream at close to memory bandwidth. Each thread takes one
// contiguous band of weight rows. Rounded to bf16 (nearest even) at the end.
#include <cstdint>
#include <cstring>
#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace {

typedef uint16_t bf16;

inline bf16 to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return bf16((u >> 16) | 0x40);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return bf16(u >> 16);
}

#if defined(__AVX512BF16__)
template <int M>
inline void weight_row(const bf16* x, int64_t ldx, const bf16* w, bf16* y, int64_t ldy,
                       int64_t K) {
  // Two accumulators per row of x (even and odd chunks of K): half the dependency chain.
  __m512 acc[M], odd[M];
  for (int m = 0; m < M; ++m) acc[m] = odd[m] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 64 <= K; k += 64) {
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(w + k);
    const __m512bh w1 = (__m512bh)_mm512_loadu_si512(w + k + 32);
    for (int m = 0; m < M; ++m) {
      acc[m] = _mm512_dpbf16_ps(acc[m], (__m512bh)_mm512_loadu_si512(x + m * ldx + k), w0);
      odd[m] = _mm512_dpbf16_ps(odd[m], (__m512bh)_mm512_loadu_si512(x + m * ldx + k + 32), w1);
    }
  }
  for (int m = 0; m < M; ++m) acc[m] = _mm512_add_ps(acc[m], odd[m]);
  for (; k + 32 <= K; k += 32) {
    const __m512bh wv = (__m512bh)_mm512_loadu_si512(w + k);
    for (int m = 0; m < M; ++m)
      acc[m] = _mm512_dpbf16_ps(acc[m], (__m512bh)_mm512_loadu_si512(x + m * ldx + k), wv);
  }
  if (k < K) {  // the last K % 32 columns, zero-padded
    const __mmask32 mask = __mmask32((1ull << (K - k)) - 1);
    const __m512bh wv = (__m512bh)_mm512_maskz_loadu_epi16(mask, w + k);
    for (int m = 0; m < M; ++m)
      acc[m] = _mm512_dpbf16_ps(acc[m], (__m512bh)_mm512_maskz_loadu_epi16(mask, x + m * ldx + k), wv);
  }
  for (int m = 0; m < M; ++m) y[m * ldy] = to_bf16(_mm512_reduce_add_ps(acc[m]));
}

template <int M>
void band(const bf16* x, int64_t ldx, const bf16* w, int64_t ldw, bf16* y, int64_t ldy,
          int64_t N, int64_t K, int64_t threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
  for (int64_t n = 0; n < N; ++n) weight_row<M>(x, ldx, w + n * ldw, y + n, ldy, K);
}
#endif

}  // namespace

extern "C" {

int64_t small_m_max_rows() {
#if defined(__AVX512BF16__)
  return 8;
#else
  return 0;  // no AVX512-BF16 here: callers use oneDNN
#endif
}

void small_m_mm_bf16(const bf16* x, int64_t ldx, const bf16* w, int64_t ldw, bf16* y,
                     int64_t ldy, int64_t M, int64_t N, int64_t K, int64_t threads) {
#if defined(__AVX512BF16__)
  switch (M) {
#define ROWS(R) \
  case R:       \
    return band<R>(x, ldx, w, ldw, y, ldy, N, K, threads);
    ROWS(1) ROWS(2) ROWS(3) ROWS(4) ROWS(5) ROWS(6) ROWS(7) ROWS(8)
#undef ROWS
  }
#endif
}

}  // extern "C"

// y[M, N] = x[M, K] @ w[N, K]^T in bf16 with fp32 accumulation, on a weight packed once
// for `vdpbf16ps` (AVX512-BF16):
//
//   packed[nb][kp][j][e] = w[16 * nb + j][2 * kp + e]    (zero past N and K)
//
// so one 64-byte load is the k-pair kp of 16 output columns, and one instruction adds
// x[m][2kp] * w[n][2kp] + x[m][2kp + 1] * w[n][2kp + 1] into 16 fp32 lanes for one row m,
// with the x pair broadcast from memory ({1to16}). A tile is up to 16 rows of x against
// one block of 16 columns: 16 accumulators, no horizontal sums, each weight load used by
// every row. Each thread takes a contiguous run of column blocks (one sequential stream
// of the packed weight) and runs all row tiles on a block while it is in L1/L2. x is
// first repacked k-pair-major ([tile][kp][row]) so a tile's broadcasts come from one
// cache line per k-pair. Rounded to bf16 (nearest even) at the end.
#include <algorithm>
#include <array>
#include <utility>
#include <vector>

#include "cc_common.h"
#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace {
constexpr int64_t kRows = 16;  // rows of x per tile
constexpr int64_t kCols = 16;  // output columns per block: one zmm of fp32

#if defined(__AVX512BF16__)
template <int MR>
inline void tile(const int32_t* xp, const bf16* wp, const bf16* bias, bf16* y, int64_t ldy,
                 int64_t kp_count, int64_t cols) {
  // Every loop over m fully unrolled, so the accumulators live in registers.
  __m512 acc[MR];
#pragma GCC unroll 16
  for (int m = 0; m < MR; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t kp = 0; kp < kp_count; ++kp) {
    const __m512 wv = _mm512_castsi512_ps(_mm512_loadu_si512(wp + kp * 2 * kCols));
    const int32_t* xk = xp + kp * MR;
#pragma GCC unroll 16
    for (int m = 0; m < MR; ++m)
      // The broadcast folded into the instruction: gcc emits a separate vpbroadcastd for
      // _mm512_set1_epi32, which cost ~20% at 16 rows.
      asm("vdpbf16ps %2%{1to16%}, %1, %0" : "+v"(acc[m]) : "v"(wv), "m"(xk[m]));
  }
  const __mmask16 mask = cols >= kCols ? __mmask16(0xffff) : __mmask16((1u << cols) - 1);
  if (bias) {  // added in fp32 before the one rounding, as addmm does
    const __m256i raw = _mm256_maskz_loadu_epi16(mask, bias);
    const __m512 b = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
#pragma GCC unroll 16
    for (int m = 0; m < MR; ++m) acc[m] = _mm512_add_ps(acc[m], b);
  }
#pragma GCC unroll 16
  for (int m = 0; m < MR; ++m)
    _mm256_mask_storeu_epi16(y + m * ldy, mask, (__m256i)_mm512_cvtneps_pbh(acc[m]));
}

typedef void (*tile_fn)(const int32_t*, const bf16*, const bf16*, bf16*, int64_t, int64_t,
                        int64_t);

template <int... R>
constexpr auto tiles(std::integer_sequence<int, R...>) {
  return std::array<tile_fn, sizeof...(R)>{tile<R + 1>...};
}
#endif

}  // namespace

extern "C" {

int64_t packed_mm_available() {
#if defined(__AVX512BF16__)
  return 1;
#else
  return 0;  // no AVX512-BF16 here: callers use oneDNN
#endif
}

// Elements of the packed copy of an [N, K] weight.
int64_t packed_mm_numel(int64_t N, int64_t K) {
  return (N + kCols - 1) / kCols * ((K + 1) / 2) * 2 * kCols;
}

void packed_mm_pack(const bf16* w, int64_t ldw, int64_t N, int64_t K, bf16* out,
                    int64_t threads) {
  const int64_t blocks = (N + kCols - 1) / kCols, kps = (K + 1) / 2;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
  for (int64_t nb = 0; nb < blocks; ++nb)
    for (int64_t kp = 0; kp < kps; ++kp)
      for (int64_t j = 0; j < kCols; ++j)
        for (int64_t e = 0; e < 2; ++e) {
          const int64_t n = nb * kCols + j, k = 2 * kp + e;
          out[((nb * kps + kp) * kCols + j) * 2 + e] = (n < N && k < K) ? w[n * ldw + k] : 0;
        }
}

// y = x @ w^T (+ bias, null or [N]) on the packed copy of w.
void packed_mm_bf16(const bf16* x, int64_t ldx, const bf16* wp, const bf16* bias, bf16* y,
                    int64_t ldy, int64_t M, int64_t N, int64_t K, int64_t threads) {
#if defined(__AVX512BF16__)
  static const auto kTiles = tiles(std::make_integer_sequence<int, kRows>{});
  const int64_t kps = (K + 1) / 2, blocks = (N + kCols - 1) / kCols;
  const int64_t row_tiles = (M + kRows - 1) / kRows;
  thread_local std::vector<int32_t> buffer;
  buffer.resize(row_tiles * kps * kRows);
  int32_t* xp = buffer.data();
#pragma omp parallel num_threads(threads) if (threads > 1)
  {
#pragma omp for schedule(static)
    for (int64_t kp = 0; kp < kps; ++kp)
      for (int64_t m = 0; m < M; ++m) {
        const int64_t t = m / kRows, rows = std::min(kRows, M - t * kRows);
        const uint32_t lo = x[m * ldx + 2 * kp];
        const uint32_t hi = 2 * kp + 1 < K ? x[m * ldx + 2 * kp + 1] : 0;
        xp[t * kps * kRows + kp * rows + m % kRows] = int32_t(lo | (hi << 16));
      }
#pragma omp for schedule(static)
    for (int64_t nb = 0; nb < blocks; ++nb)
      for (int64_t t = 0; t < row_tiles; ++t) {
        const int64_t rows = std::min(kRows, M - t * kRows);
        kTiles[rows - 1](xp + t * kps * kRows, wp + nb * kps * 2 * kCols,
                         bias ? bias + nb * kCols : nullptr, y + t * kRows * ldy + nb * kCols,
                         ldy, kps, N - nb * kCols);
      }
  }
#endif
}

}  // extern "C"

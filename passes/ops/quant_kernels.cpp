// Products with block-quantized weights for a few activation rows:
// y [M, N] = x [M, K] @ dequantize(w)^T (+ bias); `flags` bit 0: x and bias are bf16 (else
// fp32), bit 1: y is bf16 (else fp32), bit 2: scales and mins are fp32 (else fp16), bit 4:
// they are stored compact, as Q4_K's (q4) or Q6_K's (q8) super-blocks hold them
// (`CompactScales` below), bit 5: x may be quantized to int8 (Q8_0's products: `Strip8`,
// q4's row products: `row_product_q4_int8`), bit 6: q8's values are Q6_K's, packed in 6
// bits (`unpack_q6_row`).
//
// The two weight formats (passes/ops/quantized.py holds their torch reference):
//   q4: w uint8 [N, K/2]; in each run of 32 values byte j holds value j in its low nibble
//       and value j + 16 in its high one (GGUF's Q4_0 / Q4_1 order); scales and mins fp16
//       or fp32 [N, K/g]; value = scale * q + min. GGUF Q4_1 as stored, Q4_0 with min =
//       -8 scale, Q4_K with fp32 scales and mins (its nibbles reordered at load).
//   q8: w int8 [N, K], scales fp16 or fp32 [N, K/g]; value = scale * q. GGUF Q8_0 (g =
//       32), int8 per output channel (g = K); Q6_K (g = 16, compact scales, q - 32) with
//       w uint8 [N, 3K/4], its 6-bit values packed as `unpack_q6_row` reads them.
// Three paths. fp32 activations: every value dequantized in fp32 exactly as the reference
// does (scale * q is exact, one rounding for the min), products summed in fp32. bf16
// activations with AVX512-BF16: exact products of the weights' integers (q4's nibbles, q8's
// bytes: both exact in bf16) and the activations, summed in fp32 (below). Without
// AVX512-BF16 but with AVX512-VNNI: activations quantized to int8 per run of 32, as
// llama.cpp does (a bound tested in tests/test_quantized.py). With AVX2 + FMA and no
// AVX-512: the fp32 path, its products factored (`row_product_q4_sums`, `row_product_q8`),
// and Q8_0's 1-2 rows on int8 activations where the caller allows them
// (`row_product_q8_int8`).
//
// Like layer_kernels.cpp, each `*_team` function runs on every thread of a parallel region
// and takes its share of the weight rows (one sequential weight stream a thread), so a CPU
// graph can call it inside one OpenMP team; `*_region` opens a region for eager calls.
#include "cc_common.h"

#include <type_traits>
#if defined(__AVX512F__) || defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

namespace {

typedef uint16_t f16;

inline float f16_f32(f16 h) {  // IEEE half -> float, subnormals included
  const uint32_t sign = uint32_t(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
  if (exp == 0x1f) return bits_to_float(sign | 0x7f800000u | (man << 13));
  if (exp != 0) return bits_to_float(sign | ((exp + 112) << 23) | (man << 13));
  const float sub = float(man) * (1.f / 16777216.f);  // man * 2^-24
  return sign ? -sub : sub;
}

// Scales and mins are fp16 (GGUF's Q4_0, Q4_1, Q8_0; our int4 and int8) or fp32 (the
// K-quants': a super-block scale times a sub-block's 6-bit one, exact in fp32, not in fp16).
#if defined(__F16C__)
inline float scale1(f16 h) { return _cvtsh_ss(h); }
#else
inline float scale1(f16 h) { return f16_f32(h); }
#endif
inline float scale1(float f) { return f; }
#if defined(__AVX512F__)
inline __m512 scales16(const f16* s, __mmask16 live) {
  return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(live, s));
}
inline __m512 scales16(const float* s, __mmask16 live) { return _mm512_maskz_loadu_ps(live, s); }
#endif

// Scales (or mins) as the K-quants store them (compact): per row `groups` sub-block
// scales as bytes, then one fp32 super-block scale per super-block. Q4_K (q4): 6-bit
// unsigned bytes, 8 groups of 32 a super-block; Q6_K (q8): int8 bytes, 16 groups of 16.
// super x sub is exact in fp32, the values fp32 fields would hold, at ~0.09 (Q4_K, scales
// and mins) or ~0.08 (Q6_K) bytes a value where fp32 fields take 0.25.
// `CompactPtr` points into one row and stands for its decoded values where a pointer to
// them would (`p + i`, `p[i]`, `scales16`): the bf16 row products read rows in place
// (decoding each row into a buffer first made Q4_K's products 1.04-1.11x slower, NOTES
// 54); `CompactScales` decodes rows into a buffer for the other paths and the strips.
template <bool Q4>
struct CompactPtr {
  static constexpr int64_t PER_SUPER = Q4 ? 8 : 16;  // groups a super-block
  const uint8_t* sub;    // the row's sub-block bytes
  const uint8_t* super;  // then its fp32 super-block scales
  int64_t at;            // the group this points at
  // A row's bytes: its sub-block bytes, then an fp32 scale a super-block.
  static int64_t row_bytes(int64_t groups) { return groups + groups / PER_SUPER * 4; }
  CompactPtr operator+(int64_t i) const { return {sub, super, at + i}; }
  float operator[](int64_t i) const {
    float d;
    std::memcpy(&d, super + (at + i) / PER_SUPER * 4, sizeof d);
    return d * (Q4 ? float(sub[at + i]) : float(int8_t(sub[at + i])));
  }
};

#if defined(__AVX512F__) && defined(__AVX512BW__)
#define CC_COMPACT16 1
// 16 groups from a multiple of 16 (every caller's step): two super-blocks of Q4_K's, one
// of Q6_K's.
template <bool Q4>
inline __m512 scales16(CompactPtr<Q4> p, __mmask16 live) {
  const __m128i bytes = _mm_maskz_loadu_epi8(live, p.sub + p.at);
  const __m512 sub =
      _mm512_cvtepi32_ps(Q4 ? _mm512_cvtepu8_epi32(bytes) : _mm512_cvtepi8_epi32(bytes));
  const float* d = reinterpret_cast<const float*>(p.super) + p.at / CompactPtr<Q4>::PER_SUPER;
  if constexpr (Q4) {
    const __m512 two = _mm512_maskz_loadu_ps(live >> 8 ? 0x3 : 0x1, d);
    const __m512i pick = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    return _mm512_mul_ps(sub, _mm512_permutexvar_ps(pick, two));
  } else {
    float d0;
    std::memcpy(&d0, d, sizeof d0);
    return _mm512_mul_ps(sub, _mm512_set1_ps(d0));
  }
}
#else
#define CC_COMPACT16 0
#endif

// Rows [n, n + count) decoded into buf as fp32 [count, groups].
template <bool Q4>
struct CompactScales {
  const uint8_t* base;
  int64_t groups;
  const float* rows(int64_t n, int64_t count, float* buf) const {
    const int64_t stride = CompactPtr<Q4>::row_bytes(groups);
    for (int64_t r = 0; r < count; ++r) {
      const uint8_t* row = base + (n + r) * stride;
      const CompactPtr<Q4> p{row, row + groups, 0};
      float* out = buf + r * groups;
      int64_t gi = 0;
#if CC_COMPACT16
      for (; gi + 16 <= groups; gi += 16) _mm512_storeu_ps(out + gi, scales16(p + gi, 0xffff));
#endif
      for (; gi < groups; ++gi) out[gi] = p[gi];
    }
    return buf;
  }
};

// Rows [n, n + count) of a call's scales (or mins): a pointer into stored ones, or compact
// ones (S = float, `base` their address) decoded into buf.
template <bool Q4, bool Compact, typename S>
inline const S* scale_rows(const S* base, int64_t groups, int64_t n, int64_t count,
                           float* buf) {
  if constexpr (Compact)
    return CompactScales<Q4>{reinterpret_cast<const uint8_t*>(base), groups}.rows(n, count,
                                                                                  buf);
  else
    return base + n * groups;
}

inline void load_rows(const void* x, bool bf, float* out, int64_t n) {
  if (!bf) {
    std::memcpy(out, x, n * sizeof(float));
    return;
  }
  for (int64_t i = 0; i < n; ++i) out[i] = to_f32(static_cast<const bf16*>(x)[i]);
}

// Up to 4 rows of x at a time against one weight row: MB accumulators of 16 lanes.
constexpr int MB_MAX = 4;
// The bf16 paths take 16 weight rows at a time (strips, below) from TILED_ROWS_* rows of x.
constexpr int TILE_N = 16;
// Rows of x from which the strips beat the row product (raw A/B, NOTES 49): q8 1.26x at
// 6 rows, 0.90x at 4; q4 0.93x at 6, 1.04x at 8.
constexpr int64_t TILED_ROWS_Q8 = 6, TILED_ROWS_Q4 = 8;
// Rows of x up to which Q8_0's row products may take int8 activations (`int8_x`): raw
// A/B against the exact ones (NOTES 55), 1.7B shapes 1.01x / 0.98x / 0.95x / 0.82x /
// 0.91x at 1-5 rows, 135M shapes 1.16x / 1.14x at 1-2, 0.96x at 4.
constexpr int64_t INT8_ROWS_Q8 = 2;
// log2 of q4's runs a group (bf16 path: 1, 2, 4 ... 16).
inline int runs_shift(int64_t g) {
  int shift = 0;
  while ((32 << shift) < g) ++shift;
  return shift;
}

// Q6_K's 6-bit rows (passes/ops/quantized.py `pack_q6` writes them): per chunk of 128
// values, 64 bytes of low nibbles in q4's order (nibble byte b = 16r + j: run r's value j
// low, j + 16 high), then 32 bytes of the values' top two bits, top byte b % 32 holding
// nibble byte b's low value's in bits 0-1 (b < 32) or 2-3 (b >= 32) and its high value's
// in bits 4-5 or 6-7. A value is u - 32 (Q6_K's own offset). The row products read chunks
// in place (`row_product_q6_bf16`, `row_product_q6_int8`); the other paths read rows
// unpacked to int8 by this.
inline void unpack_q6_row(const uint8_t* w, int64_t K, int8_t* out) {
  for (int64_t c = 0; c < K / 128; ++c) {
    const uint8_t *nib = w + c * 96, *top = nib + 64;
    int8_t* o = out + c * 128;
    for (int b = 0; b < 64; ++b) {
      const int e = 2 * (b / 32), at = b / 16 * 32 + b % 16;
      o[at] = int8_t(((nib[b] & 15) | ((top[b % 32] >> e & 3) << 4)) - 32);
      o[at + 16] = int8_t(((nib[b] >> 4) | ((top[b % 32] >> (4 + e) & 3) << 4)) - 32);
    }
  }
}

constexpr int STRIP_MB = 8;  // rows of x a strip takes at a time (12: no faster, NOTES 49)

#if defined(__AVX512F__)
// Each thread streams its rows of blocks front to back; a prefetch 4 KB ahead keeps the
// stream ahead of the loads. Measured on Zen 4 (2 threads, 1.7B-like products in huge
// pages, bit-identical outputs, NOTES 48): q4 1.24-1.38x, q8 1.06-1.07x the bytes a second
// of no prefetch (512 B-8 KB tried; 4 KB best), where the bf16 GEMVs read slower with it
// (`weight_prefetch_bytes`: none on AMD); the integer path (built without AVX512-BF16):
// q4 1.19x. Not measured on Intel, where those GEMVs gain.
inline void prefetch_weights(const void* at) {
  _mm_prefetch(static_cast<const char*>(at) + 4096, _MM_HINT_T0);
}

// The 32 values of one q4 run as two vectors (values 0-15, 16-31): the run's 16 possible
// values are a table indexed by the nibbles (vpermps reads an index's low 4 bits).
inline void q4_run(const uint8_t* q, __m512 table, __m512& lo, __m512& hi) {
  const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)));
  lo = _mm512_permutexvar_ps(bytes, table);
  hi = _mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), table);
}

inline __m512 q8_16(const int8_t* q, __m512 scale) {
  const __m512i v = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)));
  return _mm512_mul_ps(_mm512_cvtepi32_ps(v), scale);
}

template <int MB>
inline void fma_rows(__m512 (&acc)[MB_MAX], __m512 w, const float* x, int64_t K, int64_t k) {
  for (int m = 0; m < MB; ++m) acc[m] = _mm512_fmadd_ps(w, _mm512_loadu_ps(x + m * K + k), acc[m]);
}

// out[m] = x[m] . dequantize(row) for MB rows of x [*, K] (fp32).
template <int MB, bool Q4, typename S>
inline void row_product(const float* x, int64_t K, int64_t g, const void* wrow, const S* s,
                        const S* mn, float* out) {
  __m512 acc[MB_MAX];
  for (int m = 0; m < MB; ++m) acc[m] = _mm512_setzero_ps();
  const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  for (int64_t gi = 0, k0 = 0; k0 < K; ++gi, k0 += g) {
    const __m512 scale = _mm512_set1_ps(scale1(s[gi]));
    if constexpr (Q4) {
      const __m512 table = _mm512_fmadd_ps(iota, scale, _mm512_set1_ps(scale1(mn[gi])));
      for (int64_t k = k0; k < k0 + g; k += 32) {
        __m512 lo, hi;
        q4_run(static_cast<const uint8_t*>(wrow) + k / 2, table, lo, hi);
        fma_rows<MB>(acc, lo, x, K, k);
        fma_rows<MB>(acc, hi, x, K, k + 16);
      }
    } else {
      for (int64_t k = k0; k < k0 + g; k += 16)
        fma_rows<MB>(acc, q8_16(static_cast<const int8_t*>(wrow) + k, scale), x, K, k);
    }
  }
  for (int m = 0; m < MB; ++m) out[m] = _mm512_reduce_add_ps(acc[m]);
}
#else
template <int MB, bool Q4, typename S>
inline void row_product(const float* x, int64_t K, int64_t g, const void* wrow, const S* s,
                        const S* mn, float* out) {
  float acc[MB_MAX] = {0.f, 0.f, 0.f, 0.f};
  for (int64_t k = 0; k < K; ++k) {
    const int64_t gi = k / g;
    float w;
    if constexpr (Q4) {
      const uint8_t byte = static_cast<const uint8_t*>(wrow)[(k / 32) * 16 + (k % 16)];
      const int q = (k % 32) < 16 ? (byte & 15) : (byte >> 4);
      w = float(q) * scale1(s[gi]) + scale1(mn[gi]);
    } else {
      w = float(static_cast<const int8_t*>(wrow)[k]) * scale1(s[gi]);
    }
    for (int m = 0; m < MB; ++m) acc[m] += w * x[m * K + k];
  }
  for (int m = 0; m < MB; ++m) out[m] = acc[m];
}
#endif

// AVX2 + FMA without AVX-512 (Zen 1-3, Haswell to Ice Lake clients): the fp32 path's row
// products, with the products factored as the bf16 path factors them.
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
#define CC_AVX2_ROWS 1
inline float hsum8(__m256 t) {
  const __m128 h = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
  const __m128 q = _mm_add_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_add_ss(q, _mm_movehdup_ps(q)));
}

inline __m256 load8(const f16* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }

// x's sums per group of g, for q4's mins (`row_product_q4_sums`), once a call.
inline void group_sums(const float* x, int64_t K, int64_t g, float* sums) {
  for (int64_t gi = 0; gi < K / g; ++gi) {
    __m256 a = _mm256_setzero_ps();
    for (int64_t k = gi * g; k < (gi + 1) * g; k += 8) a = _mm256_add_ps(a, _mm256_loadu_ps(x + k));
    sums[gi] = hsum8(a);
  }
}

// q4 on AVX2: out[m] = sum over groups of scale (q . x) + min (sum of x), the integers'
// products exact in fp32 as on the bf16 path, x's sums from `group_sums`: 14 vector ops a
// run of 32 where dequantizing every value first (as the AVX-512 `row_product` does) took
// 18; single-threaded 1.17x (9.7 -> 11.3 G values/s, 2048x8192 blocks from memory).
template <int MB, typename S>
inline void row_product_q4_sums(const float* x, const float* sums, int64_t K, int64_t g,
                                const uint8_t* w, const S* s, const S* mn, float* out) {
  const int64_t groups = K / g;
  __m256 total[MB_MAX];
  for (int m = 0; m < MB; ++m) total[m] = _mm256_setzero_ps();
  const __m256i low4 = _mm256_set1_epi32(15);
  for (int64_t gi = 0, k0 = 0; gi < groups; ++gi, k0 += g) {
    __m256 lo_acc[MB_MAX], hi_acc[MB_MAX];
    for (int m = 0; m < MB; ++m) lo_acc[m] = hi_acc[m] = _mm256_setzero_ps();
    for (int64_t k = k0; k < k0 + g; k += 32) {
      for (int h = 0; h < 2; ++h) {  // values k + 8h.. (low nibbles), k + 16 + 8h.. (high)
        const __m256i v = _mm256_cvtepu8_epi32(
            _mm_loadl_epi64(reinterpret_cast<const __m128i*>(w + k / 2 + 8 * h)));
        const __m256 lo = _mm256_cvtepi32_ps(_mm256_and_si256(v, low4));
        const __m256 hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4));
        for (int m = 0; m < MB; ++m) {
          lo_acc[m] = _mm256_fmadd_ps(lo, _mm256_loadu_ps(x + m * K + k + 8 * h), lo_acc[m]);
          hi_acc[m] = _mm256_fmadd_ps(hi, _mm256_loadu_ps(x + m * K + k + 16 + 8 * h), hi_acc[m]);
        }
      }
    }
    const __m256 scale = _mm256_set1_ps(scale1(s[gi]));
    for (int m = 0; m < MB; ++m)
      total[m] = _mm256_fmadd_ps(_mm256_add_ps(lo_acc[m], hi_acc[m]), scale, total[m]);
  }
  for (int m = 0; m < MB; ++m) {
    const float* sm = sums + m * groups;
    __m256 mins = _mm256_setzero_ps();
    int64_t gi = 0;
    for (; gi + 8 <= groups; gi += 8)
      mins = _mm256_fmadd_ps(load8(mn + gi), _mm256_loadu_ps(sm + gi), mins);
    float tail = 0.f;
    for (; gi < groups; ++gi) tail += scale1(mn[gi]) * sm[gi];
    out[m] = hsum8(_mm256_add_ps(total[m], mins)) + tail;
  }
}

// q8 on AVX2 likewise: out[m] = sum over groups of scale (q . x), the products exact in
// fp32; groups of 16 (Q6_K's), 32 (Q8_0's) or the whole row.
template <int MB, typename S>
inline void row_product_q8(const float* x, int64_t K, int64_t g, const int8_t* w, const S* s,
                           float* out) {
  __m256 total[MB_MAX];
  for (int m = 0; m < MB; ++m) total[m] = _mm256_setzero_ps();
  for (int64_t gi = 0, k0 = 0; k0 < K; ++gi, k0 += g) {
    __m256 acc[MB_MAX][2];
    for (int m = 0; m < MB; ++m) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
    for (int64_t k = k0; k < k0 + g; k += 16) {
      for (int h = 0; h < 2; ++h) {
        const __m256 v = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
            _mm_loadl_epi64(reinterpret_cast<const __m128i*>(w + k + 8 * h))));
        for (int m = 0; m < MB; ++m)
          acc[m][h] = _mm256_fmadd_ps(v, _mm256_loadu_ps(x + m * K + k + 8 * h), acc[m][h]);
      }
    }
    const __m256 scale = _mm256_set1_ps(scale1(s[gi]));
    for (int m = 0; m < MB; ++m)
      total[m] = _mm256_fmadd_ps(_mm256_add_ps(acc[m][0], acc[m][1]), scale, total[m]);
  }
  for (int m = 0; m < MB; ++m) out[m] = hsum8(total[m]);
}

// Q8_0 with int8 activations (flags bit 5) on AVX2, as llama.cpp multiplies it there: x
// quantized per run of 32 against max |x| / 127 (as `quantize_run` on AVX-512), then
// |w| times x's bytes with w's signs (vpmaddubsw: pairs of products, < 2^15) summed to
// int32, one FMA a run with both scales. 11 vector ops a run where the exact product
// takes 17.
inline float quantize_run8(const float* x, int8_t* q) {
  __m256 v[4];
  __m256 amax = _mm256_setzero_ps();
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  for (int i = 0; i < 4; ++i) {
    v[i] = _mm256_loadu_ps(x + 8 * i);
    amax = _mm256_max_ps(amax, _mm256_and_ps(v[i], abs_mask));
  }
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  const float top = _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
  const __m256 inv = _mm256_set1_ps(top > 0.f ? 127.f / top : 0.f);
  __m256i i32[4];
  for (int i = 0; i < 4; ++i) i32[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv));
  // packs interleave 128-bit lanes; the permutation puts the 32 bytes back in order
  const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(i32[0], i32[1]),
                                           _mm256_packs_epi32(i32[2], i32[3]));
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), _mm256_permutevar8x32_epi32(bytes, order));
  return top / 127.f;
}

template <int MB, typename S>
inline void row_product_q8_int8(const int8_t* const* xq, const float* const* dx, int64_t K,
                                const int8_t* w, const S* s, float* out) {
  __m256 acc[MB_MAX];
  for (int m = 0; m < MB; ++m) acc[m] = _mm256_setzero_ps();
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t r = 0; r < K / 32; ++r) {
    const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 32 * r));
    const __m256i aw = _mm256_sign_epi8(wv, wv);
    const float dw = scale1(s[r]);
    for (int m = 0; m < MB; ++m) {
      const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq[m] + 32 * r));
      const __m256i pairs = _mm256_maddubs_epi16(aw, _mm256_sign_epi8(xv, wv));
      const __m256 dot = _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, ones));
      acc[m] = _mm256_fmadd_ps(dot, _mm256_set1_ps(dw * dx[m][r]), acc[m]);
    }
  }
  for (int m = 0; m < MB; ++m) out[m] = hsum8(acc[m]);
}
#endif


#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
// The integer path for runs of 32 (g = 32): activations quantized to int8 per run of 32
// (scale = max |x| / 127, as llama.cpp's Q8_1 does for its integer dot products), 64
// products per VNNI instruction, one fp32 scale per run. What one row of x becomes.
struct QuantRow {
  int8_t* q;      // [K]
  float* scale;   // [K/32]: the run's activation scale
  float* sum;     // [K/32]: the run's sum of x (fp32, for q4's mins)
  int32_t* bias;  // [K/4]: -128 * each 4 values' sum of q (q8: weights offset to unsigned)
};

// One run of 32 activations (a: 0-15, b: 16-31) to int8 against max |x| / 127, each byte
// xor'ed with `flip` (0x80 makes them unsigned, + 128), into q; returns the run's scale.
inline float quantize_run(__m512 a, __m512 b, __m128i flip, void* q) {
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
  const __m512 inv = _mm512_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
  const __m128i qa = _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(a, inv)));
  const __m128i qb = _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(b, inv)));
  _mm_storeu_si128(static_cast<__m128i*>(q), _mm_xor_si128(qa, flip));
  _mm_storeu_si128(static_cast<__m128i*>(q) + 1, _mm_xor_si128(qb, flip));
  return amax / 127.f;
}

inline void quantize_row(const float* x, int64_t K, QuantRow r) {
  for (int64_t run = 0; run < K / 32; ++run) {
    const __m512 a = _mm512_loadu_ps(x + run * 32), b = _mm512_loadu_ps(x + run * 32 + 16);
    r.scale[run] = quantize_run(a, b, _mm_setzero_si128(), r.q + run * 32);
    r.sum[run] = _mm512_reduce_add_ps(_mm512_add_ps(a, b));
  }
  const __m512i offset = _mm512_set1_epi8(char(0x80));
  for (int64_t k = 0; k < K; k += 64) {  // K is a multiple of 64 here
    const __m512i v = _mm512_loadu_si512(r.q + k);
    const __m512i c = _mm512_dpbusd_epi32(_mm512_setzero_si512(), offset, v);
    _mm512_storeu_si512(r.bias + k / 4, _mm512_sub_epi32(_mm512_setzero_si512(), c));
  }
}

// 64 weights (two runs) as unsigned bytes in x's order: q4's nibbles, or q8 + 128.
template <bool Q4>
inline __m512i unsigned64(const void* w, int64_t k) {
  if constexpr (Q4) {
    const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(
        static_cast<const uint8_t*>(w) + k / 2));
    const __m512i twice = _mm512_permutexvar_epi64(_mm512_setr_epi64(0, 1, 0, 1, 2, 3, 2, 3),
                                                   _mm512_castsi256_si512(q));
    const __m512i shifted = _mm512_srlv_epi64(twice, _mm512_setr_epi64(0, 0, 4, 4, 0, 0, 4, 4));
    return _mm512_and_si512(shifted, _mm512_set1_epi8(0x0f));
  } else {
    const __m512i q = _mm512_loadu_si512(static_cast<const int8_t*>(w) + k);
    return _mm512_xor_si512(q, _mm512_set1_epi8(char(0x80)));
  }
}

// out[m] = xq[m] . row for MB quantized rows; K a multiple of 64, g = 32.
template <int MB, bool Q4, typename S>
inline void row_product_int8(const QuantRow* rows, int64_t K, const void* wrow, const S* s,
                             const S* mn, float* out) {
  __m512 acc[MB_MAX], mins[MB_MAX];
  for (int m = 0; m < MB; ++m) acc[m] = mins[m] = _mm512_setzero_ps();
  const int64_t runs = K / 32;
  for (int64_t r0 = 0; r0 < runs; r0 += 16) {
    const int64_t n = runs - r0 < 16 ? runs - r0 : 16;
    const __mmask16 live = __mmask16((1u << n) - 1);
    const __m512 sw = scales16(s + r0, live);
    __m512 comb[MB_MAX];
    for (int m = 0; m < MB; ++m) {
      comb[m] = _mm512_mul_ps(sw, _mm512_maskz_loadu_ps(live, rows[m].scale + r0));
      if constexpr (Q4)
        mins[m] = _mm512_fmadd_ps(scales16(mn + r0, live),
                                  _mm512_maskz_loadu_ps(live, rows[m].sum + r0), mins[m]);
    }
    for (int64_t p = 0; p < n; p += 2) {  // a pair of runs: lanes 0-7 and 8-15
      const int64_t k = (r0 + p) * 32;
      // q4 only: the q8 stream read 0.95x (0.79-1.15) with it here (NOTES 48)
      if constexpr (Q4) prefetch_weights(static_cast<const uint8_t*>(wrow) + k / 2);
      const __m512i wu = unsigned64<Q4>(wrow, k);
      const __m512i pick = _mm512_setr_epi32(p, p, p, p, p, p, p, p, p + 1, p + 1, p + 1, p + 1,
                                             p + 1, p + 1, p + 1, p + 1);
      for (int m = 0; m < MB; ++m) {
        const __m512i start = Q4 ? _mm512_setzero_si512()
                                 : _mm512_loadu_si512(rows[m].bias + k / 4);
        const __m512i dot = _mm512_dpbusd_epi32(start, wu, _mm512_loadu_si512(rows[m].q + k));
        acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_permutexvar_ps(pick, comb[m]),
                                 acc[m]);
      }
    }
  }
  for (int m = 0; m < MB; ++m) out[m] = _mm512_reduce_add_ps(_mm512_add_ps(acc[m], mins[m]));
}
#define CC_INT8_PATH 1
#else
#define CC_INT8_PATH 0
#endif


#if defined(__AVX512BF16__) && defined(__AVX512BW__)
// The exact path for q4 and bf16 activations (AVX512-BF16): each nibble q becomes the bf16
// 128 + q (bits 0x4300 | q, exact), `vdpbf16ps` multiplies 32 of them by 32 activations
// exactly and adds in fp32, and the 128 comes off through the run's activation sum:
//   sum_j (d q_j + m) x_j = d sum_j (128 + q_j) x_j + (m - 128 d) sum_j x_j.
// Nothing is rounded but fp32 sums (NOTES 45: int8 activations, the path above, cost 1.2%
// perplexity on the shipped model; this path costs nothing and runs at the same speed).
// What one row of x becomes: its values reordered per pair of runs A, B as [A 0-15, B 0-15,
// A 16-31, B 16-31] (the order two runs' low, then high, nibbles widen to), and run sums.
struct Bf16Row {
  const bf16* x;
  const float* sum;
};

// The sums of x over each group of `len` values.
inline void run_sums(const bf16* x, int64_t K, float* sum, int64_t len) {
  for (int64_t run = 0; run < K / len; ++run) {
    float total = 0.f;
    for (int64_t j = 0; j < len; ++j) total += to_f32(x[run * len + j]);
    sum[run] = total;
  }
}

inline void reorder_pairs(const bf16* x, int64_t K, bf16* xp) {
  for (int64_t k = 0; k < K; k += 64) {
    std::memcpy(xp + k, x + k, 32);
    std::memcpy(xp + k + 16, x + k + 32, 32);
    std::memcpy(xp + k + 32, x + k + 16, 32);
    std::memcpy(xp + k + 48, x + k + 48, 32);
  }
}

// x reordered for `row_product_q4_bf16`: each chunk of 4 runs (128 values) in the order
// that loop widens the chunk's 64 bytes, parts A, B, C, D of 32 values: the low nibbles
// of even bytes, of odd bytes, then the high nibbles of even and of odd bytes (byte j of a
// run holds value j low, j + 16 high); a last pair of runs (K % 128 == 64) as pairs.
struct ChunkOrder {
  alignas(64) int16_t at[4][32];
};
// Part P's value e is x[e / 8 * 32 + 2 (e % 8) + (P & 1) + 16 (P >> 1)]: runs 0-1 from one
// pair of vectors and runs 2-3 from the other, the same indices into each.
constexpr ChunkOrder chunk_order() {
  ChunkOrder o{};
  for (int part = 0; part < 4; ++part)
    for (int e = 0; e < 32; ++e)
      o.at[part][e] = int16_t(e / 8 % 2 * 32 + 2 * (e % 8) + (part & 1) + 16 * (part >> 1));
  return o;
}
inline constexpr ChunkOrder CHUNK_ORDER = chunk_order();

inline void reorder_chunks(const bf16* x, int64_t K, bf16* xp) {
  __m512i idx[4];
  for (int part = 0; part < 4; ++part) idx[part] = _mm512_load_si512(CHUNK_ORDER.at[part]);
  int64_t k = 0;
  for (; k + 128 <= K; k += 128) {
    __m512i r[4];
    for (int i = 0; i < 4; ++i) r[i] = _mm512_loadu_si512(x + k + 32 * i);
    for (int part = 0; part < 4; ++part) {
      const __m512i lo = _mm512_permutex2var_epi16(r[0], idx[part], r[1]);
      const __m512i hi = _mm512_permutex2var_epi16(r[2], idx[part], r[3]);
      _mm512_storeu_si512(xp + k + 32 * part, _mm512_mask_blend_epi16(0xffff0000u, lo, hi));
    }
  }
  if (k < K) reorder_pairs(x + k, K - k, xp + k);
}

// What the bf16 row products read a row's fields through: compact rows in place, other
// fields as their decoded pointer.
template <bool Q4, bool Compact, typename S>
inline auto fields_at(const S* base, int64_t groups, int64_t n, const S* decoded) {
  if constexpr (Compact) {
    if (!base) return CompactPtr<Q4>{nullptr, nullptr, 0};
    const int64_t stride = CompactPtr<Q4>::row_bytes(groups);
    const uint8_t* row = reinterpret_cast<const uint8_t*>(base) + n * stride;
    return CompactPtr<Q4>{row, row + groups, 0};
  } else {
    return decoded;
  }
}

// 16 runs' scales from their groups' (2^shift runs a group; 16 runs start on a group).
template <typename SP>
inline __m512 run_scales(SP s, int64_t r0, int64_t n, int shift) {
  const int64_t groups = (n + (1 << shift) - 1) >> shift;
  const __m512 g = scales16(s + (r0 >> shift), __mmask16((1u << groups) - 1));
  if (shift == 0) return g;
  const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  return _mm512_permutexvar_ps(_mm512_srli_epi32(iota, shift), g);
}

template <int MB, typename SP>
inline void row_product_q4_bf16(const Bf16Row* rows, int64_t K, const uint8_t* w, SP s, SP mn,
                                int shift, float* out) {
  __m512 acc[MB_MAX], mins[MB_MAX];
  for (int m = 0; m < MB; ++m) acc[m] = mins[m] = _mm512_setzero_ps();
  const __m512i exponent = _mm512_set1_epi16(0x4300), low = _mm512_set1_epi16(0x000f);
  const int64_t runs = K / 32;
  const __m512i quarter = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
  for (int64_t r0 = 0; r0 < runs; r0 += 16) {
    const int64_t n = runs - r0 < 16 ? runs - r0 : 16;
    const __mmask16 live = __mmask16((1u << n) - 1);
    const __m512 d = run_scales(s, r0, n, shift);
    const __m512 m_eff = _mm512_fnmadd_ps(d, _mm512_set1_ps(128.f), run_scales(mn, r0, n, shift));
    for (int m = 0; m < MB; ++m)
      mins[m] = _mm512_fmadd_ps(m_eff, _mm512_maskz_loadu_ps(live, rows[m].sum + r0), mins[m]);
    int64_t p = 0;
    for (; p + 4 <= n; p += 4) {  // a chunk of 4 runs: lanes 4i .. 4i + 3 are run p + i
      const int64_t k = (r0 + p) * 32;
      prefetch_weights(w + k / 2);
      const __m512i v = _mm512_loadu_si512(w + k / 2);  // 32 words: bytes 2e, 2e + 1
      // Each nibble of a word to the bf16 128 + q in place: no lane crossing, 7 ops for 128
      // values where widening bytes to words first took 8 for 64 (NOTES 55).
      const __m512i a = _mm512_ternarylogic_epi32(low, v, exponent, 0xea);
      const __m512i b = _mm512_ternarylogic_epi32(low, _mm512_srli_epi16(v, 8), exponent, 0xea);
      const __m512i c = _mm512_ternarylogic_epi32(low, _mm512_srli_epi16(v, 4), exponent, 0xea);
      const __m512i d4 = _mm512_or_si512(_mm512_srli_epi16(v, 12), exponent);
      const __m512 scale =
          _mm512_permutexvar_ps(_mm512_add_epi32(_mm512_set1_epi32(int(p)), quarter), d);
      for (int m = 0; m < MB; ++m) {
        const bf16* xm = rows[m].x + k;
        __m512 dot = _mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)a,
                                      (__m512bh)_mm512_loadu_si512(xm));
        dot = _mm512_dpbf16_ps(dot, (__m512bh)b, (__m512bh)_mm512_loadu_si512(xm + 32));
        dot = _mm512_dpbf16_ps(dot, (__m512bh)c, (__m512bh)_mm512_loadu_si512(xm + 64));
        dot = _mm512_dpbf16_ps(dot, (__m512bh)d4, (__m512bh)_mm512_loadu_si512(xm + 96));
        acc[m] = _mm512_fmadd_ps(dot, scale, acc[m]);
      }
    }
    for (; p < n; p += 2) {  // a last pair of runs: lanes 0-7 and 8-15
      const int64_t k = (r0 + p) * 32;
      prefetch_weights(w + k / 2);
      const __m512i bytes = _mm512_cvtepu8_epi16(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + k / 2)));
      // (low & bytes) | exponent in one ternary-logic op (truth table 0xea).
      const __m512i lo = _mm512_ternarylogic_epi32(low, bytes, exponent, 0xea);
      const __m512i hi = _mm512_or_si512(_mm512_srli_epi16(bytes, 4), exponent);
      const __m512i pick = _mm512_setr_epi32(p, p, p, p, p, p, p, p, p + 1, p + 1, p + 1, p + 1,
                                             p + 1, p + 1, p + 1, p + 1);
      const __m512 scale = _mm512_permutexvar_ps(pick, d);
      for (int m = 0; m < MB; ++m) {
        const bf16* xm = rows[m].x + k;
        __m512 dot = _mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)lo,
                                      (__m512bh)_mm512_loadu_si512(xm));
        dot = _mm512_dpbf16_ps(dot, (__m512bh)hi, (__m512bh)_mm512_loadu_si512(xm + 32));
        acc[m] = _mm512_fmadd_ps(dot, scale, acc[m]);
      }
    }
  }
  for (int m = 0; m < MB; ++m) out[m] = _mm512_reduce_add_ps(_mm512_add_ps(acc[m], mins[m]));
}
// A chunk's 32 top bytes in both halves of a vector (`unpack_q6_row` has the layout).
inline __m512i top_bits(const uint8_t* chunk) {
  return _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(chunk + 64)));
}
// 16-bit shift counts: `lo` for the vector's first half, `hi` for its second.
inline __m512i by_half(int lo, int hi) {
  return _mm512_inserti64x4(_mm512_set1_epi16(short(lo)), _mm256_set1_epi16(short(hi)), 1);
}

// Q6_K's packed values on the same path (`unpack_q6_row` has the layout): a chunk's
// nibbles and top bits make each u the bf16 128 + u in place (u < 64), and the 160 the
// value q = u - 32 lacks comes off per group of 16 through x's sums of 16:
//   sum_j d q_j x_j = d sum_j (128 + u_j) x_j - 160 d sum_j x_j.
// A run's low nibbles are its first 16 values, so parts a, b of a chunk (x reordered as
// for q4) belong to the runs' even groups and parts c, d to their odd ones.
template <int MB>
inline void row_product_q6_bf16(const Bf16Row* rows, int64_t K, const uint8_t* w,
                                CompactPtr<false> s, float* out) {
  __m512 acc[MB_MAX], odd[MB_MAX], offset[MB_MAX];  // odd: the odd groups' (two chains)
  for (int m = 0; m < MB; ++m) acc[m] = odd[m] = offset[m] = _mm512_setzero_ps();
  const __m512i exponent = _mm512_set1_epi16(0x4300), low = _mm512_set1_epi16(0x000f),
                top = _mm512_set1_epi16(0x0030);
  // lanes 4i .. 4i + 3 hold run i of a chunk: its even group, 2i
  const __m512i even = _mm512_setr_epi32(0, 0, 0, 0, 2, 2, 2, 2, 4, 4, 4, 4, 6, 6, 6, 6);
  for (int64_t g0 = 0; g0 < K / 16; g0 += 16) {  // a super-block: 16 groups, 2 chunks
    const __m512 d = scales16(s + g0, 0xffff);
    const __m512 minus = _mm512_mul_ps(d, _mm512_set1_ps(-160.f));
    for (int m = 0; m < MB; ++m)
      offset[m] = _mm512_fmadd_ps(minus, _mm512_loadu_ps(rows[m].sum + g0), offset[m]);
    for (int c = 0; c < 2; ++c) {
      const int64_t k = g0 * 16 + c * 128;
      const uint8_t* chunk = w + k / 128 * 96;
      prefetch_weights(chunk);
      prefetch_weights(chunk + 64);
      const __m512i v = _mm512_loadu_si512(chunk);
      const __m512i h = top_bits(chunk);  // word i: top bytes 2i % 32, 2i % 32 + 1
      // (nibble & 15) | exponent, then | (its top bits & 0x30): truth tables 0xea, 0xf8;
      // words 0-15 (nibble bytes 0-31) take bit pairs 0-1 / 4-5 of their top bytes, words
      // 16-31 pairs 2-3 / 6-7, so each part's shift differs by half.
      const __m512i a = _mm512_ternarylogic_epi32(
          _mm512_ternarylogic_epi32(low, v, exponent, 0xea),
          _mm512_sllv_epi16(h, by_half(4, 2)), top, 0xf8);
      const __m512i b = _mm512_ternarylogic_epi32(
          _mm512_ternarylogic_epi32(low, _mm512_srli_epi16(v, 8), exponent, 0xea),
          _mm512_srlv_epi16(h, by_half(4, 6)), top, 0xf8);
      const __m512i cc = _mm512_ternarylogic_epi32(
          _mm512_ternarylogic_epi32(low, _mm512_srli_epi16(v, 4), exponent, 0xea),
          _mm512_srlv_epi16(h, by_half(0, 2)), top, 0xf8);
      const __m512i dd = _mm512_ternarylogic_epi32(
          _mm512_or_si512(_mm512_srli_epi16(v, 12), exponent),
          _mm512_srlv_epi16(h, by_half(8, 10)), top, 0xf8);
      const __m512i at = _mm512_add_epi32(_mm512_set1_epi32(8 * c), even);
      const __m512 d_even = _mm512_permutexvar_ps(at, d);
      const __m512 d_odd = _mm512_permutexvar_ps(_mm512_add_epi32(at, _mm512_set1_epi32(1)), d);
      for (int m = 0; m < MB; ++m) {
        const bf16* xm = rows[m].x + k;
        __m512 lo = _mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)a,
                                     (__m512bh)_mm512_loadu_si512(xm));
        lo = _mm512_dpbf16_ps(lo, (__m512bh)b, (__m512bh)_mm512_loadu_si512(xm + 32));
        __m512 hi = _mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)cc,
                                     (__m512bh)_mm512_loadu_si512(xm + 64));
        hi = _mm512_dpbf16_ps(hi, (__m512bh)dd, (__m512bh)_mm512_loadu_si512(xm + 96));
        acc[m] = _mm512_fmadd_ps(lo, d_even, acc[m]);
        odd[m] = _mm512_fmadd_ps(hi, d_odd, odd[m]);
      }
    }
  }
  for (int m = 0; m < MB; ++m)
    out[m] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(acc[m], odd[m]), offset[m]));
}

// q8 on the same path, one product a value: q in [-128, 127] is exact in bf16 (8 bits of
// significand), so a run of 32 widens to fp32 and narrows to bf16 without rounding, and
// `vdpbf16ps` multiplies it by 32 activations exactly and adds in fp32. Groups of G = 32
// (Q8_0) or 16 (Q6_K): `vdpbf16ps`'s lane i sums values 2i and 2i + 1,
// so lanes 0-7 hold a run's first 16 values and lanes 8-15 its last 16, and a group of 16
// scales half the lanes. G = 0: one scale for the whole row (int8 per output channel),
// applied once at the end. The nibble split this replaced took two products a value and
// rounded more (offset terms that cancel): NOTES 49.
// A run of 32 q8 values as bf16, in memory order.
inline __m512bh q8_run_bf16(const int8_t* w) {
  const __m512 lo = _mm512_cvtepi32_ps(
      _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w))));
  const __m512 hi = _mm512_cvtepi32_ps(
      _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 16))));
  return _mm512_cvtne2ps_pbh(hi, lo);
}

template <int MB, int G, typename SP>
inline void row_product_q8_bf16(const bf16* const* xs, int64_t K, const int8_t* w, SP s,
                                float* out) {
  __m512 acc[MB_MAX];
  for (int m = 0; m < MB; ++m) acc[m] = _mm512_setzero_ps();
  if constexpr (G == 0) {
    for (int64_t k = 0; k < K; k += 32) {
      prefetch_weights(w + k);
      const __m512bh q = q8_run_bf16(w + k);
      for (int m = 0; m < MB; ++m)
        acc[m] = _mm512_dpbf16_ps(acc[m], q, (__m512bh)_mm512_loadu_si512(xs[m] + k));
    }
    for (int m = 0; m < MB; ++m) out[m] = scale1(s[0]) * _mm512_reduce_add_ps(acc[m]);
    return;
  }
  const int64_t groups = K / (G ? G : K);
  for (int64_t g0 = 0; g0 < groups; g0 += 16) {
    const int64_t n = groups - g0 < 16 ? groups - g0 : 16;
    const __m512 d = scales16(s + g0, __mmask16((1u << n) - 1));
    alignas(64) float dv[16];
    _mm512_store_ps(dv, d);
    for (int64_t r = 0; r < n * G / 32; ++r) {
      const int64_t k = g0 * G + r * 32;
      prefetch_weights(w + k);
      const __m512bh q = q8_run_bf16(w + k);
      const int i = int(r);
      const __m512i pick = G == 32 ? _mm512_set1_epi32(i)
                                   : _mm512_setr_epi32(2 * i, 2 * i, 2 * i, 2 * i, 2 * i, 2 * i,
                                                       2 * i, 2 * i, 2 * i + 1, 2 * i + 1,
                                                       2 * i + 1, 2 * i + 1, 2 * i + 1,
                                                       2 * i + 1, 2 * i + 1, 2 * i + 1);
      // Groups of 32: the scale broadcast from memory (a load, not a shuffle on the vector
      // pipes beside the conversion): 1.15-1.2x at one row (NOTES 49).
      const __m512 scale = G == 32 ? _mm512_set1_ps(dv[i]) : _mm512_permutexvar_ps(pick, d);
      for (int m = 0; m < MB; ++m) {
        const __m512bh xv = (__m512bh)_mm512_loadu_si512(xs[m] + k);
        acc[m] = _mm512_fmadd_ps(_mm512_dpbf16_ps(_mm512_setzero_ps(), q, xv), scale, acc[m]);
      }
    }
  }
  for (int m = 0; m < MB; ++m) out[m] = _mm512_reduce_add_ps(acc[m]);
}

// The explicit dispatch on mb (a generic lambda cost 10-15%: NOTES 46), once per G.
template <int G, typename SP>
inline void q8_bf16_rows(int64_t mb, const bf16* const* xs, int64_t K, const int8_t* w, SP s,
                         float* out) {
  if (mb == 4) row_product_q8_bf16<4, G>(xs, K, w, s, out);
  else if (mb == 3) row_product_q8_bf16<3, G>(xs, K, w, s, out);
  else if (mb == 2) row_product_q8_bf16<2, G>(xs, K, w, s, out);
  else row_product_q8_bf16<1, G>(xs, K, w, s, out);
}

// Many rows (compute-bound): the row products above scale every run of every row. Here
// 16 weight rows at a time (a strip) are widened to bf16 once into a scratch laid out
// by pairs of k across the strip's rows ([K/2][16] pairs of bf16), so that `vdpbf16ps`
// with a broadcast pair of x adds to 16 outputs at once and a group's 16 scales multiply
// 16 outputs once a group: G/2 products and one multiply where the row product takes G/32
// of each. The same exact products and fp32 sums.

// r[j] <- the j-th 32-bit element of each of r[0..15] (a 16 x 16 transpose of pairs).
inline void transpose16(__m512i (&r)[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {  // per 128-bit lane L: columns 4L .. 4L + 3, 4 rows
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int h = 0; h < 16; h += 8)
    for (int c = 0; c < 4; ++c) {
      t[h + c] = _mm512_shuffle_i32x4(r[h + c], r[h + c + 4], 0x88);
      t[h + c + 4] = _mm512_shuffle_i32x4(r[h + c], r[h + c + 4], 0xdd);
    }
  for (int c = 0; c < 8; ++c) {
    r[c] = _mm512_shuffle_i32x4(t[c], t[c + 8], 0x88);
    r[c + 8] = _mm512_shuffle_i32x4(t[c], t[c + 8], 0xdd);
  }
}

// Where a strip lives in a thread's scratch: its values as bf16 pairs [K/2][16] (64-byte
// aligned), its scales and (q4) mins [groups][16] in fp32.
struct Strip {
  __m512i* wp;
  float* ds;
  float* ms;
};

// A run of 32 q4 values (byte j: value j in its low nibble, j + 16 in its high one) as
// bf16 in value order: small integers, exact.
inline __m512bh q4_run_bf16(const uint8_t* w) {
  const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w)));
  const __m512 lo = _mm512_cvtepi32_ps(_mm512_and_si512(b, _mm512_set1_epi32(15)));
  const __m512 hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4));
  return _mm512_cvtne2ps_pbh(hi, lo);
}

template <bool Q4, typename S>
inline void pack_strip(const void* w, const S* s, const S* mn, int64_t K, int64_t groups,
                       Strip st) {
  const uint8_t* wb = static_cast<const uint8_t*>(w);
  const int64_t row_bytes = Q4 ? K / 2 : K;
  for (int64_t k = 0; k < K; k += 32) {
    __m512i r[16];
    for (int n = 0; n < TILE_N; ++n)
      r[n] = Q4 ? (__m512i)q4_run_bf16(wb + n * row_bytes + k / 2)
                : (__m512i)q8_run_bf16(reinterpret_cast<const int8_t*>(wb + n * row_bytes + k));
    transpose16(r);
    for (int j = 0; j < 16; ++j) _mm512_store_si512(st.wp + k / 2 + j, r[j]);
  }
  // q4: a scale and min per run of 32 (its group's), as the rows' sums of x come per run
  const int64_t entries = Q4 ? K / 32 : groups, shift = Q4 ? runs_shift(K / groups) : 0;
  for (int64_t e = 0; e < entries; ++e)
    for (int n = 0; n < TILE_N; ++n) {
      st.ds[e * TILE_N + n] = scale1(s[n * groups + (e >> shift)]);
      if constexpr (Q4) st.ms[e * TILE_N + n] = scale1(mn[n * groups + (e >> shift)]);
    }
}

// out[m][0..15] = x[m] . the strip's rows, MB rows of x (bf16 [*, K]); q4 adds each
// group's min times the group's sum of x: sum_j (d q_j + m) x_j = d sum_j q_j x_j + m X.
template <int MB, bool Q4>
inline void strip_rows(const bf16* x, const float* const* sums, int64_t K, Strip st,
                       int64_t groups, float* out) {
  __m512 acc[STRIP_MB];
  for (int m = 0; m < MB; ++m) acc[m] = _mm512_setzero_ps();
  const int64_t pairs = K / groups / 2;
  for (int64_t gi = 0; gi < groups; ++gi) {
    __m512 t[STRIP_MB];
    for (int m = 0; m < MB; ++m) t[m] = _mm512_setzero_ps();
    for (int64_t p = gi * pairs; p < (gi + 1) * pairs; ++p) {
      const __m512bh w = (__m512bh)_mm512_load_si512(st.wp + p);
      for (int m = 0; m < MB; ++m) {
        int32_t pair;
        std::memcpy(&pair, x + m * K + 2 * p, 4);
        t[m] = _mm512_dpbf16_ps(t[m], w, (__m512bh)_mm512_set1_epi32(pair));
      }
    }
    const __m512 d = _mm512_loadu_ps(st.ds + gi * TILE_N);
    for (int m = 0; m < MB; ++m) acc[m] = _mm512_fmadd_ps(t[m], d, acc[m]);
    if constexpr (Q4) {
      const __m512 mins = _mm512_loadu_ps(st.ms + gi * TILE_N);
      for (int m = 0; m < MB; ++m)
        acc[m] = _mm512_fmadd_ps(mins, _mm512_set1_ps(sums[m][gi]), acc[m]);
    }
  }
  for (int m = 0; m < MB; ++m) _mm512_storeu_ps(out + m * TILE_N, acc[m]);
}

template <bool Q4>
inline void strip_rows_mb(int64_t mb, const bf16* x, const float* const* sums, int64_t K,
                          Strip st, int64_t groups, float* out) {
  switch (mb) {
    case 8: return strip_rows<8, Q4>(x, sums, K, st, groups, out);
    case 7: return strip_rows<7, Q4>(x, sums, K, st, groups, out);
    case 6: return strip_rows<6, Q4>(x, sums, K, st, groups, out);
    case 5: return strip_rows<5, Q4>(x, sums, K, st, groups, out);
    case 4: return strip_rows<4, Q4>(x, sums, K, st, groups, out);
    case 3: return strip_rows<3, Q4>(x, sums, K, st, groups, out);
    case 2: return strip_rows<2, Q4>(x, sums, K, st, groups, out);
    default: return strip_rows<1, Q4>(x, sums, K, st, groups, out);
  }
}
#define CC_BF16_PATH 1

#if defined(__AVX512VNNI__)
// Q8_0 strips with int8 activations (many rows: compute-bound). x quantized per run of
// 32 (scale = max |x| / 127, as llama.cpp quantizes activations for its Q8_0 products),
// then offset to unsigned (+128) for `vpdpbusd`, which adds 4 products of u8 x s8 into
// each of 16 int32 lanes: 64 products an instruction where `vdpbf16ps` does 32. The strip
// holds the weights' bytes as quads of k across its 16 rows ([K/4][16] int32), and per run
// -128 * each row's sum of the run's weights, which takes the offset off exactly:
//   sum_j (xq_j + 128) w_j - 128 sum_j w_j = sum_j xq_j w_j   (int32, exact)
// then one fp32 multiply by the weight's and the activation's scales a run.
struct Strip8 {
  __m512i* wq;     // [K/4][16] quads of int8
  __m512i* minus;  // [K/32][16] int32: -128 * the run's weight sum
  float* ds;       // [K/32][16] the weights' scales
};

template <typename S>
inline void pack_strip_int8(const int8_t* w, const S* s, int64_t K, int64_t groups, Strip8 st) {
  for (int64_t k = 0; k < K; k += 64) {
    __m512i r[16];
    for (int n = 0; n < TILE_N; ++n) r[n] = _mm512_loadu_si512(w + n * K + k);
    transpose16(r);
    for (int j = 0; j < 16; ++j) _mm512_store_si512(st.wq + k / 4 + j, r[j]);
  }
  const __m512i ones = _mm512_set1_epi8(1);
  for (int64_t run = 0; run < K / 32; ++run) {
    __m512i sum = _mm512_setzero_si512();
    for (int q = 0; q < 8; ++q)
      sum = _mm512_dpbusd_epi32(sum, ones, _mm512_load_si512(st.wq + run * 8 + q));
    _mm512_store_si512(st.minus + run, _mm512_sub_epi32(_mm512_setzero_si512(),
                                                        _mm512_slli_epi32(sum, 7)));
    for (int n = 0; n < TILE_N; ++n) st.ds[run * TILE_N + n] = scale1(s[n * groups + run]);
  }
}

// One bf16 row of x as unsigned bytes (xq + 128) and a scale a run of 32.
inline void quantize_row_u8(const bf16* x, int64_t K, uint8_t* q, float* scale) {
  for (int64_t run = 0; run < K / 32; ++run) {
    __m512 v[2];
    for (int h = 0; h < 2; ++h)
      v[h] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(
          reinterpret_cast<const __m256i*>(x + run * 32 + h * 16))), 16));
    scale[run] = quantize_run(v[0], v[1], _mm_set1_epi8(char(0x80)), q + run * 32);
  }
}

// q4 with int8 activations (the K-quants' products where `int8_x` allows it, as
// llama.cpp multiplies Q4_K by Q8_K): x quantized per run of 32 as above, laid out per
// chunk of 4 runs as the nibbles unpack, the runs' first 16 values (low nibbles), then
// their last 16 (high); a last pair of runs (K % 128 == 64) padded with zeros to a chunk.
// `vpdpbusd` multiplies the nibbles as they are (unsigned bytes) by x's: two instructions
// and two masks a chunk where the exact path widens four vectors to bf16 (1.66x from
// cache, 1.45x from memory: NOTES 56).
struct Int8Chunks {
  int8_t* q;     // [K rounded up to 128]
  float* scale;  // [K/32]: the run's activation scale
  float* sum;    // [K/32]: the run's sum of x (fp32, for the mins); Q6_K's: [K/16], per 16
};

inline int64_t chunked(int64_t K) { return (K + 127) / 128 * 128; }

inline void quantize_chunks(const bf16* x, int64_t K, Int8Chunks r, bool sums_of_16) {
  std::memset(r.q + K / 128 * 128, 0, chunked(K) - K / 128 * 128);
  for (int64_t run = 0; run < K / 32; ++run) {
    __m512 v[2];
    for (int h = 0; h < 2; ++h)
      v[h] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(
          reinterpret_cast<const __m256i*>(x + run * 32 + h * 16))), 16));
    alignas(32) int8_t q[32];
    r.scale[run] = quantize_run(v[0], v[1], _mm_setzero_si128(), q);
    if (sums_of_16) {
      r.sum[2 * run] = _mm512_reduce_add_ps(v[0]);
      r.sum[2 * run + 1] = _mm512_reduce_add_ps(v[1]);
    } else {
      r.sum[run] = _mm512_reduce_add_ps(_mm512_add_ps(v[0], v[1]));
    }
    int8_t* chunk = r.q + run / 4 * 128 + run % 4 * 16;
    std::memcpy(chunk, q, 16);
    std::memcpy(chunk + 64, q + 16, 16);
  }
}

template <int MB, typename SP>
inline void row_product_q4_int8(const Int8Chunks* rows, int64_t K, const uint8_t* w, SP s,
                                SP mn, int shift, float* out) {
  __m512 acc[MB_MAX], mins[MB_MAX];
  for (int m = 0; m < MB; ++m) acc[m] = mins[m] = _mm512_setzero_ps();
  const __m512i low = _mm512_set1_epi8(0x0f);
  const __m512i quarter = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
  const int64_t runs = K / 32;
  for (int64_t r0 = 0; r0 < runs; r0 += 16) {
    const int64_t n = runs - r0 < 16 ? runs - r0 : 16;
    const __mmask16 live = __mmask16((1u << n) - 1);
    const __m512 d = run_scales(s, r0, n, shift), m_run = run_scales(mn, r0, n, shift);
    __m512 comb[MB_MAX];  // d x the run's activation scale (0 past the row's runs)
    for (int m = 0; m < MB; ++m) {
      comb[m] = _mm512_mul_ps(d, _mm512_maskz_loadu_ps(live, rows[m].scale + r0));
      mins[m] = _mm512_fmadd_ps(m_run, _mm512_maskz_loadu_ps(live, rows[m].sum + r0), mins[m]);
    }
    for (int64_t p = 0; p < n; p += 4) {  // lanes 4i .. 4i + 3: run p + i
      const int64_t k = (r0 + p) * 32;
      prefetch_weights(w + k / 2);
      const __mmask64 bytes = n - p >= 4 ? ~0ull : (1ull << ((n - p) * 16)) - 1;
      const __m512i v = _mm512_maskz_loadu_epi8(bytes, w + k / 2);
      const __m512i lo = _mm512_and_si512(v, low);
      const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
      const __m512i at = _mm512_add_epi32(_mm512_set1_epi32(int(p)), quarter);
      for (int m = 0; m < MB; ++m) {
        const int8_t* xq = rows[m].q + k;
        __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, _mm512_loadu_si512(xq));
        dot = _mm512_dpbusd_epi32(dot, hi, _mm512_loadu_si512(xq + 64));
        acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_permutexvar_ps(at, comb[m]),
                                 acc[m]);
      }
    }
  }
  for (int m = 0; m < MB; ++m) out[m] = _mm512_reduce_add_ps(_mm512_add_ps(acc[m], mins[m]));
}

// Q6_K's packed values on int8 activations (x as for q4's: `Int8Chunks`, plus its sums
// per 16 in `sum`): each u (0-63) as an unsigned byte beside x's, its nibble or'ed with its
// top bits shifted by half (9 ops a chunk where the bf16 path takes 14 to widen), and
//   sum_j d q_j x_j ~ d dx sum_j u_j xq_j - 32 d sum_j x_j
// per group of 16 (the 32 through x's exact sums). A chunk's low nibbles are its runs'
// first 16 values (even groups), its high ones their last 16 (odd groups).
template <int MB>
inline void row_product_q6_int8(const Int8Chunks* rows, int64_t K, const uint8_t* w,
                                CompactPtr<false> s, float* out) {
  __m512 acc[MB_MAX], odd[MB_MAX], offset[MB_MAX];
  for (int m = 0; m < MB; ++m) acc[m] = odd[m] = offset[m] = _mm512_setzero_ps();
  const __m512i low = _mm512_set1_epi8(0x0f), top = _mm512_set1_epi8(0x30);
  const __m512i quarter = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
  const __m512i evens = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 0, 0, 0, 0, 0, 0, 0, 0);
  const __m512i shift_lo = by_half(4, 2), shift_hi = by_half(0, 2);
  for (int64_t g0 = 0; g0 < K / 16; g0 += 16) {  // a super-block: 16 groups, 8 runs, 2 chunks
    const __m512 d = scales16(s + g0, 0xffff);
    const __m512 d_even = _mm512_permutexvar_ps(evens, d);  // lanes 0-7: run r's groups 2r
    const __m512 d_odd =
        _mm512_permutexvar_ps(_mm512_add_epi32(evens, _mm512_set1_epi32(1)), d);
    __m512 even_x[MB_MAX], odd_x[MB_MAX];  // x d for run r, lanes 0-7
    for (int m = 0; m < MB; ++m) {
      const __m512 dx = _mm512_maskz_loadu_ps(0xff, rows[m].scale + g0 / 2);
      even_x[m] = _mm512_mul_ps(d_even, dx);
      odd_x[m] = _mm512_mul_ps(d_odd, dx);
      offset[m] = _mm512_fmadd_ps(_mm512_mul_ps(d, _mm512_set1_ps(-32.f)),
                                  _mm512_loadu_ps(rows[m].sum + g0), offset[m]);
    }
    for (int c = 0; c < 2; ++c) {
      const int64_t k = g0 * 16 + c * 128;
      const uint8_t* chunk = w + k / 128 * 96;
      prefetch_weights(chunk);
      prefetch_weights(chunk + 64);
      const __m512i v = _mm512_loadu_si512(chunk), h = top_bits(chunk);
      const __m512i u_lo = _mm512_ternarylogic_epi32(
          v, low, _mm512_and_si512(_mm512_sllv_epi16(h, shift_lo), top), 0xea);
      const __m512i u_hi = _mm512_ternarylogic_epi32(
          _mm512_srli_epi16(v, 4), low, _mm512_and_si512(_mm512_srlv_epi16(h, shift_hi), top),
          0xea);
      const __m512i at = _mm512_add_epi32(_mm512_set1_epi32(4 * c), quarter);
      for (int m = 0; m < MB; ++m) {
        const int8_t* xq = rows[m].q + k;
        const __m512i lo = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u_lo,
                                               _mm512_loadu_si512(xq));
        const __m512i hi = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u_hi,
                                               _mm512_loadu_si512(xq + 64));
        acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(lo), _mm512_permutexvar_ps(at, even_x[m]),
                                 acc[m]);
        odd[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(hi), _mm512_permutexvar_ps(at, odd_x[m]),
                                 odd[m]);
      }
    }
  }
  for (int m = 0; m < MB; ++m)
    out[m] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(acc[m], odd[m]), offset[m]));
}

// out[m][0..15] = x[m] . the strip's rows for MB quantized rows of x.
template <int MB>
inline void strip_rows_int8(const uint8_t* xq, const float* sx, int64_t K, Strip8 st,
                            float* out) {
  __m512 acc[STRIP_MB];
  for (int m = 0; m < MB; ++m) acc[m] = _mm512_setzero_ps();
  const int64_t runs = K / 32;
  for (int64_t run = 0; run < runs; ++run) {
    __m512i t[STRIP_MB];
    const __m512i start = _mm512_load_si512(st.minus + run);
    for (int m = 0; m < MB; ++m) t[m] = start;
    for (int q = 0; q < 8; ++q) {
      const __m512i w = _mm512_load_si512(st.wq + run * 8 + q);
      for (int m = 0; m < MB; ++m) {
        int32_t quad;
        std::memcpy(&quad, xq + m * K + run * 32 + q * 4, 4);
        t[m] = _mm512_dpbusd_epi32(t[m], _mm512_set1_epi32(quad), w);
      }
    }
    const __m512 d = _mm512_loadu_ps(st.ds + run * TILE_N);
    for (int m = 0; m < MB; ++m)
      acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(t[m]),
                               _mm512_mul_ps(d, _mm512_set1_ps(sx[m * runs + run])), acc[m]);
  }
  for (int m = 0; m < MB; ++m) _mm512_storeu_ps(out + m * TILE_N, acc[m]);
}

inline void strip_rows_int8_mb(int64_t mb, const uint8_t* xq, const float* sx, int64_t K,
                               Strip8 st, float* out) {
  switch (mb) {
    case 8: return strip_rows_int8<8>(xq, sx, K, st, out);
    case 7: return strip_rows_int8<7>(xq, sx, K, st, out);
    case 6: return strip_rows_int8<6>(xq, sx, K, st, out);
    case 5: return strip_rows_int8<5>(xq, sx, K, st, out);
    case 4: return strip_rows_int8<4>(xq, sx, K, st, out);
    case 3: return strip_rows_int8<3>(xq, sx, K, st, out);
    case 2: return strip_rows_int8<2>(xq, sx, K, st, out);
    default: return strip_rows_int8<1>(xq, sx, K, st, out);
  }
}
#define CC_INT8_STRIPS 1  // AVX512-BF16 CPUs: Zen 4, Sapphire Rapids and later
#endif
#else
#define CC_BF16_PATH 0
#endif
#ifndef CC_INT8_STRIPS
#define CC_INT8_STRIPS 0
#endif
#ifndef CC_AVX2_ROWS
#define CC_AVX2_ROWS 0
#endif

// y[m, n] = out[m] (+ bias[n]), the bias added in fp32 with one rounding (as addmm).
// Inlined: left a call, the 135M's short Q8_0 rows (K = 576) ran 0.95x (NOTES 55).
__attribute__((always_inline)) inline void store(void* y, int64_t flags, const void* bias,
                                                  int64_t N, int64_t n, int64_t m0, int64_t mb,
                                                  const float* out) {
  float b = 0.f;
  if (bias) b = flags & 1 ? to_f32(static_cast<const bf16*>(bias)[n])
                          : static_cast<const float*>(bias)[n];
  for (int64_t m = 0; m < mb; ++m) {
    const int64_t at = (m0 + m) * N + n;
    if (flags & 2) static_cast<bf16*>(y)[at] = to_bf16(out[m] + b);
    else static_cast<float*>(y)[at] = out[m] + b;
  }
}

// y[m0 + m, n0 + j] = out[m][j] (+ bias[n0 + j]) for a strip's 16 outputs of mb rows.
inline void store_strip(void* y, int64_t flags, const void* bias, int64_t N, int64_t n0,
                        int64_t m0, int64_t mb, const float* out) {
  for (int64_t j = 0; j < 16; ++j) {
    float col[STRIP_MB];
    for (int64_t m = 0; m < mb; ++m) col[m] = out[m * 16 + j];
    store(y, flags, bias, N, n0 + j, m0, mb, col);
  }
}

// Rows [n0, N) of w against one row of x, the team's share (guided): `row(n)` is output
// n. A loop of its own: the general row loop's per-row dispatch (on the format, the group
// and the rows of x) cost the 135M's short rows ~10% end to end (NOTES 55).
template <typename Row>
inline void one_row_loop(int64_t row_bytes, int64_t n0, int64_t N, void* y, int64_t flags,
                         const void* bias, Row row) {
#pragma omp for schedule(guided, guided_rows(row_bytes)) nowait
  for (int64_t n = n0; n < N; ++n) {
    const float out = row(n);
    store(y, flags, bias, N, n, 0, 1, &out);
  }
}

// Which path a call takes for bf16 activations: the exact bf16 path where AVX512-BF16
// builds (q4: groups of 32-512 values, powers of two, so that 16 runs start on a group;
// q8: groups of 32, 16 or the whole row), else for groups of 32 the integer one
// (AVX512-VNNI; it cost Q8_0 1.5% perplexity: NOTES 45) only where the caller allows int8
// activations (`int8_ok`, flags bit 5: `PassConfig.int8_activations`); otherwise fp32.
enum class Path { fp32, bf16, int8 };

inline Path choose(bool q4, int64_t bf, int64_t K, int64_t g, bool int8_ok) {
  if (!bf || K % 64) return Path::fp32;
  const bool bf16_groups = q4 ? g >= 32 && g <= 512 && (g & (g - 1)) == 0
                              : g == 32 || g == 16 || g == K;
  if (CC_BF16_PATH && bf16_groups) return Path::bf16;
  if (CC_INT8_PATH && g == 32 && int8_ok) return Path::int8;
  return Path::fp32;
}

// The row products are templates on a block's row count (accumulators in registers), so
// each path dispatches on mb itself: one generic lambda doing it for all four cost the
// q8 product 10-15% at 4 rows (the same-process A/B of NOTES 46).
// Compact (S = float): `scales` and `mins` point at compact rows (`CompactScales`), which
// are decoded a row (or a strip's rows) at a time; otherwise rows of S [N, groups].
template <bool Q4, typename S, bool Compact = false>
void product_team(const void* x, int64_t flags, const void* w, const S* scales, const S* mins,
                  const void* bias, void* y, int64_t M, int64_t N, int64_t K, int64_t g) {
  const int64_t bf = flags & 1;
  Path path = choose(Q4, bf, K, g, flags & 32);
  // Q6_K's packed rows (compact scales, K whole super-blocks): the bf16 row product reads
  // them in place, with x reordered and summed per 16 as q4's; other paths unpack a row
  // (or a strip's 16) to int8 first.
  const bool six = !Q4 && Compact && (flags & 64);
  const int64_t row_bytes = Q4 ? K / 2 : six ? K / 4 * 3 : K;
  // fp32 x [M, K]; then per row what its path needs (counted in floats): the int8 path's
  // QuantRow (K int8s, two run arrays, K/4 int32s), q4's bf16 path's reordered row and sums.
  const int64_t tiled_rows = Q4 ? TILED_ROWS_Q4 : TILED_ROWS_Q8;
  const bool strips = path == Path::bf16 && M >= tiled_rows && N >= TILE_N;
  // Q8_0 with int8 activations where the caller allows it (flags bit 5), as llama.cpp
  // multiplies: its strips from 6 rows, the integer row product up to INT8_ROWS_Q8 rows
  // (1.01-1.22x the exact one end to end at batch 1 on the 1.7B file, by how fast the
  // memory is: NOTES 55); the exact row product between.
  const bool int8_x = !Q4 && g == 32 && (flags & 32) && path == Path::bf16;
  const bool int8_strips = CC_INT8_STRIPS && strips && int8_x;
  // q4 with int8 activations where the caller allows it (the K-quants' products), for the
  // rows below the strips: `row_product_q4_int8`.
  const bool int8_q4 = Q4 && CC_INT8_STRIPS && (flags & 32) && path == Path::bf16 && !strips;
  // Q6_K's too (`row_product_q6_int8`): x as q4's, with sums per 16 where q4 has per 32.
  const bool int8_six = six && CC_INT8_STRIPS && (flags & 32) && path == Path::bf16 && !strips;
  const bool x_chunks = (Q4 || six) && path == Path::bf16 && !int8_q4 && !int8_six;
  if (CC_INT8_STRIPS && int8_x && !strips && M <= INT8_ROWS_Q8) path = Path::int8;
  // q4's fp32 row products on AVX2 take x's sums per group (`row_product_q4_sums`).
  const bool q4_sums = Q4 && CC_AVX2_ROWS && path == Path::fp32;
  // Q8_0's row products on AVX2 with int8 activations where the caller allows them (1-2
  // rows, as on AVX512-VNNI): `row_product_q8_int8`.
  const bool avx2_int8 = !Q4 && !Compact && CC_AVX2_ROWS && path == Path::fp32 && bf &&
                         g == 32 && (flags & 32) && M <= INT8_ROWS_Q8;
  const int64_t per_row = path == Path::int8 ? K / 4 + 2 * (K / 32) + K / 4
                          : int8_q4 || int8_six ? (K + 127) / 128 * 32 + K / 32 + K / 16
                          : x_chunks ? K / 2 + K / 16
                          : int8_strips ? K / 4 + K / 32
                          : q4_sums ? K / g
                          : avx2_int8 ? K / 4 + K / 32 : 0;
  const int64_t x_floats = path == Path::bf16 ? 0 : K;  // x as fp32 rows (fp32, int8 paths)
  const int64_t groups = K / g;
  const int64_t strip_groups = Q4 ? K / 32 : groups;  // q4's strips scale per run
  const int shift = runs_shift(g);  // q4's runs a group, as a shift
  const int64_t strip_floats = strips ? K * 8 + 2 * strip_groups * TILE_N + 16 : 0;
  const bool unpack = six && path != Path::bf16;  // rows unpacked in the row loop (and
  // a strip's 16 before it packs them, into the same buffer)
  float* xf = scratch(M * (x_floats + per_row) + strip_floats +
                      (Compact ? 2 * TILE_N * groups : 0) + (six ? TILE_N * K / 4 : 0));
  float* extra = xf + M * x_floats;
  float* scale_buf = extra + M * per_row + strip_floats;  // compact rows decoded
  float* min_buf = scale_buf + TILE_N * groups;
  int8_t* unpacked = reinterpret_cast<int8_t*>(min_buf + TILE_N * groups);
  if (path == Path::fp32) load_rows(x, bf, xf, M * K);
#if CC_AVX2_ROWS
  if (q4_sums)
    for (int64_t m = 0; m < M; ++m) group_sums(xf + m * K, K, g, extra + m * per_row);
  // a row's int8 values (K bytes), then its scale a run
  auto x_int8 = [&](int64_t m) { return reinterpret_cast<int8_t*>(extra + m * per_row); };
  auto x_scales = [&](int64_t m) { return extra + m * per_row + K / 4; };
  if (avx2_int8)
    for (int64_t m = 0; m < M; ++m)
      for (int64_t r = 0; r < K / 32; ++r)
        x_scales(m)[r] = quantize_run8(xf + m * K + 32 * r, x_int8(m) + 32 * r);
#endif
#if CC_INT8_PATH
  auto quant_row = [&](int64_t m) {
    float* base = extra + m * per_row;
    return QuantRow{reinterpret_cast<int8_t*>(base), base + K / 4, base + K / 4 + K / 32,
                    reinterpret_cast<int32_t*>(base + K / 4 + 2 * (K / 32))};
  };
  if (path == Path::int8) {
    load_rows(x, bf, xf, M * K);
    for (int64_t m = 0; m < M; ++m) quantize_row(xf + m * K, K, quant_row(m));
  }
#endif
#if CC_BF16_PATH
  auto bf16_row = [&](int64_t m) {
    float* base = extra + m * per_row;
    return Bf16Row{reinterpret_cast<const bf16*>(base), base + K / 2};
  };
  if (x_chunks)  // q8 reads x as it is; q4 (and Q6_K's 6 bits) need sums, and the row
    for (int64_t m = 0; m < M; ++m) {  // product the nibbles' order (not where strips take
      float* base = extra + m * per_row;  // every row)
      const bf16* xm = static_cast<const bf16*>(x) + m * K;
      if (!strips || N % TILE_N) reorder_chunks(xm, K, reinterpret_cast<bf16*>(base));
      run_sums(xm, K, base + K / 2, Q4 ? 32 : 16);
    }
#endif
#if CC_INT8_STRIPS
  auto int8_chunks = [&](int64_t m) {  // Int8Chunks: q, scale per 32, sum per 32 (or 16)
    float* base = extra + m * per_row;
    float* scale = base + (K + 127) / 128 * 32;
    return Int8Chunks{reinterpret_cast<int8_t*>(base), scale, scale + K / 32};
  };
  if (int8_q4 || int8_six)
    for (int64_t m = 0; m < M; ++m)  // Q6_K's sums per group of 16
      quantize_chunks(static_cast<const bf16*>(x) + m * K, K, int8_chunks(m), int8_six);
#endif
  int64_t tiled = 0;  // rows [0, tiled) of w go by strips
#if CC_INT8_STRIPS
  if constexpr (!Q4) {
    if (int8_strips) {
      uint8_t* xq = reinterpret_cast<uint8_t*>(extra);
      float* sx = extra + M * K / 4;
      for (int64_t m = 0; m < M; ++m)
        quantize_row_u8(static_cast<const bf16*>(x) + m * K, K, xq + m * K, sx + m * (K / 32));
      tiled = N / TILE_N * TILE_N;
      const uintptr_t at = reinterpret_cast<uintptr_t>(extra + M * per_row);
      Strip8 st;
      st.wq = reinterpret_cast<__m512i*>((at + 63) & ~uintptr_t(63));
      st.minus = st.wq + K / 4;
      st.ds = reinterpret_cast<float*>(st.minus + K / 32);
#pragma omp for schedule(guided) nowait
      for (int64_t strip = 0; strip < N / TILE_N; ++strip) {
        const int64_t n0 = strip * TILE_N;
        pack_strip_int8(static_cast<const int8_t*>(w) + n0 * K,
                        scale_rows<Q4, Compact>(scales, groups, n0, TILE_N, scale_buf), K,
                        groups, st);
        for (int64_t m0 = 0; m0 < M; m0 += STRIP_MB) {
          float out[STRIP_MB * TILE_N];
          const int64_t mb = M - m0 < STRIP_MB ? M - m0 : STRIP_MB;
          strip_rows_int8_mb(mb, xq + m0 * K, sx + m0 * (K / 32), K, st, out);
          store_strip(y, flags, bias, N, n0, m0, mb, out);
        }
      }
    }
  }
#endif
#if CC_BF16_PATH
  if (strips && !int8_strips) {
    tiled = N / TILE_N * TILE_N;
    const uintptr_t at = reinterpret_cast<uintptr_t>(extra + M * per_row);
    Strip st;
    st.wp = reinterpret_cast<__m512i*>((at + 63) & ~uintptr_t(63));
    st.ds = reinterpret_cast<float*>(st.wp + K / 2);
    st.ms = st.ds + strip_groups * TILE_N;
#pragma omp for schedule(guided) nowait
    for (int64_t strip = 0; strip < N / TILE_N; ++strip) {  // (x's chunks in L2: no faster)
      const int64_t n0 = strip * TILE_N;
      const S* ms = Q4 ? scale_rows<Q4, Compact>(mins, groups, n0, TILE_N, min_buf) : nullptr;
      const char* rows = static_cast<const char*>(w) + n0 * row_bytes;
      if (six) {
        for (int64_t r = 0; r < TILE_N; ++r)
          unpack_q6_row(reinterpret_cast<const uint8_t*>(rows) + r * row_bytes, K,
                        unpacked + r * K);
        rows = reinterpret_cast<const char*>(unpacked);
      }
      pack_strip<Q4>(rows, scale_rows<Q4, Compact>(scales, groups, n0, TILE_N, scale_buf), ms,
                     K, groups, st);
      for (int64_t m0 = 0; m0 < M; m0 += STRIP_MB) {
        float out[STRIP_MB * TILE_N];
        const float* sums[STRIP_MB];
        const int64_t mb = M - m0 < STRIP_MB ? M - m0 : STRIP_MB;
        for (int64_t m = 0; m < mb; ++m) sums[m] = Q4 ? bf16_row(m0 + m).sum : nullptr;
        strip_rows_mb<Q4>(mb, static_cast<const bf16*>(x) + m0 * K, sums, K, st, strip_groups,
                          out);
        store_strip(y, flags, bias, N, n0, m0, mb, out);
      }
    }
  }
#if CC_INT8_PATH
  if constexpr (!Q4 && !Compact) {  // one row of x, int8 activations: the loop below's kind
    if (path == Path::int8 && M == 1) {
      const QuantRow x1 = quant_row(0);
      one_row_loop(K, tiled, N, y, flags, bias, [&](int64_t n) {
        float out;
        row_product_int8<1, false>(&x1, K, static_cast<const int8_t*>(w) + n * K,
                                   scales + n * groups, static_cast<const S*>(nullptr), &out);
        return out;
      });
      return;
    }
  }
#endif
  // One row of x: a loop of its own (q4 through it ran 0.87-1.07x, by how the compiler
  // inlined it: NOTES 55)
  if constexpr (!Q4) {
    if (path == Path::bf16 && M == 1 && !six) {
      auto fields = [&](int64_t n) {
        return fields_at<Q4, Compact>(scales, groups, n, scales + (Compact ? 0 : n * groups));
      };
      const bf16* x1 = static_cast<const bf16*>(x);
      const int8_t* wq = static_cast<const int8_t*>(w);
      auto q8 = [&](auto G) {
        one_row_loop(K, tiled, N, y, flags, bias, [&](int64_t n) {
          float out;
          row_product_q8_bf16<1, decltype(G)::value>(&x1, K, wq + n * K, fields(n), &out);
          return out;
        });
      };
      if (g == 16) q8(std::integral_constant<int, 16>{});
      else if (g == 32) q8(std::integral_constant<int, 32>{});
      else q8(std::integral_constant<int, 0>{});  // g = K
      return;
    }
  }
#endif
  // Rows handed out by OpenMP's guided schedule (`guided_rows`): each thread streams a
  // few runs of rows, the first ones half and a quarter of the product.
  // Compact fields on the bf16 path are read in place (`CompactPtr`), elsewhere decoded.
  const bool in_place = Compact && CC_BF16_PATH && path == Path::bf16;
#pragma omp for schedule(guided, guided_rows(row_bytes)) nowait
  for (int64_t n = tiled; n < N; ++n) {
    const char* wrow = static_cast<const char*>(w) + n * row_bytes;
    if (unpack) {
      unpack_q6_row(reinterpret_cast<const uint8_t*>(wrow), K, unpacked);
      wrow = reinterpret_cast<const char*>(unpacked);
    }
    const S* s = in_place ? nullptr : scale_rows<Q4, Compact>(scales, groups, n, 1, scale_buf);
    const S* mn = Q4 && !in_place ? scale_rows<Q4, Compact>(mins, groups, n, 1, min_buf)
                                  : nullptr;
#if CC_BF16_PATH
    const auto sp = fields_at<Q4, Compact>(scales, groups, n, s);
    const auto mp = fields_at<Q4, Compact>(Q4 ? mins : nullptr, groups, n, mn);
#endif
    for (int64_t m0 = 0; m0 < M; m0 += MB_MAX) {
      float out[MB_MAX];
      const int64_t mb = M - m0 < MB_MAX ? M - m0 : MB_MAX;
      const float* xm = xf + m0 * x_floats;
#if CC_BF16_PATH
#if CC_INT8_STRIPS
      if constexpr (!Q4 && Compact) {
        if (int8_six) {
          Int8Chunks rm[MB_MAX];
          for (int64_t m = 0; m < mb; ++m) rm[m] = int8_chunks(m0 + m);
          const uint8_t* wq = reinterpret_cast<const uint8_t*>(wrow);
          if (mb == 4) row_product_q6_int8<4>(rm, K, wq, sp, out);
          else if (mb == 3) row_product_q6_int8<3>(rm, K, wq, sp, out);
          else if (mb == 2) row_product_q6_int8<2>(rm, K, wq, sp, out);
          else row_product_q6_int8<1>(rm, K, wq, sp, out);
          store(y, flags, bias, N, n, m0, mb, out);
          continue;
        }
      }
#endif
      if constexpr (!Q4 && Compact) {
        if (six && path == Path::bf16) {
          Bf16Row rm[MB_MAX];
          for (int64_t m = 0; m < mb; ++m) rm[m] = bf16_row(m0 + m);
          const uint8_t* wq = reinterpret_cast<const uint8_t*>(wrow);
          if (mb == 4) row_product_q6_bf16<4>(rm, K, wq, sp, out);
          else if (mb == 3) row_product_q6_bf16<3>(rm, K, wq, sp, out);
          else if (mb == 2) row_product_q6_bf16<2>(rm, K, wq, sp, out);
          else row_product_q6_bf16<1>(rm, K, wq, sp, out);
          store(y, flags, bias, N, n, m0, mb, out);
          continue;
        }
      }
      if constexpr (!Q4) {
        if (path == Path::bf16) {  // x read as it is
          const bf16* xs[MB_MAX];
          for (int64_t m = 0; m < mb; ++m) xs[m] = static_cast<const bf16*>(x) + (m0 + m) * K;
          const int8_t* wq = reinterpret_cast<const int8_t*>(wrow);
          if (g == 16) q8_bf16_rows<16>(mb, xs, K, wq, sp, out);
          else if (g == 32) q8_bf16_rows<32>(mb, xs, K, wq, sp, out);
          else q8_bf16_rows<0>(mb, xs, K, wq, sp, out);  // g = K
          store(y, flags, bias, N, n, m0, mb, out);
          continue;
        }
      }
#if CC_INT8_STRIPS
      if constexpr (Q4) {
        if (int8_q4) {
          Int8Chunks rm[MB_MAX];
          for (int64_t m = 0; m < mb; ++m) rm[m] = int8_chunks(m0 + m);
          const uint8_t* wq = reinterpret_cast<const uint8_t*>(wrow);
          if (mb == 4) row_product_q4_int8<4>(rm, K, wq, sp, mp, shift, out);
          else if (mb == 3) row_product_q4_int8<3>(rm, K, wq, sp, mp, shift, out);
          else if (mb == 2) row_product_q4_int8<2>(rm, K, wq, sp, mp, shift, out);
          else row_product_q4_int8<1>(rm, K, wq, sp, mp, shift, out);
          store(y, flags, bias, N, n, m0, mb, out);
          continue;
        }
      }
#endif
      if constexpr (Q4) {
        if (path == Path::bf16) {
          Bf16Row rm[MB_MAX];
          for (int64_t m = 0; m < mb; ++m) rm[m] = bf16_row(m0 + m);
          const uint8_t* wq = reinterpret_cast<const uint8_t*>(wrow);
          if (mb == 4) row_product_q4_bf16<4>(rm, K, wq, sp, mp, shift, out);
          else if (mb == 3) row_product_q4_bf16<3>(rm, K, wq, sp, mp, shift, out);
          else if (mb == 2) row_product_q4_bf16<2>(rm, K, wq, sp, mp, shift, out);
          else row_product_q4_bf16<1>(rm, K, wq, sp, mp, shift, out);
          store(y, flags, bias, N, n, m0, mb, out);
          continue;
        }
      }
#endif
#if CC_INT8_PATH
      if (path == Path::int8) {
        QuantRow rm[MB_MAX];
        for (int64_t m = 0; m < mb; ++m) rm[m] = quant_row(m0 + m);
        if (mb == 4) row_product_int8<4, Q4>(rm, K, wrow, s, mn, out);
        else if (mb == 3) row_product_int8<3, Q4>(rm, K, wrow, s, mn, out);
        else if (mb == 2) row_product_int8<2, Q4>(rm, K, wrow, s, mn, out);
        else row_product_int8<1, Q4>(rm, K, wrow, s, mn, out);
        store(y, flags, bias, N, n, m0, mb, out);
        continue;
      }
#endif
#if CC_AVX2_ROWS  // factored products (`row_product_q4_sums`, `row_product_q8`)
      if constexpr (Q4) {
        const float* sums = extra + m0 * per_row;
        const uint8_t* wq = reinterpret_cast<const uint8_t*>(wrow);
        if (mb == 4) row_product_q4_sums<4>(xm, sums, K, g, wq, s, mn, out);
        else if (mb == 3) row_product_q4_sums<3>(xm, sums, K, g, wq, s, mn, out);
        else if (mb == 2) row_product_q4_sums<2>(xm, sums, K, g, wq, s, mn, out);
        else row_product_q4_sums<1>(xm, sums, K, g, wq, s, mn, out);
      } else if (avx2_int8) {
        const int8_t* xq[MB_MAX];
        const float* dx[MB_MAX];
        for (int64_t m = 0; m < mb; ++m) xq[m] = x_int8(m0 + m), dx[m] = x_scales(m0 + m);
        const int8_t* wq = reinterpret_cast<const int8_t*>(wrow);
        if (mb == 2) row_product_q8_int8<2>(xq, dx, K, wq, s, out);
        else row_product_q8_int8<1>(xq, dx, K, wq, s, out);
      } else {
        const int8_t* wq = reinterpret_cast<const int8_t*>(wrow);
        if (mb == 4) row_product_q8<4>(xm, K, g, wq, s, out);
        else if (mb == 3) row_product_q8<3>(xm, K, g, wq, s, out);
        else if (mb == 2) row_product_q8<2>(xm, K, g, wq, s, out);
        else row_product_q8<1>(xm, K, g, wq, s, out);
      }
      store(y, flags, bias, N, n, m0, mb, out);
      continue;
#endif
      if (mb == 4) row_product<4, Q4>(xm, K, g, wrow, s, mn, out);
      else if (mb == 3) row_product<3, Q4>(xm, K, g, wrow, s, mn, out);
      else if (mb == 2) row_product<2, Q4>(xm, K, g, wrow, s, mn, out);
      else row_product<1, Q4>(xm, K, g, wrow, s, mn, out);
      store(y, flags, bias, N, n, m0, mb, out);
    }
  }
}

// One weight row dequantized into fp32: the reference's values exactly (scale * q is exact
// in fp32, the min added with one rounding, as torch's mul then add).
template <bool Q4, typename S>
inline void dequantize_row(const void* wrow, const S* s, const S* mn, int64_t K, int64_t g,
                           float* out) {
  for (int64_t gi = 0, k0 = 0; k0 < K; ++gi, k0 += g) {
    const float d = scale1(s[gi]), m = Q4 ? scale1(mn[gi]) : 0.f;
#if defined(__AVX512F__)
    const __m512 scale = _mm512_set1_ps(d);
    if constexpr (Q4) {
      const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
      const __m512 table = _mm512_fmadd_ps(iota, scale, _mm512_set1_ps(m));
      for (int64_t k = k0; k < k0 + g; k += 32) {
        __m512 lo, hi;
        q4_run(static_cast<const uint8_t*>(wrow) + k / 2, table, lo, hi);
        _mm512_storeu_ps(out + k, lo);
        _mm512_storeu_ps(out + k + 16, hi);
      }
    } else {
      for (int64_t k = k0; k < k0 + g; k += 16)
        _mm512_storeu_ps(out + k, q8_16(static_cast<const int8_t*>(wrow) + k, scale));
    }
#else
    for (int64_t k = k0; k < k0 + g; ++k) {
      if constexpr (Q4) {
        const uint8_t byte = static_cast<const uint8_t*>(wrow)[(k / 32) * 16 + (k % 16)];
        out[k] = float((k % 32) < 16 ? byte & 15 : byte >> 4) * d + m;
      } else {
        out[k] = float(static_cast<const int8_t*>(wrow)[k]) * d;
      }
    }
#endif
  }
}

// Rows [N, K] of blocks into a dense weight, the calling thread's share of the rows: a
// prefill's products (more rows than `product_team` reads blocks for) run on this copy;
// torch's own dequantization of the reference took ~10x longer. `flags` bit 0: bf16 (else
// fp32); bit 3 (with bit 0): each row [hi | lo] of 2K bf16, hi = bf16(v), lo = bf16(v - hi),
// so that one bf16 GEMM over [x | x] sums x * v with 16 of v's bits (q8's have up to 19).
template <bool Q4, typename S, bool Compact = false>
void dequantize_team(const void* w, const S* scales, const S* mins, void* out, int64_t flags,
                     int64_t N, int64_t K, int64_t g) {
  const bool bf = flags & 1, split = bf && (flags & 8);
  const bool six = !Q4 && Compact && (flags & 64);  // Q6_K's packed rows, unpacked first
  const auto [begin, end] = share(N);
  const int64_t row_bytes = Q4 ? K / 2 : six ? K / 4 * 3 : K, groups = K / g;
  float* row = scratch(K + 2 * groups + K / 4);
  float *scale_buf = row + K, *min_buf = scale_buf + groups;
  int8_t* unpacked = reinterpret_cast<int8_t*>(min_buf + groups);
  for (int64_t n = begin; n < end; ++n) {
    const char* wrow = static_cast<const char*>(w) + n * row_bytes;
    if (six) {
      unpack_q6_row(reinterpret_cast<const uint8_t*>(wrow), K, unpacked);
      wrow = reinterpret_cast<const char*>(unpacked);
    }
    float* dst = bf ? row : static_cast<float*>(out) + n * K;
    const S* mn = Q4 ? scale_rows<Q4, Compact>(mins, groups, n, 1, min_buf) : nullptr;
    dequantize_row<Q4>(wrow, scale_rows<Q4, Compact>(scales, groups, n, 1, scale_buf), mn, K,
                       g, dst);
    if (!bf) continue;
    bf16* y = static_cast<bf16*>(out) + n * K * (split ? 2 : 1);
    for (int64_t k = 0; k < K; ++k) y[k] = to_bf16(row[k]);
    if (split)  // v - hi is exact in fp32
      for (int64_t k = 0; k < K; ++k) y[K + k] = to_bf16(row[k] - to_f32(y[k]));
  }
}

// Calls f(scales, mins) with both pointers as the type `flags` bit 2 names (fp32, else
// fp16): the one place a call's scale type is chosen, outside every loop. (Compact
// scales, bit 4, are dispatched by the entry points.)
template <typename F>
inline void with_scales(int64_t flags, const void* scales, const void* mins, F&& f) {
  if (flags & 4)
    f(static_cast<const float*>(scales), static_cast<const float*>(mins));
  else
    f(static_cast<const f16*>(scales), static_cast<const f16*>(mins));
}

}  // namespace

extern "C" {

int64_t quant_kernels_available() { return 1; }  // a portable loop where AVX-512 is missing

// 0: the portable loop; 1: fp32 (AVX-512, or AVX2 + FMA); 2: bf16 activations on the integer path
// (int8 activations, VNNI); 3: bf16 activations on the exact bf16 path (AVX512-BF16).
int64_t quant_kernels_vectorized() {
#if CC_BF16_PATH
  return 3;
#elif CC_INT8_PATH
  return 2;
#elif defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
  return 1;
#else
  return 0;
#endif
}

// Whether Q8_0's strips can take int8 activations here (flags bit 5 asks for it).
int64_t quant_kernels_int8_strips() { return CC_INT8_STRIPS; }

// Rows up to which Q8_0's row products take int8 activations where the caller allows them
// (AVX512-VNNI with AVX512-BF16, or AVX2); 0 where none do.
int64_t quant_kernels_int8_rows() { return CC_INT8_STRIPS || CC_AVX2_ROWS ? INT8_ROWS_Q8 : 0; }

// The path a call with bf16 activations takes (`choose`): 0 fp32, 1 bf16, 2 int8; the
// Python side asks rather than repeating the rule.
int64_t quant_kernels_path(int64_t q4, int64_t K, int64_t g, int64_t int8_ok) {
  return int64_t(choose(q4 != 0, 1, K, g, int8_ok != 0));
}

void q4_linear_team(const void* x, int64_t flags, const void* w, const void* scales,
                    const void* mins, const void* bias, void* y, int64_t M, int64_t N, int64_t K,
                    int64_t g) {
  if (flags & 16)
    return product_team<true, float, true>(x, flags, w, static_cast<const float*>(scales),
                                           static_cast<const float*>(mins), bias, y, M, N, K,
                                           g);
  with_scales(flags, scales, mins, [&](auto s, auto mn) {
    product_team<true>(x, flags, w, s, mn, bias, y, M, N, K, g);
  });
}

void q8_linear_team(const void* x, int64_t flags, const void* w, const void* scales,
                    const void* bias, void* y, int64_t M, int64_t N, int64_t K, int64_t g) {
  if (flags & 16)
    return product_team<false, float, true>(x, flags, w, static_cast<const float*>(scales),
                                            nullptr, bias, y, M, N, K, g);
  with_scales(flags, scales, nullptr, [&](auto s, auto mn) {
    product_team<false>(x, flags, w, s, mn, bias, y, M, N, K, g);
  });
}

void q4_linear_region(const void* x, int64_t flags, const void* w, const void* scales,
                      const void* mins, const void* bias, void* y, int64_t M, int64_t N,
                      int64_t K, int64_t g, int64_t threads) {
#pragma omp parallel num_threads(threads)
  q4_linear_team(x, flags, w, scales, mins, bias, y, M, N, K, g);
}

void q8_linear_region(const void* x, int64_t flags, const void* w, const void* scales,
                      const void* bias, void* y, int64_t M, int64_t N, int64_t K, int64_t g,
                      int64_t threads) {
#pragma omp parallel num_threads(threads)
  q8_linear_team(x, flags, w, scales, bias, y, M, N, K, g);
}

// `flags` bit 0: out is bf16 (else fp32); bit 2: scales and mins are fp32 (else fp16);
// bit 3: out is bf16 [hi | lo] rows (`dequantize_team`); bit 4: compact (Q4_K's, Q6_K's);
// bit 6: q8's values packed in 6 bits (Q6_K's).
void dequantize_q4_region(const void* w, const void* scales, const void* mins, void* out,
                          int64_t flags, int64_t N, int64_t K, int64_t g, int64_t threads) {
#pragma omp parallel num_threads(threads)
  if (flags & 16)  // compact: Q4_K's
    dequantize_team<true, float, true>(w, static_cast<const float*>(scales),
                                       static_cast<const float*>(mins), out, flags, N, K, g);
  else
    with_scales(flags, scales, mins, [&](auto s, auto mn) {
      dequantize_team<true>(w, s, mn, out, flags, N, K, g);
    });
}

void dequantize_q8_region(const void* w, const void* scales, void* out, int64_t flags,
                          int64_t N, int64_t K, int64_t g, int64_t threads) {
#pragma omp parallel num_threads(threads)
  if (flags & 16)  // compact: Q6_K's
    dequantize_team<false, float, true>(w, static_cast<const float*>(scales), nullptr, out,
                                        flags, N, K, g);
  else
    with_scales(flags, scales, nullptr, [&](auto s, auto mn) {
      dequantize_team<false>(w, s, mn, out, flags, N, K, g);
    });
}

}  // extern "C"

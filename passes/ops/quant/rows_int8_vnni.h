// Part of quant_kernels.cpp, which includes it inside its anonymous namespace (the build
// inlines the text: passes/native.py `op_source`); bf16 activations quantized to int8 on AVX512-VNNI
// without AVX512-BF16 (groups of 32).

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
      // q4 only: the q8 stream read 0.95x (0.79-1.15) with it here (docs/kernel-choices.md,
      // Prefetch)
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

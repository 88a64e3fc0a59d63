// Part of quant_kernels.cpp, which includes it inside its anonymous namespace (the build
// inlines the text: passes/native.py `op_source`); fp32 activations on AVX-512 (and the weight
// prefetch every AVX-512 path uses), or the portable loop.

#if defined(__AVX512F__)
// Each thread streams its rows of blocks front to back; a prefetch 4 KB ahead keeps the
// stream ahead of the loads. Measured on Zen 4 (2 threads, 1.7B-like products in huge
// pages, bit-identical outputs, docs/kernel-choices.md, Prefetch): q4 1.24-1.38x, q8
// 1.06-1.07x the bytes a second of no prefetch (512 B-8 KB tried; 4 KB best), where the
// bf16 GEMVs read slower with it (`weight_prefetch_bytes`: none on AMD); the integer path
// (built without AVX512-BF16): q4 1.19x. Not measured on Intel, where those GEMVs gain.
// Forced inline: GCC 12 dropped the prefetch from a plain inline function inlined into an
// always_inline caller (the int8 row products lost every prefetcht0, seen in their
// disassembly; a shape read from DRAM ran 0.72-0.92x).
__attribute__((always_inline)) inline void prefetch_weights(const void* at) {
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

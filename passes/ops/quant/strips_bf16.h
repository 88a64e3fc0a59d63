// Part of quant_kernels.cpp, which includes it inside its anonymous namespace (the build
// inlines the text: passes/native.py `op_source`); strips of 16 weight rows for many rows of x,
// exact bf16 products on AVX512-BF16.

#if CC_BF16_PATH
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
#endif

// Part of quant_kernels.cpp, which includes it inside its anonymous namespace (the build
// inlines the text: passes/native.py `op_source`); the K-quants', IQ4's and Q8_0's row
// products on int8 activations with AVX2 (no AVX-512), where the caller allows them (flags
// bit 5).

// As llama.cpp multiplies these formats on AVX2: x quantized per run of 32 against
// max |x| / 127 (`quantize_run8`, as the AVX-512 paths' `quantize_run`), the weights'
// integers times x's bytes by `vpmaddubsw` (an unsigned operand: the weights' codes, or
// IQ4's magnitudes with their signs moved onto x), pairs summed to int32 by `vpmaddwd`,
// then one FMA with both scales. The exact fp32 products (`row_product_q4_sums`,
// `row_product_q8` on rows unpacked to int8) convert every value to float first: ~16
// vector ops for 32 values a row where these take ~7.
// Floats a PairRow takes (K a multiple of 64); outside the guard below: the dispatch in
// quant_kernels.cpp sizes its scratch with it on every CPU.
inline int64_t pair_row_floats(int64_t K) { return K / 4 + K / 8 + K / 16 + K / 32; }

#if CC_AVX2_ROWS
// A row of x for these products: per pair of runs (2p, 2p + 1) 64 bytes, the runs'
// values 0-15, then their values 16-31, as one 256-bit load of the weights' nibbles
// holds them (byte j of a run: value j low, j + 16 high); per pair 8 scales, run 2p's
// four times then run 2p + 1's (the lanes `vpmaddwd` leaves a pair's sums in); x's exact
// sums per run and per 16 values (the mins' and Q6_K's offset's terms).
struct PairRow {
  int8_t* q;       // [K]
  float* scale;    // [K / 64][8]
  float* sum16;    // [K / 16]
  float* sum32;    // [K / 32]
};

inline PairRow pair_row(float* base, int64_t K) {
  float* sum16 = base + K / 4 + K / 8;
  return {reinterpret_cast<int8_t*>(base), base + K / 4, sum16, sum16 + K / 16};
}

inline void quantize_pairs(const float* x, int64_t K, PairRow r) {
  alignas(32) int8_t q[32];
  for (int64_t run = 0; run < K / 32; ++run) {
    const float d = quantize_run8(x + 32 * run, q);
    int8_t* pair = r.q + run / 2 * 64 + run % 2 * 16;
    std::memcpy(pair, q, 16);
    std::memcpy(pair + 32, q + 16, 16);
    for (int i = 0; i < 4; ++i) r.scale[run / 2 * 8 + run % 2 * 4 + i] = d;
    __m256 half[2];
    for (int h = 0; h < 2; ++h) {
      half[h] = _mm256_add_ps(_mm256_loadu_ps(x + 32 * run + 16 * h),
                              _mm256_loadu_ps(x + 32 * run + 16 * h + 8));
      r.sum16[2 * run + h] = hsum8(half[h]);
    }
    r.sum32[run] = hsum8(_mm256_add_ps(half[0], half[1]));
  }
}

// A weight row's codes a pair of runs at a time, `codes(p, lo, hi)`: lo the two runs'
// values 0-15, hi their values 16-31, as bytes. Q4_K's nibbles, Q5_K's 5-bit chunks and
// Q6_K's 6-bit ones give unsigned codes (u: the value before the scale, offset or min);
// IQ4's its table values, signed. `Decoded` reads a row a strip decoded before (below).
struct Q4Codes {
  const uint8_t* w;
  void operator()(int64_t p, __m256i& lo, __m256i& hi) const {
    const __m256i low = _mm256_set1_epi8(0x0f);
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 32 * p));
    lo = _mm256_and_si256(v, low);
    hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
  }
};
struct Q5Codes {
  const uint8_t* w;
  void operator()(int64_t p, __m256i& lo, __m256i& hi) const {
    const uint8_t* chunk = w + p / 2 * Q5_CHUNK_BYTES;
    Q4Codes{chunk + 32 * (p % 2)}(0, lo, hi);  // the chunk's nibble bytes 32 (p % 2)..
    __m256i lo5, hi5;
    fifth_bits(chunk + 64, int(p % 2), lo5, hi5);
    lo = _mm256_or_si256(lo, lo5);
    hi = _mm256_or_si256(hi, hi5);
  }
};
struct Q6Codes {
  const uint8_t* w;
  void operator()(int64_t p, __m256i& lo, __m256i& hi) const {
    q6_half(w + p / 2 * 96, int(p % 2), lo, hi);
  }
};
struct Iq4Codes {
  const uint8_t* w;
  void operator()(int64_t p, __m256i& lo, __m256i& hi) const {
    const __m256i table = _mm256_broadcastsi128_si256(
        _mm_load_si128(reinterpret_cast<const __m128i*>(IQ4_VALUES)));
    Q4Codes{w}(p, lo, hi);
    lo = _mm256_shuffle_epi8(table, lo);
    hi = _mm256_shuffle_epi8(table, hi);
  }
};
struct Q8Codes {  // Q8_0's bytes, two runs in order
  const int8_t* w;
  void operator()(int64_t p, __m256i& lo, __m256i& hi) const {
    const __m256i* at = reinterpret_cast<const __m256i*>(w + 64 * p);
    const __m256i a = _mm256_loadu_si256(at), b = _mm256_loadu_si256(at + 1);
    lo = _mm256_permute2x128_si256(a, b, 0x20);
    hi = _mm256_permute2x128_si256(a, b, 0x31);
  }
};
struct Decoded {
  const int8_t* codes;  // [K / 64][lo 32 | hi 32]
  void operator()(int64_t p, __m256i& lo, __m256i& hi) const {
    const __m256i* at = reinterpret_cast<const __m256i*>(codes + 64 * p);
    lo = _mm256_load_si256(at);
    hi = _mm256_load_si256(at + 1);
  }
};

// One weight row's compact scales (or mins), 8 groups at a time read in place: a
// super-block of Q4_K's, half of Q6_K's (decoding rows into a buffer first cost ~30% of a
// batch-1 product: docs/kernel-choices.md, Int8 activations).
template <bool Q4>
struct Compact8 {
  CompactPtr<Q4> p;
  __m256 operator()(int64_t i) const { return scales8(p + 8 * i); }
};
template <bool Q4>
inline Compact8<Q4> compact8(const float* base, int64_t groups, int64_t n) {
  const uint8_t* row =
      reinterpret_cast<const uint8_t*>(base) + n * CompactPtr<Q4>::row_bytes(groups);
  return {CompactPtr<Q4>{row, row + groups, 0}};
}

// q4 (Q4_K's, Q5_K's codes u < 32) on int8 x: u times x's bytes (`vpmaddubsw`, both halves
// < 2^15 a pair: 31 x 127 x 4), out[m] = sum d dx (u . xq) + sum mn (sum of x); a
// super-block (4 pairs) at a time, its 8 scales and mins in a register each.
template <int MB, typename Codes>
inline void row_product_q4_pairs(const PairRow* rows, int64_t K, Codes codes,
                                 Compact8<true> sc, Compact8<true> mn, float* out) {
  __m256 acc[MB_MAX], mins[MB_MAX];
  for (int m = 0; m < MB; ++m) acc[m] = mins[m] = _mm256_setzero_ps();
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t sb = 0; sb < K / 256; ++sb) {
    const __m256 d8 = sc(sb), m8 = mn(sb);
    for (int m = 0; m < MB; ++m)
      mins[m] = _mm256_fmadd_ps(m8, _mm256_loadu_ps(rows[m].sum32 + 8 * sb), mins[m]);
    for (int q = 0; q < 4; ++q) {
      const int64_t p = 4 * sb + q;
      __m256i lo, hi;
      codes(p, lo, hi);
      const __m256 d = lanes(d8, 2 * q, 2 * q + 1);
      for (int m = 0; m < MB; ++m) {
        const __m256i* xq = reinterpret_cast<const __m256i*>(rows[m].q + 64 * p);
        const __m256i dot =
            _mm256_add_epi16(_mm256_maddubs_epi16(lo, _mm256_loadu_si256(xq)),
                             _mm256_maddubs_epi16(hi, _mm256_loadu_si256(xq + 1)));
        acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(dot, ones)),
                                 _mm256_mul_ps(d, _mm256_loadu_ps(rows[m].scale + 8 * p)),
                                 acc[m]);
      }
    }
  }
  for (int m = 0; m < MB; ++m) out[m] = hsum8(_mm256_add_ps(acc[m], mins[m]));
}

// Q6_K's codes (u < 64) on int8 x: out[m] = sum over groups of 16 of d dx (u . xq) - 32 d
// (sum of x). A chunk (2 pairs) at a time, its 8 groups' scales in a register; a pair's
// low halves are groups 4p and 4p + 2, its high ones 4p + 1 and 4p + 3.
template <int MB, typename Codes>
inline void row_product_q6_pairs(const PairRow* rows, int64_t K, Codes codes,
                                 Compact8<false> sc, float* out) {
  __m256 acc[MB_MAX], odd[MB_MAX], offset[MB_MAX];
  for (int m = 0; m < MB; ++m) acc[m] = odd[m] = offset[m] = _mm256_setzero_ps();
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t c = 0; c < K / 128; ++c) {
    const __m256 d8 = sc(c);
    for (int m = 0; m < MB; ++m)
      offset[m] = _mm256_fmadd_ps(d8, _mm256_loadu_ps(rows[m].sum16 + 8 * c), offset[m]);
    for (int h = 0; h < 2; ++h) {
      const int64_t p = 2 * c + h;
      __m256i u_lo, u_hi;
      codes(p, u_lo, u_hi);
      const __m256 d_lo = lanes(d8, 4 * h, 4 * h + 2), d_hi = lanes(d8, 4 * h + 1, 4 * h + 3);
      for (int m = 0; m < MB; ++m) {
        const __m256i* xq = reinterpret_cast<const __m256i*>(rows[m].q + 64 * p);
        const __m256 dx = _mm256_loadu_ps(rows[m].scale + 8 * p);
        const __m256i lo =
            _mm256_madd_epi16(_mm256_maddubs_epi16(u_lo, _mm256_loadu_si256(xq)), ones);
        const __m256i hi =
            _mm256_madd_epi16(_mm256_maddubs_epi16(u_hi, _mm256_loadu_si256(xq + 1)), ones);
        acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(lo), _mm256_mul_ps(d_lo, dx), acc[m]);
        odd[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(hi), _mm256_mul_ps(d_hi, dx), odd[m]);
      }
    }
  }
  const __m256 minus32 = _mm256_set1_ps(-32.f);
  for (int m = 0; m < MB; ++m)
    out[m] = hsum8(_mm256_fmadd_ps(offset[m], minus32, _mm256_add_ps(acc[m], odd[m])));
}

// Signed values (IQ4's table values, Q8_0's bytes) on int8 x: their magnitudes the
// unsigned operand, their signs moved onto x (as `row_product_q8_int8`; a pair's products
// < 2^15: 127 x 127 x 2); a scale a run.
template <int MB, typename Codes, typename S>
inline void row_product_signed_pairs(const PairRow* rows, int64_t K, Codes codes, const S* s,
                                     float* out) {
  __m256 acc[MB_MAX];
  for (int m = 0; m < MB; ++m) acc[m] = _mm256_setzero_ps();
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t p = 0; p < K / 64; ++p) {
    __m256i w_lo, w_hi;
    codes(p, w_lo, w_hi);
    const __m256i a_lo = _mm256_abs_epi8(w_lo), a_hi = _mm256_abs_epi8(w_hi);
    const __m256 d = two_scales(s + 2 * p);
    for (int m = 0; m < MB; ++m) {
      const __m256i* xq = reinterpret_cast<const __m256i*>(rows[m].q + 64 * p);
      const __m256i lo =
          _mm256_maddubs_epi16(a_lo, _mm256_sign_epi8(_mm256_loadu_si256(xq), w_lo));
      const __m256i hi =
          _mm256_maddubs_epi16(a_hi, _mm256_sign_epi8(_mm256_loadu_si256(xq + 1), w_hi));
      const __m256i dot =
          _mm256_add_epi32(_mm256_madd_epi16(lo, ones), _mm256_madd_epi16(hi, ones));
      acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot),
                               _mm256_mul_ps(d, _mm256_loadu_ps(rows[m].scale + 8 * p)), acc[m]);
    }
  }
  for (int m = 0; m < MB; ++m) out[m] = hsum8(acc[m]);
}

// Many rows of x: 16 weight rows decoded into their codes (`Decoded`, 16 K bytes at `buf`),
// then each block of up to 4 rows of x against the 16, so that x is read once a strip
// rather than once a weight row (a prefill's rows of x outgrow the caches). `with_codes(r,
// f)` calls f with weight row r's reader; `row(r, codes, m0, mb)` runs and stores its
// products.
template <typename WithCodes, typename Row>
inline void pairs_strip(int64_t K, int64_t M, int8_t* buf, WithCodes with_codes, Row row) {
  for (int r = 0; r < TILE_N; ++r)
    with_codes(r, [&](auto codes) {
      for (int64_t p = 0; p < K / 64; ++p) {
        __m256i lo, hi;
        codes(p, lo, hi);
        __m256i* at = reinterpret_cast<__m256i*>(buf + r * K + 64 * p);
        _mm256_store_si256(at, lo);
        _mm256_store_si256(at + 1, hi);
      }
    });
  for (int64_t m0 = 0; m0 < M; m0 += MB_MAX)
    for (int r = 0; r < TILE_N; ++r)
      row(r, Decoded{buf + r * K}, m0, M - m0 < MB_MAX ? M - m0 : MB_MAX);
}
#endif

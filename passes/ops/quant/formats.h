// Part of quant_kernels.cpp, which includes it inside its anonymous namespace (the build
// inlines the text: passes/native.py `op_source`); the formats and what every path shares:
// fp16 and compact scales, x's rows, the row-count constants, Q6_K's 6-bit rows.

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
#if !CC_COMPACT16 && defined(__AVX2__)
// 8 groups from a multiple of 8 (AVX2): one super-block of Q4_K's, half of Q6_K's.
template <bool Q4>
inline __m256 scales8(CompactPtr<Q4> p) {
  const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p.sub + p.at));
  const __m256 sub =
      _mm256_cvtepi32_ps(Q4 ? _mm256_cvtepu8_epi32(bytes) : _mm256_cvtepi8_epi32(bytes));
  float d;
  std::memcpy(&d, p.super + p.at / CompactPtr<Q4>::PER_SUPER * 4, sizeof d);
  return _mm256_mul_ps(sub, _mm256_set1_ps(d));
}
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
#elif defined(__AVX2__)
      for (; gi + 8 <= groups; gi += 8) _mm256_storeu_ps(out + gi, scales8(p + gi));
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
// Runs the statement given (a row product called with MB as its row count) for a block of
// mb = 1..4 rows of x, MB a constant: the row products are templates on the row count
// (accumulators in registers). A generic lambda doing this cost the q8 product 10-15% at 4
// rows (docs/kernel-choices.md); this expands to the same four branches the calls were
// written as.
#define CC_BY_ROWS(mb, ...)                                  \
  do {                                                       \
    if ((mb) == 4) { constexpr int MB = 4; __VA_ARGS__; }      \
    else if ((mb) == 3) { constexpr int MB = 3; __VA_ARGS__; } \
    else if ((mb) == 2) { constexpr int MB = 2; __VA_ARGS__; } \
    else { constexpr int MB = 1; __VA_ARGS__; }                \
  } while (0)
// The bf16 paths take 16 weight rows at a time (strips, below) from TILED_ROWS_* rows of x.
constexpr int TILE_N = 16;
// Rows of x from which the strips beat the row product (raw A/B, docs/kernel-choices.md,
// Strips): q8 1.26x at 6 rows, 0.90x at 4; q4 0.93x at 6, 1.04x at 8; Q5_K's int8 strips
// (its rows unpacked per strip) 0.94x at 12, 1.02x at 14, 1.09x at 16.
constexpr int64_t TILED_ROWS_Q8 = 6, TILED_ROWS_Q4 = 8, TILED_ROWS_Q5 = 16;
// Batch-invariant mode (flags bit 7): up to this many rows the row products, above it the
// strips, each of which gives a row the same bits at any row count and offset; the
// scheduler never puts a query of at most this many tokens in a step of more rows
// (runtime/scheduler.py), so a request's rows always take the same path.
constexpr int64_t INVARIANT_ROWS = 16;
// Rows of x up to which Q8_0's row products may take int8 activations (`int8_x`): raw A/B
// against the exact ones (docs/kernel-choices.md, Int8 activations), 1.7B shapes 1.01x /
// 0.98x / 0.95x / 0.82x / 0.91x at 1-5 rows, 135M shapes 1.16x / 1.14x at 1-2, 0.96x at 4.
constexpr int64_t INT8_ROWS_Q8 = 2;
// log2 of q4's runs a group (bf16 path: 1, 2, 4 ... 16).
inline int runs_shift(int64_t g) {
  int shift = 0;
  while ((32 << shift) < g) ++shift;
  return shift;
}

#if defined(__AVX2__)
// Half h of a Q6_K chunk (its nibble bytes 32h .. 32h + 31: runs 2h, 2h + 1) as u (0-63):
// lo holds the two runs' values 0-15, hi their values 16-31; top bits 0-1 and 4-5 of the
// chunk's top bytes for h = 0, 2-3 and 6-7 for h = 1.
inline void q6_half(const uint8_t* chunk, int h, __m256i& lo, __m256i& hi) {
  const __m256i low = _mm256_set1_epi8(0x0f), top = _mm256_set1_epi8(0x30);
  const __m256i t = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(chunk + 64));
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(chunk + 32 * h));
  const __m256i t_lo = h ? _mm256_slli_epi16(t, 2) : _mm256_slli_epi16(t, 4);
  const __m256i t_hi = h ? _mm256_srli_epi16(t, 2) : t;
  lo = _mm256_or_si256(_mm256_and_si256(v, low), _mm256_and_si256(t_lo, top));
  hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 4), low),
                       _mm256_and_si256(t_hi, top));
}

// lo, hi as q6_half leaves them -> the two runs in order at out (64 values).
inline void store_runs(__m256i lo, __m256i hi, int8_t* out) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), _mm256_permute2x128_si256(lo, hi, 0x20));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 32),
                      _mm256_permute2x128_si256(lo, hi, 0x31));
}
#endif

// Q6_K's 6-bit rows (passes/ops/quantized.py `pack_q6` writes them): per chunk of 128
// values, 64 bytes of low nibbles in q4's order (nibble byte b = 16r + j: run r's value j
// low, j + 16 high), then 32 bytes of the values' top two bits, top byte b % 32 holding
// nibble byte b's low value's in bits 0-1 (b < 32) or 2-3 (b >= 32) and its high value's
// in bits 4-5 or 6-7. A value is u - 32 (Q6_K's own offset). The row products read chunks
// in place (`row_product_q6_bf16`, `row_product_q6_int8`); the other paths read rows
// unpacked to int8 by this.
inline void unpack_q6_row(const uint8_t* w, int64_t K, int8_t* out) {
#if defined(__AVX2__)
  const __m256i offset = _mm256_set1_epi8(32);
  for (int64_t c = 0; c < K / 128; ++c)
    for (int h = 0; h < 2; ++h) {
      __m256i lo, hi;
      q6_half(w + c * 96, h, lo, hi);
      store_runs(_mm256_sub_epi8(lo, offset), _mm256_sub_epi8(hi, offset), out + c * 128 + h * 64);
    }
  return;
#endif
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

constexpr int STRIP_MB = 8;  // rows of x a strip takes at a time (12: no faster)

// Q5_K's 5-bit rows (passes/ops/quant_layout.py `pack_q5` writes them): per chunk of 128
// values, 64 bytes of low nibbles in q4's order (byte b = 16r + j: run r's value j low, j +
// 16 high), then four little-endian 32-bit masks of the values' fifth bits, mask e (e = 0,
// 1) holding the low value's of byte 2i + e in bit i and mask 2 + e its high value's: the
// words q4's bf16 row product widens a chunk into (`row_product_q4_bf16<MB, true>` reads
// chunks in place). The other paths read values unpacked by this (u in [0, 31]).
constexpr int64_t Q5_CHUNK_BYTES = 80;
#if defined(__AVX512F__)
// Four runs' values from q4's order, lo holding run r's values 0-15 in 128-bit lane r and hi
// its 16-31, stored as the runs in order at out (128 values).
inline void store_runs(__m512i lo, __m512i hi, void* out) {
  const __m512i first = _mm512_setr_epi64(0, 1, 8, 9, 2, 3, 10, 11);
  const __m512i second = _mm512_setr_epi64(4, 5, 12, 13, 6, 7, 14, 15);
  _mm512_storeu_si512(out, _mm512_permutex2var_epi64(lo, first, hi));
  _mm512_storeu_si512(static_cast<char*>(out) + 64, _mm512_permutex2var_epi64(lo, second, hi));
}
#endif
#if defined(__AVX512BW__) && defined(__BMI2__)
// A chunk's fifth bits added as 16 to its low values' bytes `lo` and its high values' `hi`
// (its nibbles masked in place: byte b = 16r + j): byte b's bit is bit b / 2 of mask b % 2
// (of 2 + b % 2 for the high values). One bit shuffle a mask (`vpshufbitqmb`) where
// AVX512-BITALG is, else two `_pdep_u64` and an or.
struct Q5Masks {
#if defined(__AVX512BITALG__)
  __m512i pick;  // byte b selects bit 32 (b % 2) + b / 2 of a pair of masks
  Q5Masks() {
    alignas(64) uint8_t index[64];
    for (int b = 0; b < 64; ++b) index[b] = uint8_t(32 * (b % 2) + b / 2);
    pick = _mm512_load_si512(index);
  }
#endif
  void add(const uint8_t* masks, __m512i& lo, __m512i& hi) const {
#if defined(__AVX512BITALG__)
    uint64_t pair[2];  // masks 0 and 1, masks 2 and 3
    std::memcpy(pair, masks, sizeof pair);
    const __mmask64 lo5 = _mm512_bitshuffle_epi64_mask(_mm512_set1_epi64(pair[0]), pick);
    const __mmask64 hi5 = _mm512_bitshuffle_epi64_mask(_mm512_set1_epi64(pair[1]), pick);
#else
    uint32_t fifth[4];
    std::memcpy(fifth, masks, sizeof fifth);
    const uint64_t even = 0x5555555555555555ull, odd = ~even;
    const __mmask64 lo5 = _pdep_u64(fifth[0], even) | _pdep_u64(fifth[1], odd);
    const __mmask64 hi5 = _pdep_u64(fifth[2], even) | _pdep_u64(fifth[3], odd);
#endif
    const __m512i sixteen = _mm512_set1_epi8(0x10);
    lo = _mm512_mask_add_epi8(lo, lo5, lo, sixteen);
    hi = _mm512_mask_add_epi8(hi, hi5, hi, sixteen);
  }
};
#endif

inline void unpack_q5_row(const uint8_t* w, int64_t K, uint8_t* out) {
  int64_t c = 0;
#if defined(__AVX512BW__) && defined(__BMI2__)
  // 128 values a chunk in two stores (the scalar loop below ran the strips 0.15x the row
  // products at 8 rows)
  const Q5Masks fifths;
  const __m512i low = _mm512_set1_epi8(0x0f);
  for (; c < K / 128; ++c) {
    const uint8_t* chunk = w + c * Q5_CHUNK_BYTES;
    const __m512i v = _mm512_loadu_si512(chunk);
    __m512i lo = _mm512_and_si512(v, low), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
    fifths.add(chunk + 64, lo, hi);
    store_runs(lo, hi, out + c * 128);
  }
#endif
  for (; c < K / 128; ++c) {
    const uint8_t* nib = w + c * Q5_CHUNK_BYTES;
    uint32_t fifth[4];
    std::memcpy(fifth, nib + 64, sizeof fifth);
    uint8_t* o = out + c * 128;
    for (int b = 0; b < 64; ++b) {
      const int i = b / 2, e = b % 2, at = b / 16 * 32 + b % 16;
      o[at] = uint8_t((nib[b] & 15) | ((fifth[e] >> i & 1) << 4));
      o[at + 16] = uint8_t((nib[b] >> 4) | ((fifth[2 + e] >> i & 1) << 4));
    }
  }
}

#if defined(__AVX2__)
// Q5_K's fifth bits for half h of a chunk (its nibble bytes 32h .. 32h + 31) as 16 in the
// bytes of its low and its high values: mask e (e = 0, 1) holds nibble byte 2i + e's low
// value's in bit i, mask 2 + e its high value's (`unpack_q5_row`). The four masks in both
// lanes; byte b takes mask b % 2's byte 2h + b / 16 (high values: + 8) and tests bit b / 2
// % 8 of it.
inline void fifth_bits(const uint8_t* masks, int h, __m256i& lo, __m256i& hi) {
  const __m256i m =
      _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(masks)));
  const __m256i pick = _mm256_add_epi8(
      _mm256_setr_epi8(0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4,  //
                       1, 5, 1, 5, 1, 5, 1, 5, 1, 5, 1, 5, 1, 5, 1, 5),
      _mm256_set1_epi8(char(2 * h)));
  const __m256i bit = _mm256_setr_epi8(1, 1, 2, 2, 4, 4, 8, 8, 16, 16, 32, 32, 64, 64, -128,
                                       -128, 1, 1, 2, 2, 4, 4, 8, 8, 16, 16, 32, 32, 64, 64,
                                       -128, -128);
  const __m256i sixteen = _mm256_set1_epi8(16);
  const __m256i l = _mm256_and_si256(_mm256_shuffle_epi8(m, pick), bit);
  const __m256i u = _mm256_and_si256(
      _mm256_shuffle_epi8(m, _mm256_add_epi8(pick, _mm256_set1_epi8(8))), bit);
  lo = _mm256_and_si256(_mm256_cmpeq_epi8(l, bit), sixteen);
  hi = _mm256_and_si256(_mm256_cmpeq_epi8(u, bit), sixteen);
}

#endif

// A Q5_K row's values in fp32 as the reference computes them (scale * u exact, the min
// added with one rounding; g = 32): `u` holds the row unpacked. With AVX-512 a chunk's
// bytes widen in vectors, their fifth bits added through byte masks (as
// `row_product_q4_int8<MB, true>` does): a prefill's dense copy, ~10x the scalar loop.
inline void dequantize_q5_row(const uint8_t* w, const float* s, const float* mn, int64_t K,
                              int64_t g, uint8_t* u, float* out) {
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__BMI2__)
  if (g == 32) {
    const __m512i low = _mm512_set1_epi8(0x0f), sixteen = _mm512_set1_epi8(0x10);
    for (int64_t c = 0; c < K / 128; ++c) {
      const uint8_t* chunk = w + c * Q5_CHUNK_BYTES;
      uint32_t fifth[4];
      std::memcpy(fifth, chunk + 64, sizeof fifth);
      const uint64_t even = 0x5555555555555555ull, odd = ~even;
      const __m512i v = _mm512_loadu_si512(chunk);
      const __m512i l = _mm512_and_si512(v, low);
      const __m512i h = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
      const __mmask64 l5 = _pdep_u64(fifth[0], even) | _pdep_u64(fifth[1], odd);
      const __mmask64 h5 = _pdep_u64(fifth[2], even) | _pdep_u64(fifth[3], odd);
      alignas(64) uint8_t lo[64], hi[64];  // byte b: run b / 16's value b % 16, b % 16 + 16
      _mm512_store_si512(lo, _mm512_mask_add_epi8(l, l5, l, sixteen));
      _mm512_store_si512(hi, _mm512_mask_add_epi8(h, h5, h, sixteen));
      for (int r = 0; r < 4; ++r) {
        const int64_t gi = c * 4 + r;
        const __m512 d = _mm512_set1_ps(s[gi]), m = _mm512_set1_ps(mn[gi]);
        for (int half = 0; half < 2; ++half) {
          const __m128i bytes = _mm_load_si128(reinterpret_cast<const __m128i*>(
              (half ? hi : lo) + 16 * r));
          const __m512 values = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(bytes));
          _mm512_storeu_ps(out + gi * 32 + 16 * half, _mm512_fmadd_ps(values, d, m));
        }
      }
    }
    return;
  }
#elif defined(__AVX2__)
  if (g == 32) {
    const __m256i low = _mm256_set1_epi8(0x0f);
    for (int64_t c = 0; c < K / 128; ++c)
      for (int h = 0; h < 2; ++h) {
        const uint8_t* chunk = w + c * Q5_CHUNK_BYTES;
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(chunk + 32 * h));
        __m256i lo5, hi5;
        fifth_bits(chunk + 64, h, lo5, hi5);
        const __m256i lo = _mm256_or_si256(_mm256_and_si256(v, low), lo5);
        const __m256i hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 4), low), hi5);
        alignas(32) uint8_t runs[64];  // runs 4c + 2h and 4c + 2h + 1 in order
        store_runs(lo, hi, reinterpret_cast<int8_t*>(runs));
        for (int r = 0; r < 2; ++r) {
          const int64_t gi = c * 4 + 2 * h + r;
          const __m256 d = _mm256_set1_ps(s[gi]), m = _mm256_set1_ps(mn[gi]);
          for (int e = 0; e < 4; ++e) {
            const __m128i bytes =
                _mm_loadl_epi64(reinterpret_cast<const __m128i*>(runs + 32 * r + 8 * e));
            const __m256 values = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes));
            _mm256_storeu_ps(out + gi * 32 + 8 * e, _mm256_fmadd_ps(values, d, m));
          }
        }
      }
    return;
  }
#endif
  unpack_q5_row(w, K, u);
  for (int64_t k = 0; k < K; ++k) out[k] = float(u[k]) * s[k / g] + mn[k / g];
}

// IQ4_NL / IQ4_XS: each value one of 16 integers (llama.cpp's `kvalues_iq4nl`), its 4-bit
// index stored in q4's order (run byte j: value j low, j + 16 high). The bf16 row products
// look indices up in place (`row_product_iq4_bf16`); the other paths read rows unpacked to
// int8 by this, as Q8_0's.
alignas(16) constexpr int8_t IQ4_VALUES[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                               1,    13,   25,  38,  53,  69,  89,  113};
// q4's nibbles as they are (Q4_K's int8 strips read its rows unpacked to bytes).
alignas(16) constexpr int8_t Q4_VALUES[16] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
// A row of 4-bit indices in q4's order -> `values`[index] per value, in order.
inline void unpack_nibbles(const uint8_t* w, int64_t K, const int8_t* values, int8_t* out) {
  int64_t run = 0;
#if defined(__AVX512BW__)
  const __m512i table = _mm512_broadcast_i32x4(_mm_load_si128(
      reinterpret_cast<const __m128i*>(values)));
  const __m512i low = _mm512_set1_epi8(0x0f);
  for (; run + 4 <= K / 32; run += 4) {  // 4 runs: 64 bytes of indices
    const __m512i v = _mm512_loadu_si512(w + run * 16);
    const __m512i lo = _mm512_shuffle_epi8(table, _mm512_and_si512(v, low));
    const __m512i hi =
        _mm512_shuffle_epi8(table, _mm512_and_si512(_mm512_srli_epi16(v, 4), low));
    store_runs(lo, hi, out + run * 32);
  }
#elif defined(__AVX2__)
  const __m256i table = _mm256_broadcastsi128_si256(_mm_load_si128(
      reinterpret_cast<const __m128i*>(values)));
  const __m256i low = _mm256_set1_epi8(0x0f);
  for (; run + 2 <= K / 32; run += 2) {  // 2 runs: 32 bytes of indices
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + run * 16));
    store_runs(_mm256_shuffle_epi8(table, _mm256_and_si256(v, low)),
               _mm256_shuffle_epi8(table, _mm256_and_si256(_mm256_srli_epi16(v, 4), low)),
               out + run * 32);
  }
#endif
  for (; run < K / 32; ++run)
    for (int j = 0; j < 16; ++j) {
      out[run * 32 + j] = values[w[run * 16 + j] & 15];
      out[run * 32 + j + 16] = values[w[run * 16 + j] >> 4];
    }
}
inline void unpack_iq4_row(const uint8_t* w, int64_t K, int8_t* out) {
  unpack_nibbles(w, K, IQ4_VALUES, out);
}

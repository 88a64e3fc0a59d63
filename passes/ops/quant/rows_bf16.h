// Part of quant_kernels.cpp, which includes it inside its anonymous namespace (the build
// inlines the text: passes/native.py `op_source`); the exact bf16 row products on AVX512-BF16 (q4,
// Q6_K's 6-bit rows, q8); defines CC_BF16_PATH.

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
// The exact path for q4 and bf16 activations (AVX512-BF16): each nibble q becomes the bf16
// 128 + q (bits 0x4300 | q, exact), `vdpbf16ps` multiplies 32 of them by 32 activations
// exactly and adds in fp32, and the 128 comes off through the run's activation sum:
//   sum_j (d q_j + m) x_j = d sum_j (128 + q_j) x_j + (m - 128 d) sum_j x_j.
// Nothing is rounded but fp32 sums (docs/kernel-choices.md, Int8 activations: the path
// above cost 1.2% perplexity on the shipped model; this path costs nothing and runs at the
// same speed). What one row of x becomes: its values reordered per pair of runs A, B as [A
// 0-15, B 0-15, A 16-31, B 16-31] (the order two runs' low, then high, nibbles widen to),
// and run sums.
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

// FIVE: Q5_K's 5-bit rows (`unpack_q5_row` has the layout): a chunk's four masks of fifth
// bits add 16 to the words that widened its nibbles (bit 4 is clear there, and 128 + u
// stays exact: u < 32), the same sums otherwise; K whole chunks.
template <int MB, bool FIVE = false, typename SP>
inline void row_product_q4_bf16(const Bf16Row* rows, int64_t K, const uint8_t* w, SP s, SP mn,
                                int shift, float* out) {
  __m512 acc[MB_MAX], mins[MB_MAX];
  for (int m = 0; m < MB; ++m) acc[m] = mins[m] = _mm512_setzero_ps();
  const __m512i exponent = _mm512_set1_epi16(0x4300), low = _mm512_set1_epi16(0x000f);
  const int64_t runs = K / 32;
  const __m512i quarter = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
  // A block of 16 runs; FULL (all but a row's last partial one) works out no masks: the
  // K-quants' exact rows 1.20x at one row from L3 (as `row_product_q4_int8`).
  const auto block = [&](int64_t r0, auto full) {
    constexpr bool FULL = decltype(full)::value;
    const int64_t n = FULL || runs - r0 >= 16 ? 16 : runs - r0;
    const __mmask16 live = FULL ? 0xffff : __mmask16((1u << n) - 1);
    const __m512 d = run_scales(s, r0, n, shift);
    const __m512 m_eff = _mm512_fnmadd_ps(d, _mm512_set1_ps(128.f), run_scales(mn, r0, n, shift));
    for (int m = 0; m < MB; ++m)
      mins[m] = _mm512_fmadd_ps(m_eff, _mm512_maskz_loadu_ps(live, rows[m].sum + r0), mins[m]);
    int64_t p = 0;
    for (; p + 4 <= n; p += 4) {  // a chunk of 4 runs: lanes 4i .. 4i + 3 are run p + i
      const int64_t k = (r0 + p) * 32;
      const uint8_t* chunk = FIVE ? w + k / 128 * Q5_CHUNK_BYTES : w + k / 2;
      prefetch_weights(chunk);
      if constexpr (FIVE) prefetch_weights(chunk + 64);
      const __m512i v = _mm512_loadu_si512(chunk);  // 32 words: bytes 2e, 2e + 1
      // Each nibble of a word to the bf16 128 + q in place: no lane crossing, 7 ops for 128
      // values where widening bytes to words first took 8 for 64 (docs/kernel-choices.md).
      __m512i a = _mm512_ternarylogic_epi32(low, v, exponent, 0xea);
      __m512i b = _mm512_ternarylogic_epi32(low, _mm512_srli_epi16(v, 8), exponent, 0xea);
      __m512i c = _mm512_ternarylogic_epi32(low, _mm512_srli_epi16(v, 4), exponent, 0xea);
      __m512i d4 = _mm512_or_si512(_mm512_srli_epi16(v, 12), exponent);
      if constexpr (FIVE) {
        uint32_t fifth[4];
        std::memcpy(fifth, chunk + 64, sizeof fifth);
        const __m512i sixteen = _mm512_set1_epi16(0x10);
        a = _mm512_mask_add_epi16(a, __mmask32(fifth[0]), a, sixteen);
        b = _mm512_mask_add_epi16(b, __mmask32(fifth[1]), b, sixteen);
        c = _mm512_mask_add_epi16(c, __mmask32(fifth[2]), c, sixteen);
        d4 = _mm512_mask_add_epi16(d4, __mmask32(fifth[3]), d4, sixteen);
      }
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
  };
  int64_t r0 = 0;
  if constexpr (MB <= 2)  // (at 3 rows the unrolled blocks ran 0.90x: registers)
    for (; r0 + 16 <= runs; r0 += 16) block(r0, std::true_type{});
  for (; r0 < runs; r0 += 16) block(r0, std::false_type{});
  for (int m = 0; m < MB; ++m) out[m] = _mm512_reduce_add_ps(_mm512_add_ps(acc[m], mins[m]));
}
// IQ4_VALUES as bf16 words 0-15 of a vector (integers, exact in bf16), for `vpermw`.
inline __m512i iq4_bf16_table() {
  const __m512 values = _mm512_cvtepi32_ps(
      _mm512_cvtepi8_epi32(_mm_load_si128(reinterpret_cast<const __m128i*>(IQ4_VALUES))));
  return (__m512i)_mm512_cvtne2ps_pbh(values, values);
}

// IQ4's indices on the same path: each nibble, masked in place as q4's, looks its value up
// as a bf16 word (`vpermw`: IQ4_VALUES are integers, exact in bf16), and `vdpbf16ps`
// multiplies 32 of them by 32 activations exactly; a scale a run (groups of 32), no offset.
// The chunk's products are written out as in `row_product_q4_bf16`: an inline helper for
// the four `vdpbf16ps` cost both products 5-7% end to end (NOTES 62).
template <int MB>
inline void row_product_iq4_bf16(const Bf16Row* rows, int64_t K, const uint8_t* w,
                                 const float* s, float* out) {
  __m512 acc[MB_MAX];
  for (int m = 0; m < MB; ++m) acc[m] = _mm512_setzero_ps();
  const __m512i table = iq4_bf16_table();
  const __m512i low = _mm512_set1_epi16(0x000f);
  const __m512i quarter = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
  const int64_t runs = K / 32;
  for (int64_t r0 = 0; r0 < runs; r0 += 16) {
    const int64_t n = runs - r0 < 16 ? runs - r0 : 16;
    const __m512 d = _mm512_maskz_loadu_ps(__mmask16((1u << n) - 1), s + r0);
    int64_t p = 0;
    for (; p + 4 <= n; p += 4) {  // a chunk of 4 runs: lanes 4i .. 4i + 3 are run p + i
      const int64_t k = (r0 + p) * 32;
      prefetch_weights(w + k / 2);
      const __m512i v = _mm512_loadu_si512(w + k / 2);
      const __m512i a = _mm512_permutexvar_epi16(_mm512_and_si512(v, low), table);
      const __m512i b =
          _mm512_permutexvar_epi16(_mm512_and_si512(_mm512_srli_epi16(v, 8), low), table);
      const __m512i c =
          _mm512_permutexvar_epi16(_mm512_and_si512(_mm512_srli_epi16(v, 4), low), table);
      const __m512i d4 = _mm512_permutexvar_epi16(_mm512_srli_epi16(v, 12), table);
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
    for (; p < n; p += 2) {  // a last pair of runs (x as pairs): lanes 0-7 and 8-15
      const int64_t k = (r0 + p) * 32;
      const __m512i bytes = _mm512_cvtepu8_epi16(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + k / 2)));
      const __m512i lo = _mm512_permutexvar_epi16(_mm512_and_si512(bytes, low), table);
      const __m512i hi = _mm512_permutexvar_epi16(_mm512_srli_epi16(bytes, 4), table);
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
  for (int m = 0; m < MB; ++m) out[m] = _mm512_reduce_add_ps(acc[m]);
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
// (Q8_0) or 16 (Q6_K): `vdpbf16ps`'s lane i sums values 2i and 2i + 1, so lanes 0-7 hold a
// run's first 16 values and lanes 8-15 its last 16, and a group of 16 scales half the
// lanes. G = 0: one scale for the whole row (int8 per output channel), applied once at the
// end. The nibble split this replaced took two products a value and rounded more (offset
// terms that cancel): docs/kernel-choices.md, Strips.
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
      // pipes beside the conversion): 1.15-1.2x at one row (docs/kernel-choices.md).
      const __m512 scale = G == 32 ? _mm512_set1_ps(dv[i]) : _mm512_permutexvar_ps(pick, d);
      for (int m = 0; m < MB; ++m) {
        const __m512bh xv = (__m512bh)_mm512_loadu_si512(xs[m] + k);
        acc[m] = _mm512_fmadd_ps(_mm512_dpbf16_ps(_mm512_setzero_ps(), q, xv), scale, acc[m]);
      }
    }
  }
  for (int m = 0; m < MB; ++m) out[m] = _mm512_reduce_add_ps(acc[m]);
}

// The explicit dispatch on mb (a generic lambda cost 10-15%: docs/kernel-choices.md), once
// per G.
template <int G, typename SP>
inline void q8_bf16_rows(int64_t mb, const bf16* const* xs, int64_t K, const int8_t* w, SP s,
                         float* out) {
  CC_BY_ROWS(mb, row_product_q8_bf16<MB, G>(xs, K, w, s, out));
}

// Many rows (compute-bound): the row products above scale every run of every row. Here
// 16 weight rows at a time (a strip) are widened to bf16 once into a scratch laid out
// by pairs of k across the strip's rows ([K/2][16] pairs of bf16), so that `vdpbf16ps`
// with a broadcast pair of x adds to 16 outputs at once and a group's 16 scales multiply
// 16 outputs once a group: G/2 products and one multiply where the row product takes G/32
// of each. The same exact products and fp32 sums.

#define CC_BF16_PATH 1
#else
#define CC_BF16_PATH 0
#endif

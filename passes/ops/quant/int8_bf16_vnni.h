// Part of quant_kernels.cpp, which includes it inside its anonymous namespace (the build
// inlines the text: passes/native.py `op_source`); int8 activations where AVX512-BF16 and VNNI
// both build: the strips of Q8_0, IQ4, Q4_K and Q6_K, the K-quants' row products; defines
// CC_INT8_STRIPS.

#if CC_BF16_PATH && defined(__AVX512VNNI__)
// Q8_0 strips with int8 activations (many rows: compute-bound). x quantized per run of
// 32 (scale = max |x| / 127, as llama.cpp quantizes activations for its Q8_0 products),
// then offset to unsigned (+128) for `vpdpbusd`, which adds 4 products of u8 x s8 into
// each of 16 int32 lanes: 64 products an instruction where `vdpbf16ps` does 32. The strip
// holds the weights' bytes as quads of k across its 16 rows ([K/4][16] int32), and per run
// -128 * each row's sum of the run's weights, which takes the offset off exactly:
//   sum_j (xq_j + 128) w_j - 128 sum_j w_j = sum_j xq_j w_j   (int32, exact)
// then one fp32 multiply by the weight's and the activation's scales a run.
// Q4_K's strips take the same form: its nibbles are the bytes (0-15), each run's min
// multiplies x's exact run sum (`ms`), as in its row products. Q6_K's too, its values
// (-32..31) the bytes, but its scales are per group of 16: a group's offset and scale
// then come per half run (`parts` below are the weights' groups: a run or half a run).
struct Strip8 {
  __m512i* wq;     // [K/4][16] quads of int8
  __m512i* minus;  // [parts][16] int32: -128 * the part's weight sum
  float* ds;       // [parts][16] the weights' scales
  float* ms;       // [parts][16] q4's mins (unused for q8)
};

// `groups`: a row's scales, one a run (K / 32) or a half run (K / 16); `mins`: q4's,
// decoded as the scales ([16][groups]); nullptr for q8.
template <typename S>
inline void pack_strip_int8(const int8_t* w, const S* s, const float* mins, int64_t K,
                            int64_t groups, Strip8 st) {
  for (int64_t k = 0; k < K; k += 64) {
    __m512i r[16];
    for (int n = 0; n < TILE_N; ++n) r[n] = _mm512_loadu_si512(w + n * K + k);
    transpose16(r);
    for (int j = 0; j < 16; ++j) _mm512_store_si512(st.wq + k / 4 + j, r[j]);
  }
  const __m512i ones = _mm512_set1_epi8(1);
  auto parts = [&](auto quads) {  // a compile-time count: Q8_0's 16-row strips ran 0.93x
    for (int64_t part = 0; part < groups; ++part) {
      __m512i sum = _mm512_setzero_si512();
      for (int q = 0; q < decltype(quads)::value; ++q)
        sum = _mm512_dpbusd_epi32(sum, ones, _mm512_load_si512(st.wq + part * quads + q));
      _mm512_store_si512(st.minus + part, _mm512_sub_epi32(_mm512_setzero_si512(),
                                                           _mm512_slli_epi32(sum, 7)));
      for (int n = 0; n < TILE_N; ++n) st.ds[part * TILE_N + n] = scale1(s[n * groups + part]);
      for (int n = 0; mins && n < TILE_N; ++n)
        st.ms[part * TILE_N + n] = mins[n * groups + part];
    }
  };
  if (K / 4 / groups == 8) parts(std::integral_constant<int, 8>{});
  else parts(std::integral_constant<int, 4>{});
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

// q4 with int8 activations (the K-quants' products where `int8_x` allows it, as llama.cpp
// multiplies Q4_K by Q8_K): x quantized per run of 32 as above, laid out per chunk of 4
// runs as the nibbles unpack, the runs' first 16 values (low nibbles), then their last 16
// (high); a last pair of runs (K % 128 == 64) padded with zeros to a chunk. `vpdpbusd`
// multiplies the nibbles as they are (unsigned bytes) by x's: two instructions and two
// masks a chunk where the exact path widens four vectors to bf16 (1.66x from cache, 1.45x
// from memory: docs/kernel-choices.md, Int8 activations).
struct Int8Chunks {
  int8_t* q;     // [K rounded up to 128]
  float* scale;  // [K/32]: the run's activation scale
  float* sum;    // [K/32]: the run's sum of x (fp32, for the mins); Q6_K's: [K/16], per 16;
                 // IQ4's: of x as quantized (scale x the sum of q)
};

inline int64_t chunked(int64_t K) { return (K + 127) / 128 * 128; }

// What `Int8Chunks::sum` holds: x's exact sums per run of 32 (q4's mins), per 16 (Q6_K's
// offset), or the sums of x as quantized, per run (IQ4's offset, which then cancels).
enum class RunSums { exact, exact16, quantized };

inline void quantize_chunks(const bf16* x, int64_t K, Int8Chunks r, RunSums sums) {
  std::memset(r.q + K / 128 * 128, 0, chunked(K) - K / 128 * 128);
  for (int64_t run = 0; run < K / 32; ++run) {
    __m512 v[2];
    for (int h = 0; h < 2; ++h)
      v[h] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(
          reinterpret_cast<const __m256i*>(x + run * 32 + h * 16))), 16));
    alignas(32) int8_t q[32];
    r.scale[run] = quantize_run(v[0], v[1], _mm_setzero_si128(), q);
    if (sums == RunSums::exact16) {
      r.sum[2 * run] = _mm512_reduce_add_ps(v[0]);
      r.sum[2 * run + 1] = _mm512_reduce_add_ps(v[1]);
    } else if (sums == RunSums::quantized) {
      int total = 0;
      for (int i = 0; i < 32; ++i) total += q[i];
      r.sum[run] = r.scale[run] * float(total);
    } else {
      r.sum[run] = _mm512_reduce_add_ps(_mm512_add_ps(v[0], v[1]));
    }
    int8_t* chunk = r.q + run / 4 * 128 + run % 4 * 16;
    std::memcpy(chunk, q, 16);
    std::memcpy(chunk + 64, q + 16, 16);
  }
}

// Each byte's high nibble as a byte: one GF(2) affine op where GFNI builds (each output
// bit i < 4 is input bit i + 4), else a shift and a mask.
inline __m512i high_nibbles(__m512i v) {
#if defined(__GFNI__)
  return _mm512_gf2p8affine_epi64_epi8(v, _mm512_set1_epi64(0x1020408000000000ll), 0);
#else
  return _mm512_and_si512(_mm512_srli_epi16(v, 4), _mm512_set1_epi8(0x0f));
#endif
}

// FIVE: Q5_K's 5-bit rows (`unpack_q5_row`), their fifth bits added as 16 to the bytes
// (u < 32 stays unsigned): a chunk's four word masks interleave into one byte mask for the
// low nibbles and one for the high (`_pdep_u64`); K whole chunks. IQ4: IQ4's indices
// (fp32 scales a run, no mins), each looked up as its value + 128, an unsigned byte
// (`vpshufb`); the 128 comes off through the run sums of x as quantized (RunSums),
// so that it cancels exactly and the error is only x's quantization's, as Q8_0's.
// Inlined, and its blocks inlined into it: the compiler's own choice left a call a row
// (Q4_K's one row 0.71x) or a call a block of 16 runs (0.65x).
template <int MB, bool FIVE = false, bool IQ4 = false, typename SP>
__attribute__((always_inline)) inline void row_product_q4_int8(
    const Int8Chunks* rows, int64_t K, const uint8_t* w, SP s, SP mn, int shift, float* out) {
  __m512 acc[MB_MAX], mins[MB_MAX];
  for (int m = 0; m < MB; ++m) acc[m] = mins[m] = _mm512_setzero_ps();
  const __m512i low = _mm512_set1_epi8(0x0f);
  const __m512i quarter = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
  const Q5Masks fifths;
  const __m512i iq4_bytes = _mm512_add_epi8(  // IQ4_VALUES + 128 in each 128-bit lane
      _mm512_broadcast_i32x4(_mm_load_si128(reinterpret_cast<const __m128i*>(IQ4_VALUES))),
      _mm512_set1_epi8(char(0x80)));
  const int64_t runs = K / 32;
  // A block of 16 runs; FULL (every block but a row's last partial one): no masks to
  // work out, plain loads. One row from L3, where each chunk computed its load's mask:
  // Q4_K 1.19-1.23x, Q5_K 1.14x, IQ4 1.20x; shapes read from DRAM level
  // (benchmarks/ab_quant_raw.py; docs/kernel-choices.md, Quantized row products).
  const auto block = [&](int64_t r0, auto full) __attribute__((always_inline)) {
    constexpr bool FULL = decltype(full)::value;
    const int64_t n = FULL || runs - r0 >= 16 ? 16 : runs - r0;
    const __mmask16 live = FULL ? 0xffff : __mmask16((1u << n) - 1);
    const __m512 d = run_scales(s, r0, n, shift);
    const __m512 m_run =
        IQ4 ? _mm512_mul_ps(d, _mm512_set1_ps(-128.f)) : run_scales(mn, r0, n, shift);
    __m512 comb[MB_MAX];  // d x the run's activation scale (0 past the row's runs)
    for (int m = 0; m < MB; ++m) {
      comb[m] = _mm512_mul_ps(d, _mm512_maskz_loadu_ps(live, rows[m].scale + r0));
      mins[m] = _mm512_fmadd_ps(m_run, _mm512_maskz_loadu_ps(live, rows[m].sum + r0), mins[m]);
    }
    for (int64_t p = 0; p < n; p += 4) {  // lanes 4i .. 4i + 3: run p + i
      const int64_t k = (r0 + p) * 32;
      const uint8_t* chunk = FIVE ? w + k / 128 * Q5_CHUNK_BYTES : w + k / 2;
      prefetch_weights(chunk);
      if constexpr (FIVE) prefetch_weights(chunk + 64);
      const __mmask64 bytes = n - p >= 4 ? ~0ull : (1ull << ((n - p) * 16)) - 1;
      const __m512i v = FULL ? _mm512_loadu_si512(chunk) : _mm512_maskz_loadu_epi8(bytes, chunk);
      __m512i lo = _mm512_and_si512(v, low);
      __m512i hi = high_nibbles(v);
      if constexpr (FIVE) fifths.add(chunk + 64, lo, hi);
      if constexpr (IQ4) {
        lo = _mm512_shuffle_epi8(iq4_bytes, lo);
        hi = _mm512_shuffle_epi8(iq4_bytes, hi);
      }
      const __m512i at = _mm512_add_epi32(_mm512_set1_epi32(int(p)), quarter);
      for (int m = 0; m < MB; ++m) {
        const int8_t* xq = rows[m].q + k;
        __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, _mm512_loadu_si512(xq));
        dot = _mm512_dpbusd_epi32(dot, hi, _mm512_loadu_si512(xq + 64));
        acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_permutexvar_ps(at, comb[m]),
                                 acc[m]);
      }
    }
  };
  int64_t r0 = 0;
  if constexpr (MB <= 2 || !IQ4)  // (IQ4's at 3 rows ran 0.93x: registers)
    for (; r0 + 16 <= runs; r0 += 16) block(r0, std::true_type{});
  for (; r0 < runs; r0 += 16) block(r0, std::false_type{});
  for (int m = 0; m < MB; ++m) out[m] = _mm512_reduce_add_ps(_mm512_add_ps(acc[m], mins[m]));
}

// The K-quants' products for 2-MB_MAX rows of x, out of line: inlined into the row loop
// as the one-row product is, 2 rows ran 0.83-0.85x (IQ4's gain inlined: 1.0-1.2x).
template <int MB, bool FIVE = false, bool IQ4 = false, typename SP>
__attribute__((noinline)) void rows_product_q4_int8(const Int8Chunks* rows, int64_t K,
                                                    const uint8_t* w, SP s, SP mn, int shift,
                                                    float* out) {
  row_product_q4_int8<MB, FIVE, IQ4>(rows, K, w, s, mn, shift, out);
}

// Q6_K's packed values on int8 activations (x as for q4's: `Int8Chunks`, plus its sums
// per 16 in `sum`): each u (0-63) as an unsigned byte beside x's, its nibble or'ed with its
// top bits shifted by half (9 ops a chunk where the bf16 path takes 14 to widen), and
//   sum_j d q_j x_j ~ d dx sum_j u_j xq_j - 32 d sum_j x_j
// per group of 16 (the 32 through x's exact sums). A chunk's low nibbles are its runs'
// first 16 values (even groups), its high ones their last 16 (odd groups).
// Forced inline into its one-row loop (1.07-1.09x at one row, the Q4_K_M head's shape
// from DRAM too); the general loop's 2-4 rows inline it as before.
template <int MB>
__attribute__((always_inline)) inline void row_product_q6_int8(const Int8Chunks* rows, int64_t K, const uint8_t* w,
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

// out[m][0..15] = x[m] . the strip's rows for MB quantized rows of x; MINS (q4): plus
// each run's mins times x's exact run sums (`sums[m]`); HALVES = 2: the weights' groups
// are half runs (Q6_K's 16), each with its own offset and scale.
template <int MB, bool MINS, int HALVES>
inline void strip_rows_int8(const uint8_t* xq, const float* sx, const float* const* sums,
                            int64_t K, Strip8 st, float* out) {
  constexpr int QUADS = 8 / HALVES;
  __m512 acc[STRIP_MB];
  for (int m = 0; m < MB; ++m) acc[m] = _mm512_setzero_ps();
  const int64_t runs = K / 32;
  for (int64_t run = 0; run < runs; ++run)
    for (int h = 0; h < HALVES; ++h) {
      const int64_t part = run * HALVES + h;
      __m512i t[STRIP_MB];
      const __m512i start = _mm512_load_si512(st.minus + part);
      for (int m = 0; m < MB; ++m) t[m] = start;
      for (int q = 0; q < QUADS; ++q) {
        const __m512i w = _mm512_load_si512(st.wq + part * QUADS + q);
        for (int m = 0; m < MB; ++m) {
          int32_t quad;
          std::memcpy(&quad, xq + m * K + part * QUADS * 4 + q * 4, 4);
          t[m] = _mm512_dpbusd_epi32(t[m], _mm512_set1_epi32(quad), w);
        }
      }
      const __m512 d = _mm512_loadu_ps(st.ds + part * TILE_N);
      for (int m = 0; m < MB; ++m)
        acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(t[m]),
                                 _mm512_mul_ps(d, _mm512_set1_ps(sx[m * runs + run])), acc[m]);
      if constexpr (MINS) {
        const __m512 mn = _mm512_loadu_ps(st.ms + part * TILE_N);
        for (int m = 0; m < MB; ++m)
          acc[m] = _mm512_fmadd_ps(mn, _mm512_set1_ps(sums[m][part]), acc[m]);
      }
    }
  for (int m = 0; m < MB; ++m) _mm512_storeu_ps(out + m * TILE_N, acc[m]);
}

template <bool MINS, int HALVES>
inline void strip_rows_int8_mb(int64_t mb, const uint8_t* xq, const float* sx,
                               const float* const* sums, int64_t K, Strip8 st, float* out) {
  switch (mb) {
    case 8: return strip_rows_int8<8, MINS, HALVES>(xq, sx, sums, K, st, out);
    case 7: return strip_rows_int8<7, MINS, HALVES>(xq, sx, sums, K, st, out);
    case 6: return strip_rows_int8<6, MINS, HALVES>(xq, sx, sums, K, st, out);
    case 5: return strip_rows_int8<5, MINS, HALVES>(xq, sx, sums, K, st, out);
    case 4: return strip_rows_int8<4, MINS, HALVES>(xq, sx, sums, K, st, out);
    case 3: return strip_rows_int8<3, MINS, HALVES>(xq, sx, sums, K, st, out);
    case 2: return strip_rows_int8<2, MINS, HALVES>(xq, sx, sums, K, st, out);
    default: return strip_rows_int8<1, MINS, HALVES>(xq, sx, sums, K, st, out);
  }
}
#define CC_INT8_STRIPS 1  // AVX512-BF16 CPUs: Zen 4, Sapphire Rapids and later
#endif

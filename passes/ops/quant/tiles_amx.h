// Part of quant_kernels.cpp, which includes it inside its anonymous namespace (the build
// inlines the text: passes/native.py `op_source`); exact products on AMX tiles for a few
// rows of x (a verification's 1 + k tokens, a decode batch, a short prompt chunk): q4
// (Q4_0, Q4_1, Q4_K), Q5_K's 5-bit rows, Q8_0, Q6_K's 6-bit rows and IQ4; defines
// CC_AMX_TILES.
//
// Above two rows the bf16 row products are bound by `vdpbf16ps` (32 products an
// instruction, each extra row of x costing what the first did), where one `tdpbf16ps` makes
// 16 x 32 x (rows of x) products. The weights stay in their stored layout: each 16-row group
// of w is unpacked a pair of runs at a time into tiles A (16 weight rows x 32 values, the
// bf16 128 + q as in `row_product_q4_bf16`; Q8_0's integers as they are; Q6_K's 128 + u;
// IQ4's table values),
// x's runs are tile B (16 value pairs x up to 16 rows), and tile C = A B holds one scale
// group's exact sums (a run of 32; Q6_K's 16, a tile of half a run) for 16 weight rows x
// the rows of x:
//   sum_j (d q_j + m) x_j = d sum_j (128 + q_j) x_j + (m - 128 d) sum_j x_j,
// (Q6_K: q = u - 32, m = 0, so -160 d), scaled by the group's d (and its offset's term
// added) in fp32 per group, as the row products do.
// Exact as the bf16 path is (bf16 products, fp32 sums); a row's bits differ from the row
// products', so batch-invariant mode keeps the row products (docs/kernel-choices.md, AMX
// tiles).

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__F16C__)
#define CC_AMX_TILES 1
#include <sys/syscall.h>
#include <unistd.h>

// Rows of x the tiles take (Q4_0, Q4_1, Q8_0: groups of 32, fp16 scales; the K-quants):
// below 3 the row products are as fast (memory-bound); above 64 the dense copy's GEMM
// (passes/ops/quantized.py).
constexpr int64_t AMX_ROWS_MIN = 3, AMX_ROWS_MAX = 64;
// Q4_K's row products on int8 activations (where allowed) are as fast as the tiles up to
// this many rows (1.7B's shapes: 1.03x / 1.04x / 1.05x the tiles at 3 / 4 / 5 rows, 0.89x
// at 6): they keep them.
constexpr int64_t AMX_INT8_ROWS_Q4K = 5;
// Q5_K's likewise (the tiles 0.98x its int8 row products at 6 rows, 1.12x at 8, 1.47x at
// 16; those took every row count before).
constexpr int64_t AMX_INT8_ROWS_Q5K = 5;

// Linux hands AMX's tile state to a process only on request (arch_prctl
// ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA); oneDNN makes the same request.
inline bool amx_ready() {
  static const bool ok = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return ok;
}

// Lanes [0, n) of 16 (all where n >= 16).
inline __mmask16 live16(int64_t n) { return n < 16 ? __mmask16((1u << n) - 1) : 0xffff; }

struct TileConfig {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// What the tiles multiply: q4's nibbles (fp16 or compact scales, mins), Q5_K's 5-bit rows
// (compact scales, mins), Q8_0's int8 (fp16 scales), Q6_K's 6-bit rows (compact scales of
// groups of 16), IQ4's table indices (fp32 scales).
enum class Tiled { q4, q5, q8, q6, iq4 };
constexpr bool with_mins(Tiled kind) { return kind == Tiled::q4 || kind == Tiled::q5; }

// Tiles 0, 1: C (16 weight rows x mp fp32); 2, 3: A (16 x 2 `pairs` bf16); 4, 5: B (`pairs`
// value pairs x mp). A group of 32 values is 16 pairs; Q6_K's groups of 16, 8.
inline void configure_tiles(int mp, int pairs) {
  alignas(64) TileConfig c{};
  c.palette = 1;
  for (int t = 0; t < 6; ++t) {
    c.rows[t] = t >= 4 ? pairs : 16;
    c.colsb[t] = t == 2 || t == 3 ? pairs * 4 : mp * 4;
  }
  // GCC drops stores it cannot see read: `ldtilecfg`'s operand is not declared as one.
  asm volatile("" : : "r"(&c) : "memory");
  _tile_loadconfig(&c);
}

// x's rows [m0, m0 + mp) as tile B, run by run ([run][pair t][row][2 values], rows past M
// zero), and their sums over each group of `len` values (none for 0), lane l of a group's
// 16 holding row l % mp's (`row_sums`: K / len floats of room).
inline void tile_rows(const bf16* x, int64_t M, int64_t K, int64_t m0, int mp, bf16* b,
                      float* sums, int len, float* row_sums) {
  const int64_t runs = K / 32;
  uint32_t* pairs = reinterpret_cast<uint32_t*>(b);
  for (int m = 0; m < mp; ++m) {
    const bool live = m0 + m < M;
    const uint32_t* row = reinterpret_cast<const uint32_t*>(x + (m0 + m) * K);
    for (int64_t r = 0; r < runs; ++r)
      for (int t = 0; t < 16; ++t) pairs[(r * 16 + t) * mp + m] = live ? row[r * 16 + t] : 0u;
  }
  if (!len) return;
  const int64_t groups = K / len;
  // Padding rows' lanes are left as they are: lanes never mix, and theirs are not stored.
  for (int m = 0; m < mp && m0 + m < M; ++m) {
    run_sums(x + (m0 + m) * K, K, row_sums, len);  // as the row products sum them
    for (int64_t g = 0; g < groups; ++g)
      for (int l = m; l < 16; l += mp) sums[g * 16 + l] = row_sums[g];
  }
}

// A [16, runs] block of fp16 scales (row stride `runs`) as [runs, 16]: an 8 x 8 transpose
// of words within each 128-bit lane, four lanes at once, then the lanes in order.
inline void transpose_scales(const f16* in, int64_t runs, f16* out) {
  for (int64_t r0 = 0; r0 < runs; r0 += 16) {
    const int64_t n = runs - r0 < 16 ? runs - r0 : 16;
    const __mmask16 live = __mmask16((1u << n) - 1);
    __m512i z[8], t[8], u[8];
    for (int i = 0; i < 8; ++i)
      z[i] = _mm512_inserti64x4(
          _mm512_castsi256_si512(_mm256_maskz_loadu_epi16(live, in + i * runs + r0)),
          _mm256_maskz_loadu_epi16(live, in + (i + 8) * runs + r0), 1);
    for (int j = 0; j < 4; ++j) {
      t[2 * j] = _mm512_unpacklo_epi16(z[2 * j], z[2 * j + 1]);
      t[2 * j + 1] = _mm512_unpackhi_epi16(z[2 * j], z[2 * j + 1]);
    }
    for (int j = 0; j < 2; ++j)
      for (int h = 0; h < 2; ++h) {
        u[4 * j + h] = _mm512_unpacklo_epi32(t[4 * j + h], t[4 * j + 2 + h]);
        u[4 * j + 2 + h] = _mm512_unpackhi_epi32(t[4 * j + h], t[4 * j + 2 + h]);
      }
    constexpr int column[8] = {0, 1, 4, 5, 2, 3, 6, 7};  // which column v[i]'s lanes hold
    for (int q = 0; q < 4; ++q)
      for (int h = 0; h < 2; ++h) {
        const __m512i v = h ? _mm512_unpackhi_epi64(u[q], u[4 + q])
                            : _mm512_unpacklo_epi64(u[q], u[4 + q]);
        const __m512i w = _mm512_shuffle_i64x2(v, v, 0xd8);  // lanes 0, 2, 1, 3
        const int c = column[2 * q + h];
        if (c < n) _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + (r0 + c) * 16),
                                       _mm512_castsi512_si256(w));
        if (c + 8 < n) _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + (r0 + c + 8) * 16),
                                           _mm512_extracti64x4_epi64(w, 1));
      }
  }
}

// Row n's scales of groups [g0, g0 + 16) (`v`, lanes past `groups` dead) into column n of
// out [groups, 16].
inline void scatter_column(float* out, int n, int64_t g0, int64_t groups, __m512 v) {
  const __m512i column = _mm512_mullo_epi32(
      _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
      _mm512_set1_epi32(16));
  _mm512_mask_i32scatter_ps(out + g0 * 16 + n, live16(groups - g0), column, v, 4);
}

// A [16, runs] block of fp32 scales (IQ4's) as [runs, 16].
inline void transpose_scales(const float* in, int64_t runs, float* out) {
  for (int n = 0; n < 16; ++n)
    for (int64_t r0 = 0; r0 < runs; r0 += 16)
      scatter_column(out, n, r0, runs,
                     _mm512_maskz_loadu_ps(live16(runs - r0), in + n * runs + r0));
}

// The compact scales (or mins) of weight rows [n0, n0 + 16) as fp32 [groups, 16]: super x
// sub, exact in fp32 (quant/formats.h `CompactPtr`; Q4_K's runs, Q6_K's groups of 16),
// decoded 16 groups a row and scattered into place.
template <bool Q4>
inline void compact_scales(const float* base, int64_t groups, int64_t n0, float* out) {
  for (int n = 0; n < 16; ++n) {
    const CompactPtr<Q4> row = fields_at<Q4, true>(base, groups, n0 + n, base);
    for (int64_t g0 = 0; g0 < groups; g0 += 16)
      scatter_column(out, n, g0, groups, scales16(row + g0, live16(groups - g0)));
  }
}

// Weight row n's runs r, r + 1 into the two A tiles (`a`, `a + 512`) from its 32 words of
// low nibbles' values (runs r, r + 1's values 0-15) and high (16-31): each run's halves
// put together.
inline void put_runs(bf16* a, int n, __m512i lo, __m512i hi) {
  _mm512_store_si512(a + n * 32, _mm512_shuffle_i64x2(lo, hi, 0x44));
  _mm512_store_si512(a + 512 + n * 32, _mm512_shuffle_i64x2(lo, hi, 0xee));
}

// Runs r, r + 1 of 16 weight rows from n0 as two A tiles (`a`, `a + 512`): a row's 32 bytes
// widen to words, low nibbles (values 0-15 of each run) and high (16-31) made bf16 in
// place, each run's two halves put together.
inline void unpack_pair(const uint8_t* w, int64_t K, int64_t n0, int64_t r, bf16* a) {
  const __m512i exponent = _mm512_set1_epi16(0x4300), low = _mm512_set1_epi16(0x000f);
  for (int n = 0; n < 16; ++n) {
    const uint8_t* p = w + (n0 + n) * (K / 2) + r * 16;
    const __m512i bytes =
        _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    const __m512i lo = _mm512_ternarylogic_epi32(low, bytes, exponent, 0xea);
    const __m512i hi = _mm512_or_si512(_mm512_srli_epi16(bytes, 4), exponent);
    put_runs(a, n, lo, hi);
  }
}

// Q5_K's runs r, r + 1 (r even) of 16 weight rows as two A tiles, as `unpack_pair` lays
// q4's out (quant/formats.h `unpack_q5_row` has the layout): each nibble's fifth bit, from
// the chunk's four masks (low and high nibbles of even and odd bytes), adds 16 to the bf16
// 128 + q it widened to (bit 4 is clear there; 128 + u stays exact: u < 32).
inline void unpack_pair_q5(const uint8_t* w, int64_t K, int64_t n0, int64_t r, bf16* a) {
  const __m512i exponent = _mm512_set1_epi16(0x4300), low = _mm512_set1_epi16(0x000f),
                sixteen = _mm512_set1_epi16(0x0010);
  const int at = r % 4 * 8;  // the pair's first byte's bit in the masks
  for (int n = 0; n < 16; ++n) {
    const uint8_t* chunk = w + (n0 + n) * (K / 128 * Q5_CHUNK_BYTES) + r / 4 * Q5_CHUNK_BYTES;
    uint32_t fifth[4];
    std::memcpy(fifth, chunk + 64, sizeof fifth);
    const __mmask32 lo5 = _pdep_u32(fifth[0] >> at, 0x55555555u) |
                          _pdep_u32(fifth[1] >> at, 0xaaaaaaaau);
    const __mmask32 hi5 = _pdep_u32(fifth[2] >> at, 0x55555555u) |
                          _pdep_u32(fifth[3] >> at, 0xaaaaaaaau);
    const __m512i bytes = _mm512_cvtepu8_epi16(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(chunk + r % 4 * 16)));
    __m512i lo = _mm512_ternarylogic_epi32(low, bytes, exponent, 0xea);
    __m512i hi = _mm512_or_si512(_mm512_srli_epi16(bytes, 4), exponent);
    lo = _mm512_mask_add_epi16(lo, lo5, lo, sixteen);
    hi = _mm512_mask_add_epi16(hi, hi5, hi, sixteen);
    put_runs(a, n, lo, hi);
  }
}

// IQ4's runs r, r + 1 of 16 weight rows as two A tiles, as `unpack_pair` lays q4's out:
// each index looks its value up as a bf16 word (IQ4_VALUES are integers, exact in bf16).
inline void unpack_pair_iq4(const uint8_t* w, int64_t K, int64_t n0, int64_t r, bf16* a) {
  const __m512i table = iq4_bf16_table();
  const __m512i low = _mm512_set1_epi16(0x000f);
  for (int n = 0; n < 16; ++n) {
    const uint8_t* p = w + (n0 + n) * (K / 2) + r * 16;
    const __m512i bytes =
        _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    const __m512i lo = _mm512_permutexvar_epi16(_mm512_and_si512(bytes, low), table);
    const __m512i hi = _mm512_permutexvar_epi16(_mm512_srli_epi16(bytes, 4), table);
    put_runs(a, n, lo, hi);
  }
}

// Q8_0's runs r, r + 1 of 16 weight rows as two A tiles: each int8 is exact in bf16.
inline void unpack_pair_q8(const int8_t* w, int64_t K, int64_t n0, int64_t r, bf16* a) {
  for (int n = 0; n < 16; ++n) {
    const int8_t* p = w + (n0 + n) * K + r * 32;
    for (int h = 0; h < 2; ++h) {
      const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 32 * h))));
      const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 32 * h + 16))));
      _mm512_store_si512(a + h * 512 + n * 32, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
    }
  }
}

// Q6_K's runs r, r + 1 (r even) of 16 weight rows as two A tiles, as `unpack_pair` lays
// q4's out (quant/formats.h `unpack_q6_row` has the layout): each value the bf16 128 + u,
// its nibble from the chunk's 32 nibble bytes of the pair, its top two bits from the
// chunk's top bytes (bits 0-1 and 4-5 for runs 0-1, 2-3 and 6-7 for runs 2-3).
inline void unpack_pair_q6(const uint8_t* w, int64_t K, int64_t n0, int64_t r, bf16* a) {
  const __m512i exponent = _mm512_set1_epi16(0x4300), low = _mm512_set1_epi16(0x000f),
                two = _mm512_set1_epi16(0x0030);
  const int shift = r % 4 ? 2 : 0;
  for (int n = 0; n < 16; ++n) {
    const uint8_t* chunk = w + (n0 + n) * (K / 4 * 3) + r / 4 * 96;
    const __m512i bytes = _mm512_cvtepu8_epi16(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(chunk + r % 4 * 16)));
    const __m512i top = _mm512_cvtepu8_epi16(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(chunk + 64)));
    const __m512i lo = _mm512_or_si512(
        _mm512_ternarylogic_epi32(low, bytes, exponent, 0xea),
        _mm512_and_si512(_mm512_slli_epi16(top, 4 - shift), two));
    const __m512i hi = _mm512_or_si512(
        _mm512_or_si512(_mm512_srli_epi16(bytes, 4), exponent),
        _mm512_and_si512(_mm512_srli_epi16(top, shift), two));
    put_runs(a, n, lo, hi);
  }
}

inline __m512 load16(const f16* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }

// acc += C d (+ offset x's sums) for one scale group: C [16 weight rows, MP] as the tile
// stored it, lane l of acc[z] weight row (16 z + l) / MP and x row l % MP; `d`, `offset`
// by weight row, `sums` by x row. With 16 rows of x a weight row's scale is a broadcast
// from memory (load ports; `vpermps` put 32 port-5 ops a run beside the unpacking's).
template <int MP, bool OFFSET>
inline void scale_group(__m512* acc, const __m512i* lane_row, const float* c, __m512 d,
                        __m512 offset, __m512 sums) {
  if constexpr (MP == 16) {
    alignas(64) float dm[32];
    _mm512_store_ps(dm, d);
    _mm512_store_ps(dm + 16, offset);
    for (int z = 0; z < MP; ++z) {
      acc[z] = _mm512_fmadd_ps(_mm512_loadu_ps(c + z * 16), _mm512_set1_ps(dm[z]), acc[z]);
      if constexpr (OFFSET) acc[z] = _mm512_fmadd_ps(_mm512_set1_ps(dm[16 + z]), sums, acc[z]);
    }
  } else {
    for (int z = 0; z < MP; ++z) {
      const __m512 dz = MP == 1 ? d : _mm512_permutexvar_ps(lane_row[z], d);
      acc[z] = _mm512_fmadd_ps(_mm512_loadu_ps(c + z * 16), dz, acc[z]);
      if constexpr (OFFSET) {
        const __m512 oz = MP == 1 ? offset : _mm512_permutexvar_ps(lane_row[z], offset);
        acc[z] = _mm512_fmadd_ps(oz, sums, acc[z]);
      }
    }
  }
}

// One 16-row group of w against rows [m0, m0 + MP) of x (as `tile_rows` laid them): out
// [16, MP] fp32. `d16`, `mn16`: the group's scales and mins as [scale groups, 16] (fp16
// from `transpose_scales`, fp32 from `compact_scales`; Q6_K and Q8_0 have no mins).
template <Tiled KIND, int MP, typename T>
inline void tiles_group(const void* w, int64_t K, int64_t n0, const bf16* b,
                        const float* sums, const T* d16, const T* mn16, bf16* a, float* c,
                        float* out) {
  const int64_t runs = K / 32;
  __m512 acc[MP];
  __m512i lane_row[MP];
  for (int z = 0; z < MP; ++z) {
    acc[z] = _mm512_setzero_ps();
    lane_row[z] = _mm512_srli_epi32(
        _mm512_add_epi32(_mm512_set1_epi32(16 * z),
                         _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15)),
        __builtin_ctz(MP));
  }
  const __m512 none = _mm512_setzero_ps();
  for (int64_t r = 0; r < runs; r += 2) {
    bf16* at = a + (r & 2) * 512;  // two buffers: the next pair unpacks while tiles read
    if constexpr (KIND == Tiled::q4) unpack_pair(static_cast<const uint8_t*>(w), K, n0, r, at);
    if constexpr (KIND == Tiled::q5) unpack_pair_q5(static_cast<const uint8_t*>(w), K, n0, r, at);
    if constexpr (KIND == Tiled::q8) unpack_pair_q8(static_cast<const int8_t*>(w), K, n0, r, at);
    if constexpr (KIND == Tiled::iq4)
      unpack_pair_iq4(static_cast<const uint8_t*>(w), K, n0, r, at);
    if constexpr (KIND == Tiled::q6) unpack_pair_q6(static_cast<const uint8_t*>(w), K, n0, r, at);
    if constexpr (KIND == Tiled::q6) {  // a tile a group of 16: half a run's pairs
      for (int h = 0; h < 2; ++h) {
        const bf16* ah = at + h * 512;
        const bf16* bh = b + (r + h) * 32 * MP;
        _tile_loadd(2, ah, 64);
        _tile_loadd(4, bh, MP * 4);
        _tile_zero(0);
        _tile_dpbf16ps(0, 2, 4);
        _tile_loadd(3, ah + 16, 64);
        _tile_loadd(5, bh + 16 * MP, MP * 4);
        _tile_zero(1);
        _tile_dpbf16ps(1, 3, 5);
        _tile_stored(0, c, MP * 4);
        _tile_stored(1, c + 16 * MP, MP * 4);
        for (int q = 0; q < 2; ++q) {
          const int64_t group = 2 * (r + h) + q;
          const __m512 d = load16(d16 + group * 16);
          scale_group<MP, true>(acc, lane_row, c + q * 16 * MP, d,
                                _mm512_mul_ps(d, _mm512_set1_ps(-160.f)),
                                _mm512_loadu_ps(sums + group * 16));
        }
      }
      continue;
    }
    _tile_loadd(2, at, 64);
    _tile_loadd(4, b + r * 32 * MP, MP * 4);
    _tile_zero(0);
    _tile_dpbf16ps(0, 2, 4);
    _tile_loadd(3, at + 512, 64);
    _tile_loadd(5, b + (r + 1) * 32 * MP, MP * 4);
    _tile_zero(1);
    _tile_dpbf16ps(1, 3, 5);
    _tile_stored(0, c, MP * 4);
    _tile_stored(1, c + 16 * MP, MP * 4);
    for (int h = 0; h < 2; ++h) {
      const __m512 d = load16(d16 + (r + h) * 16);
      if constexpr (with_mins(KIND))
        scale_group<MP, true>(acc, lane_row, c + h * 16 * MP, d,
                              _mm512_fnmadd_ps(d, _mm512_set1_ps(128.f),
                                               load16(mn16 + (r + h) * 16)),
                              _mm512_loadu_ps(sums + (r + h) * 16));
      else
        scale_group<MP, false>(acc, lane_row, c + h * 16 * MP, d, none, none);
    }
  }
  for (int z = 0; z < MP; ++z) _mm512_storeu_ps(out + z * 16, acc[z]);
}

// The team's share of y = x w^T on tiles: x bf16 [M, K]; w q4 [N, K / 2] (groups of 32,
// fp16 or compact scales and mins), Q5_K's 5-bit rows (compact scales and mins), Q8_0
// [N, K] (fp16 scales; `mn` unused), Q6_K's 6-bit rows [N, K / 4 * 3] (compact scales
// of 16) or IQ4's indices [N, K / 2] (fp32 scales); N % 16 == 0, K % 64 == 0 (the
// K-quants': whole super-blocks), M <= AMX_ROWS_MAX.
// Each thread lays out x itself (no barrier) and takes a contiguous share of the 16-row
// groups.
template <Tiled KIND, typename S, bool Compact, typename Store>
inline void tiles_team(const bf16* x, const void* w, const S* s, const S* mn, int64_t M,
                       int64_t N, int64_t K, Store store_row) {
  using T = std::conditional_t<std::is_same_v<S, float>, float, f16>;  // as the epilogue reads
  constexpr int len = KIND == Tiled::q6 ? 16 : 32;  // values a scale group
  const int64_t runs = K / 32, scale_groups = K / len, groups = N / 16;
  const int mp = M <= 1 ? 1 : M <= 2 ? 2 : M <= 4 ? 4 : M <= 8 ? 8 : 16;
  const int64_t tiles = (M + mp - 1) / mp;
  // per tile of x rows: B and sums; then the scales and mins, A's two buffers, C, out
  const int64_t tile_floats = runs * 16 * mp + scale_groups * 16;
  float* buf = scratch(tiles * tile_floats + 2 * scale_groups * 16 + 2048 + 512 + 256 +
                       scale_groups + 64);
  float* base =
      reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(buf) + 63) & ~uintptr_t(63));
  float* row_sums = base + tiles * tile_floats + 2 * scale_groups * 16 + 2048 + 512 + 256;
  for (int64_t t = 0; t < tiles; ++t) {
    float* at = base + t * tile_floats;
    tile_rows(x, M, K, t * mp, mp, reinterpret_cast<bf16*>(at), at + runs * 16 * mp,
              with_mins(KIND) || KIND == Tiled::q6 ? len : 0, row_sums);
  }
  T* d16 = reinterpret_cast<T*>(base + tiles * tile_floats);
  T* mn16 = d16 + scale_groups * 16;
  bf16* a = reinterpret_cast<bf16*>(base + tiles * tile_floats + 2 * scale_groups * 16);
  float* c = reinterpret_cast<float*>(a + 2048);
  float* out = c + 512;
  const int threads = omp_get_num_threads(), me = omp_get_thread_num();
  const int64_t first = groups * me / threads, last = groups * (me + 1) / threads;
  // Configured after the last call into another library: the first call through a lazily
  // bound symbol may restore the tile state to its initial (unconfigured) one.
  configure_tiles(mp, len / 2);
  for (int64_t group = first; group < last; ++group) {
    const int64_t n0 = group * 16;
    if constexpr (Compact) {
      compact_scales<with_mins(KIND)>(s, scale_groups, n0, d16);
      if (with_mins(KIND)) compact_scales<true>(mn, scale_groups, n0, mn16);
    } else {
      transpose_scales(s + n0 * runs, runs, d16);
      if (with_mins(KIND)) transpose_scales(mn + n0 * runs, runs, mn16);
    }
    for (int64_t t = 0; t < tiles; ++t) {
      const float* at = base + t * tile_floats;
      const bf16* b = reinterpret_cast<const bf16*>(at);
      const float* sums = at + runs * 16 * mp;
      switch (mp) {
        case 1: tiles_group<KIND, 1, T>(w, K, n0, b, sums, d16, mn16, a, c, out); break;
        case 2: tiles_group<KIND, 2, T>(w, K, n0, b, sums, d16, mn16, a, c, out); break;
        case 4: tiles_group<KIND, 4, T>(w, K, n0, b, sums, d16, mn16, a, c, out); break;
        case 8: tiles_group<KIND, 8, T>(w, K, n0, b, sums, d16, mn16, a, c, out); break;
        default: tiles_group<KIND, 16, T>(w, K, n0, b, sums, d16, mn16, a, c, out); break;
      }
      // out[(16 z + l)] is weight row (16 z + l) / mp, x row l % mp
      for (int j = 0; j < 16; ++j) {
        float col[16];
        for (int m = 0; m < mp; ++m) col[m] = out[j * mp + m];
        store_row(n0 + j, t * mp, std::min<int64_t>(mp, M - t * mp), col);
      }
    }
  }
  _tile_release();
}
#else
#define CC_AMX_TILES 0
#endif

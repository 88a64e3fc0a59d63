// Part of quant_kernels.cpp, which includes it inside its anonymous namespace (the build
// inlines the text: passes/native.py `op_source`); q4's and Q8_0's exact products on AMX
// tiles for a few rows of x (a verification's 1 + k tokens, a decode batch, a short prompt chunk);
// defines CC_AMX_TILES.
//
// Above two rows the bf16 row products are bound by `vdpbf16ps` (32 products an
// instruction, each extra row of x costing what the first did), where one `tdpbf16ps` makes
// 16 x 32 x (rows of x) products. The weights stay in their stored layout: each 16-row group
// of w is unpacked a pair of runs at a time into tiles A (16 weight rows x 32 values, the
// bf16 128 + q as in `row_product_q4_bf16`), x's runs are tile B (16 value pairs x up to 16
// rows), and tile C = A B holds one run's exact sums for 16 weight rows x the rows of x:
//   sum_j (d q_j + m) x_j = d sum_j (128 + q_j) x_j + (m - 128 d) sum_j x_j,
// scaled by the run's d (and its m's term added) in fp32 per run, as the row products do.
// Exact as the bf16 path is (bf16 products, fp32 sums); a row's bits differ from the row
// products', so batch-invariant mode keeps the row products (docs/kernel-choices.md, AMX
// tiles).

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__F16C__)
#define CC_AMX_TILES 1
#include <sys/syscall.h>
#include <unistd.h>

// Rows of x the tiles take (Q4_0, Q4_1, Q8_0: groups of 32, fp16 scales; Q4_K): below 3 the row
// products are as fast (memory-bound); above 64 the dense copy's GEMM
// (passes/ops/quantized.py).
constexpr int64_t AMX_ROWS_MIN = 3, AMX_ROWS_MAX = 64;
// Q4_K's row products on int8 activations (where allowed) are as fast as the tiles up to
// this many rows (1.7B's shapes: 1.03x / 1.04x / 1.05x the tiles at 3 / 4 / 5 rows, 0.89x
// at 6): they keep them.
constexpr int64_t AMX_INT8_ROWS_Q4K = 5;

// Linux hands AMX's tile state to a process only on request (arch_prctl
// ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA); oneDNN makes the same request.
inline bool amx_ready() {
  static const bool ok = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return ok;
}

struct TileConfig {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// Tiles 0, 1: C (16 weight rows x mp fp32); 2, 3: A (16 x 32 bf16); 4, 5: B (16 pairs x mp).
inline void configure_tiles(int mp) {
  alignas(64) TileConfig c{};
  c.palette = 1;
  for (int t = 0; t < 6; ++t) {
    c.rows[t] = 16;
    c.colsb[t] = t == 2 || t == 3 ? 64 : mp * 4;
  }
  // GCC drops stores it cannot see read: `ldtilecfg`'s operand is not declared as one.
  asm volatile("" : : "r"(&c) : "memory");
  _tile_loadconfig(&c);
}

// x's rows [m0, m0 + mp) as tile B, run by run ([run][pair t][row][2 values], rows past M
// zero), and their run sums, lane l of a run's 16 holding row l % mp's.
inline void tile_rows(const bf16* x, int64_t M, int64_t K, int64_t m0, int mp, bf16* b,
                      float* sums, bool with_sums) {
  const int64_t runs = K / 32;
  uint32_t* pairs = reinterpret_cast<uint32_t*>(b);
  for (int m = 0; m < mp; ++m) {
    const bool live = m0 + m < M;
    const uint32_t* row = reinterpret_cast<const uint32_t*>(x + (m0 + m) * K);
    for (int64_t r = 0; r < runs; ++r)
      for (int t = 0; t < 16; ++t) pairs[(r * 16 + t) * mp + m] = live ? row[r * 16 + t] : 0u;
  }
  float run_sum[16];
  for (int64_t r = 0; with_sums && r < runs; ++r) {
    for (int m = 0; m < mp; ++m) {
      float total = 0.f;
      if (m0 + m < M)
        for (int j = 0; j < 32; ++j) total += to_f32(x[(m0 + m) * K + r * 32 + j]);
      run_sum[m] = total;
    }
    for (int l = 0; l < 16; ++l) sums[r * 16 + l] = run_sum[l % mp];
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
    _mm512_store_si512(a + n * 32, _mm512_shuffle_i64x2(lo, hi, 0x44));
    _mm512_store_si512(a + 512 + n * 32, _mm512_shuffle_i64x2(lo, hi, 0xee));
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

// Q4_K's compact scales (or mins) of weight rows [n0, n0 + 16) as fp32 [runs, 16]: super x
// sub, exact in fp32 (quant/formats.h `CompactPtr`).
inline void compact_scales(const float* base, int64_t runs, int64_t n0, float* out) {
  const __m512i column = _mm512_mullo_epi32(
      _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
      _mm512_set1_epi32(16));
  for (int n = 0; n < 16; ++n) {
    const CompactPtr<true> row = fields_at<true, true>(base, runs, n0 + n, base);
    for (int64_t r0 = 0; r0 < runs; r0 += 16) {
      const __mmask16 live = runs - r0 < 16 ? __mmask16((1u << (runs - r0)) - 1) : 0xffff;
      _mm512_mask_i32scatter_ps(out + r0 * 16 + n, live, column, scales16(row + r0, live), 4);
    }
  }
}

inline __m512 load16(const f16* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }

// One 16-row group of w against rows [m0, m0 + MP) of x (as `tile_rows` laid them): out
// [16, MP] fp32. `d16`, `mn16`: the group's scales and mins as [runs, 16] (fp16 from
// `transpose_scales`, fp32 from `compact_scales`).
template <bool Q4, int MP, typename T>
inline void tiles_group(const void* w, int64_t K, int64_t n0, const bf16* b,
                        const float* sums, const T* d16, const T* mn16, bf16* a, float* c,
                        float* out) {
  const int64_t runs = K / 32;
  __m512 acc[MP];
  __m512i lane_row[MP];  // lane l of acc[z] is weight row (16 z + l) / MP, x row l % MP
  for (int z = 0; z < MP; ++z) {
    acc[z] = _mm512_setzero_ps();
    lane_row[z] = _mm512_srli_epi32(
        _mm512_add_epi32(_mm512_set1_epi32(16 * z),
                         _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15)),
        __builtin_ctz(MP));
  }
  for (int64_t r = 0; r < runs; r += 2) {
    bf16* at = a + (r & 2) * 512;  // two buffers: the next pair unpacks while tiles read
    if constexpr (Q4) unpack_pair(static_cast<const uint8_t*>(w), K, n0, r, at);
    else unpack_pair_q8(static_cast<const int8_t*>(w), K, n0, r, at);
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
      if constexpr (Q4) {
        const __m512 m_eff =
            _mm512_fnmadd_ps(d, _mm512_set1_ps(128.f), load16(mn16 + (r + h) * 16));
        const __m512 s = _mm512_loadu_ps(sums + (r + h) * 16);
        if constexpr (MP == 16) {  // broadcasts from memory: load ports, not port 5
          alignas(64) float dm[32];
          _mm512_store_ps(dm, d);
          _mm512_store_ps(dm + 16, m_eff);
          for (int z = 0; z < MP; ++z) {
            acc[z] = _mm512_fmadd_ps(_mm512_loadu_ps(c + h * 16 * MP + z * 16),
                                     _mm512_set1_ps(dm[z]), acc[z]);
            acc[z] = _mm512_fmadd_ps(_mm512_set1_ps(dm[16 + z]), s, acc[z]);
          }
        } else {
          for (int z = 0; z < MP; ++z) {
            const __m512 dz = MP == 1 ? d : _mm512_permutexvar_ps(lane_row[z], d);
            const __m512 mz = MP == 1 ? m_eff : _mm512_permutexvar_ps(lane_row[z], m_eff);
            acc[z] = _mm512_fmadd_ps(_mm512_loadu_ps(c + h * 16 * MP + z * 16), dz, acc[z]);
            acc[z] = _mm512_fmadd_ps(mz, s, acc[z]);
          }
        }
      } else if constexpr (MP == 16) {
        alignas(64) float dm[16];
        _mm512_store_ps(dm, d);
        for (int z = 0; z < MP; ++z)
          acc[z] = _mm512_fmadd_ps(_mm512_loadu_ps(c + h * 16 * MP + z * 16),
                                   _mm512_set1_ps(dm[z]), acc[z]);
      } else {
        for (int z = 0; z < MP; ++z) {
          const __m512 dz = MP == 1 ? d : _mm512_permutexvar_ps(lane_row[z], d);
          acc[z] = _mm512_fmadd_ps(_mm512_loadu_ps(c + h * 16 * MP + z * 16), dz, acc[z]);
        }
      }
    }
  }
  for (int z = 0; z < MP; ++z) _mm512_storeu_ps(out + z * 16, acc[z]);
}

// The team's share of y = x w^T on tiles: x bf16 [M, K], w q4 [N, K / 2] (groups of 32,
// fp16 scales and mins) or Q8_0 [N, K] (fp16 scales; `mn` unused), N % 16 == 0,
// K % 64 == 0, M <= AMX_ROWS_MAX. Each thread lays out x itself (no barrier) and takes a
// contiguous share of the 16-row groups.
template <bool Q4, typename S, bool Compact, typename Store>
inline void tiles_team(const bf16* x, const void* w, const S* s, const S* mn, int64_t M,
                       int64_t N, int64_t K, Store store_row) {
  using T = std::conditional_t<Compact, float, f16>;  // the scales as the epilogue reads them
  const int64_t runs = K / 32, groups = N / 16;
  const int mp = M <= 1 ? 1 : M <= 2 ? 2 : M <= 4 ? 4 : M <= 8 ? 8 : 16;
  const int64_t tiles = (M + mp - 1) / mp;
  // per tile of x rows: B and sums; then the scales, A's two buffers, C, out
  const int64_t tile_floats = runs * 16 * mp + runs * 16;
  float* buf = scratch(tiles * tile_floats + 2 * runs * 16 + 2048 + 512 + 256 + 64);
  float* base =
      reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(buf) + 63) & ~uintptr_t(63));
  for (int64_t t = 0; t < tiles; ++t) {
    float* at = base + t * tile_floats;
    tile_rows(x, M, K, t * mp, mp, reinterpret_cast<bf16*>(at), at + runs * 16 * mp, Q4);
  }
  T* d16 = reinterpret_cast<T*>(base + tiles * tile_floats);
  T* mn16 = d16 + runs * 16;
  bf16* a = reinterpret_cast<bf16*>(base + tiles * tile_floats + 2 * runs * 16);
  float* c = reinterpret_cast<float*>(a + 2048);
  float* out = c + 512;
  const int threads = omp_get_num_threads(), me = omp_get_thread_num();
  const int64_t first = groups * me / threads, last = groups * (me + 1) / threads;
  // Configured after the last call into another library: the first call through a lazily
  // bound symbol may restore the tile state to its initial (unconfigured) one.
  configure_tiles(mp);
  for (int64_t group = first; group < last; ++group) {
    const int64_t n0 = group * 16;
    if constexpr (Compact) {
      compact_scales(s, runs, n0, d16);
      compact_scales(mn, runs, n0, mn16);
    } else {
      transpose_scales(s + n0 * runs, runs, d16);
      if (Q4) transpose_scales(mn + n0 * runs, runs, mn16);
    }
    for (int64_t t = 0; t < tiles; ++t) {
      const float* at = base + t * tile_floats;
      const bf16* b = reinterpret_cast<const bf16*>(at);
      const float* sums = at + runs * 16 * mp;
      switch (mp) {
        case 1: tiles_group<Q4, 1, T>(w, K, n0, b, sums, d16, mn16, a, c, out); break;
        case 2: tiles_group<Q4, 2, T>(w, K, n0, b, sums, d16, mn16, a, c, out); break;
        case 4: tiles_group<Q4, 4, T>(w, K, n0, b, sums, d16, mn16, a, c, out); break;
        case 8: tiles_group<Q4, 8, T>(w, K, n0, b, sums, d16, mn16, a, c, out); break;
        default: tiles_group<Q4, 16, T>(w, K, n0, b, sums, d16, mn16, a, c, out); break;
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

// Products with block-quantized weights for a few activation rows:
// y [M, N] = x [M, K] @ dequantize(w)^T (+ bias); `flags` bit 0: x and bias are bf16 (else
// fp32), bit 1: y is bf16 (else fp32), bit 2: scales and mins are fp32 (else fp16), bit 4:
// they are stored compact, as Q4_K's (q4) or Q6_K's (q8) super-blocks hold them
// (`CompactScales` below), bit 5: x may be quantized to int8 (Q8_0's products: `Strip8`,
// q4's row products: `row_product_q4_int8`), bit 6: q8's values are Q6_K's, packed in 6
// bits (`unpack_q6_row`), or q4's are Q5_K's, packed in 5 (`unpack_q5_row`), bit 7:
// batch-invariant (the exact row products at every row count; bit 5 ignored), bit 8: q8's
// values are IQ4_NL's, 4-bit indices into its table (`unpack_iq4_row`), fp32 scales.
//
// The two weight formats (passes/ops/quantized.py holds their torch reference):
//   q4: w uint8 [N, K/2]; in each run of 32 values byte j holds value j in its low nibble
//       and value j + 16 in its high one (GGUF's Q4_0 / Q4_1 order); scales and mins fp16
//       or fp32 [N, K/g]; value = scale * q + min. GGUF Q4_1 as stored, Q4_0 with min =
//       -8 scale, Q4_K with fp32 scales and mins (its nibbles reordered at load); Q5_K
//       as Q4_K, its values u in [0, 31] kept in 5 bits: w uint8 [N, 5K/8].
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
// and where the caller allows int8 activations Q8_0's 1-2 rows on them
// (`row_product_q8_int8`), its other rows and the K-quants' and IQ4's (`*_pairs`).
//
// Like layer_kernels.cpp, each `*_team` function runs on every thread of a parallel region
// and takes its share of the weight rows (one sequential weight stream a thread), so a CPU
// graph can call it inside one OpenMP team; `*_region` opens a region for eager calls.
//
// The parts (pasted in by the build, passes/native.py `op_source`), then this file's
// dispatch (`product_team`) and entry points:
//   quant/formats.h          the formats, scale decoding, the row-count constants
//   quant/rows_fp32.h        fp32 activations (AVX-512; the portable loop elsewhere)
//   quant/rows_avx2.h        AVX2 + FMA row products (factored; Q8_0's on int8)
//   quant/rows_avx2_int8.h   AVX2: the K-quants', IQ4's, Q8_0's row products on int8 x
//   quant/rows_int8_vnni.h   int8 activations on AVX512-VNNI without AVX512-BF16
//   quant/rows_bf16.h        the exact bf16 row products (q4, Q6_K, q8)
//   quant/strips_bf16.h      16 weight rows at a time for many rows of x (exact bf16)
//   quant/int8_bf16_vnni.h   int8 activations beside bf16: Q8_0's strips, K-quant rows
//   quant/tiles_amx.h        exact products on AMX tiles for 3-64 rows of x
//   quant/dequantize.h       dense copies of the blocks, for a prefill's GEMM
#include "cc_common.h"

#include <algorithm>
#include <type_traits>
#if defined(__AVX512F__) || defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

namespace {

#include "quant/formats.h"

#include "quant/rows_fp32.h"

#include "quant/rows_avx2.h"
#include "quant/rows_avx2_int8.h"

#include "quant/rows_int8_vnni.h"

#include "quant/rows_bf16.h"
#include "quant/strips_bf16.h"
#include "quant/int8_bf16_vnni.h"
#include "quant/tiles_amx.h"
#ifndef CC_INT8_STRIPS
#define CC_INT8_STRIPS 0
#endif
#ifndef CC_AVX2_ROWS
#define CC_AVX2_ROWS 0
#endif

// y[m, n] = out[m] (+ bias[n]), the bias added in fp32 with one rounding (as addmm).
// Inlined: left a call, the 135M's short Q8_0 rows (K = 576) ran 0.95x
// (docs/kernel-choices.md, Quantized row products).
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

// Rows [n0, N) of w against one row of x, the team's share (guided): `row(n)` is output n.
// A loop of its own: the general row loop's per-row dispatch (on the format, the group and
// the rows of x) cost the 135M's short rows ~10% end to end (docs/kernel-choices.md,
// Quantized row products).
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
// builds (q4: groups of 32-512 values, powers of two, so that 16 runs start on a group; q8:
// groups of 32, 16 or the whole row), else for groups of 32 the integer one (AVX512-VNNI;
// it cost Q8_0 1.5% perplexity: docs/kernel-choices.md, Int8 activations) only where the
// caller allows int8 activations (`int8_ok`, flags bit 5: `PassConfig.int8_activations`);
// otherwise fp32.
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
// each path dispatches on mb itself: one generic lambda doing it for all four cost the q8
// product 10-15% at 4 rows (docs/kernel-choices.md, Quantized row products). Compact (S =
// float): `scales` and `mins` point at compact rows (`CompactScales`), which are decoded a
// row (or a strip's rows) at a time; otherwise rows of S [N, groups].
template <bool Q4, typename S, bool Compact = false>
void product_team(const void* x, int64_t flags, const void* w, const S* scales, const S* mins,
                  const void* bias, void* y, int64_t M, int64_t N, int64_t K, int64_t g) {
  // Batch-invariant mode (flags bit 7): no int8 activations; the row products up to
  // INVARIANT_ROWS rows, the strips above, so that a row's bits never depend on the other
  // rows of its step (tests/test_quantized.py).
  if (flags & 128) flags &= ~int64_t(32);
  // Q5_K's packed rows (flags bit 6 on q4; compact scales, K whole super-blocks): the bf16
  // path's row products read them in place at every row count (no strips), on int8
  // activations where the caller allows them (with AVX512-VNNI, as Q4_K's); other paths
  // take each row dequantized (`dequantize_q5_row`).
  const bool five = Q4 && Compact && (flags & 64);
  // IQ4's indices (flags bit 8 on q8; fp32 scales for groups of 32): the bf16 row products
  // look them up in place (exact); the strips, on int8 activations where the caller allows
  // them as Q8_0's, and every other path read rows unpacked to int8 (`unpack_iq4_row`).
  const bool iq4 = !Q4 && !Compact && (flags & 256);
  const int64_t bf = flags & 1;
  Path path = choose(Q4, bf, K, g, (flags & 32) && !five);
#if CC_AMX_TILES
  // From AMX_ROWS_MIN rows, exact products on tiles (tiles_amx.h): Q4_0 / Q4_1 (groups of
  // 32, fp16 scales); Q8_0 where exact: at any row count where int8 activations are not
  // allowed, else between their integer row products (1-2 rows) and their strips (from
  // TILED_ROWS_Q8, 1.1-1.25x the tiles there); Q4_K where exact, and above
  // AMX_INT8_ROWS_Q4K rows where int8 activations are allowed (their row products are as
  // fast below); Q6_K's 6-bit rows from TILED_ROWS_Q8 rows, in place of the exact strips
  // (5-6x them; the row products below, exact or on int8, beat the tiles at 3-4 rows:
  // docs/kernel-choices.md, AMX tiles); Q5_K's as Q4_K's; IQ4's at every count, in place
  // of its int8 strips too (1.2-1.4x them at 6-16 rows, level at 32-64). Not in
  // batch-invariant mode (flags bit 7), whose rows must take the row products at any
  // count.
  if (!(flags & 128) && path == Path::bf16 && M >= AMX_ROWS_MIN && M <= AMX_ROWS_MAX &&
      N % 16 == 0 && amx_ready()) {
    const bool int8_ok = flags & 32;
    const auto tiles = [&](auto kind) {
      tiles_team<decltype(kind)::value, S, Compact>(
          static_cast<const bf16*>(x), w, scales, mins, M, N, K,
          [&](int64_t n, int64_t m0, int64_t mb, const float* out) {
            store(y, flags, bias, N, n, m0, mb, out);
          });
    };
    using q4_kind = std::integral_constant<Tiled, Tiled::q4>;
    if constexpr (Q4 && (Compact || std::is_same_v<S, f16>)) {
      if (g == 32 && mins && !(flags & 64) && (!Compact || !int8_ok || M > AMX_INT8_ROWS_Q4K))
        return tiles(q4_kind{});
      if (Compact && (flags & 64) && g == 32 && mins && (!int8_ok || M > AMX_INT8_ROWS_Q5K))
        return tiles(std::integral_constant<Tiled, Tiled::q5>{});
    } else if constexpr (!Q4 && !Compact && std::is_same_v<S, f16>) {
      if (g == 32 && !(flags & 256) && (!int8_ok || M < TILED_ROWS_Q8))
        return tiles(std::integral_constant<Tiled, Tiled::q8>{});
    } else if constexpr (!Q4 && !Compact) {  // IQ4's indices, fp32 scales
      if (g == 32 && (flags & 256))
        return tiles(std::integral_constant<Tiled, Tiled::iq4>{});
    } else if constexpr (!Q4 && Compact) {
      if ((flags & 64) && g == 16 && M >= TILED_ROWS_Q8)
        return tiles(std::integral_constant<Tiled, Tiled::q6>{});
    }
  }
#endif
  // Q6_K's packed rows (compact scales, K whole super-blocks): the bf16 row product reads
  // them in place, with x reordered and summed per 16 as q4's; other paths unpack a row
  // (or a strip's 16) to int8 first.
  const bool six = !Q4 && Compact && (flags & 64);
  const int64_t row_bytes =
      five ? K / 128 * Q5_CHUNK_BYTES : Q4 || iq4 ? K / 2 : six ? K / 4 * 3 : K;
  // fp32 x [M, K]; then per row what its path needs (counted in floats): the int8 path's
  // QuantRow (K int8s, two run arrays, K/4 int32s), q4's bf16 path's reordered row and sums.
  const int64_t tiled_rows = !Q4 ? TILED_ROWS_Q8 : five ? TILED_ROWS_Q5 : TILED_ROWS_Q4;
  // (Q5_K's only on int8 activations: its 5-bit values as bytes, as Q4_K's nibbles)
  const bool strips = path == Path::bf16 && N >= TILE_N &&
                      (!five || (CC_INT8_STRIPS && (flags & 32))) &&
                      ((flags & 128) ? M > INVARIANT_ROWS : M >= tiled_rows);
  // Q8_0 with int8 activations where the caller allows it (flags bit 5), as llama.cpp
  // multiplies: its strips from 6 rows, the integer row product up to INT8_ROWS_Q8 rows
  // (1.01-1.22x the exact one end to end at batch 1 on the 1.7B file, by how fast the
  // memory is: docs/kernel-choices.md, Int8 activations); the exact row product between.
  const bool int8_x = !Q4 && g == 32 && (flags & 32) && path == Path::bf16;
  // Q4_K's strips likewise (as llama.cpp multiplies Q4_K by Q8_K): its nibbles as Q8_0's
  // bytes, the mins through x's exact run sums (`Strip8`).
  const bool int8_q4k = Q4 && Compact && g == 32 && (flags & 32) && path == Path::bf16;
  // And Q6_K's, its values as the bytes, an offset and a scale per half run (its groups).
  const bool int8_q6k = six && g == 16 && (flags & 32) && path == Path::bf16;
  const bool int8_strips = CC_INT8_STRIPS && strips && (int8_x || int8_q4k || int8_q6k);
  // q4 with int8 activations where the caller allows it (the K-quants' products), for the
  // rows below the strips: `row_product_q4_int8`.
  const bool int8_q4 = Q4 && CC_INT8_STRIPS && (flags & 32) && path == Path::bf16 && !strips;
  // Q6_K's too (`row_product_q6_int8`): x as q4's, with sums per 16 where q4 has per 32.
  const bool int8_six = six && CC_INT8_STRIPS && (flags & 32) && path == Path::bf16 && !strips;
  // IQ4's too, as llama.cpp multiplies IQ4_XS by Q8_K (`row_product_q4_int8<MB, false,
  // true>`: its values looked up as unsigned bytes plus 128, taken off through x's sums as
  // quantized); its bf16 rows' table lookups were compute-bound at 21 GB/s a core.
  const bool int8_iq4 = iq4 && CC_INT8_STRIPS && (flags & 32) && path == Path::bf16 && !strips;
  const bool x_chunks =
      (Q4 || six || iq4) && path == Path::bf16 && !int8_q4 && !int8_six && !int8_iq4;
  if (CC_INT8_STRIPS && int8_x && !strips && M <= INT8_ROWS_Q8 && !iq4) path = Path::int8;
  // The K-quants', IQ4's and Q8_0's rows on AVX2 with int8 activations where the caller
  // allows them (rows_avx2_int8.h: x quantized per pair of runs), at every row count, so a
  // row's bits do not depend on the others' (Q8_0's 1-2 rows tied `row_product_q8_int8`:
  // docs/kernel-choices.md, Int8 activations; tests/test_quantized.py checks the bits).
  const bool q8_0 = !Q4 && !Compact && !iq4 && std::is_same_v<S, f16> && g == 32;
  const bool avx2_pairs = CC_AVX2_ROWS && path == Path::fp32 && (flags & 32) && K % 64 == 0 &&
                          (Q4 ? Compact && g == 32
                           : six ? g == 16
                                 : (iq4 && g == 32) || q8_0);
  // q4's fp32 row products on AVX2 take x's sums per group: in groups of 32, x laid out
  // in the order a pair of runs' lanes hold the nibbles (`row_product_q4_slots`), else as
  // it is (`row_product_q4_sums`).
  const bool q4_fp32 = Q4 && !five && CC_AVX2_ROWS && path == Path::fp32 && !avx2_pairs;
  const bool q4_slots = q4_fp32 && g == 32 && K % 64 == 0;
  const bool q4_sums = q4_fp32 && !q4_slots;
  // Q8_0's row products on AVX2 with int8 activations where the caller allows them and
  // the pairs cannot take K (1-2 rows, as on AVX512-VNNI): `row_product_q8_int8`.
  const bool avx2_int8 = !Q4 && !Compact && CC_AVX2_ROWS && path == Path::fp32 && bf &&
                         g == 32 && (flags & 32) && M <= INT8_ROWS_Q8 && !avx2_pairs;
  const int64_t per_row = path == Path::int8 ? K / 4 + 2 * (K / 32) + K / 4
                          : int8_q4 || int8_six || int8_iq4 ? (K + 127) / 128 * 32 + K / 32 + K / 16
                          : x_chunks ? K / 2 + K / 16
                          : q4_sums ? K / g
                          : q4_slots ? K + K / 32
                          : avx2_pairs ? pair_row_floats(K)
                          : avx2_int8 ? K / 4 + K / 32 : 0;
  const int64_t x_floats = path == Path::bf16 ? 0 : K;  // x as fp32 rows (fp32, int8 paths)
  const int64_t groups = K / g;
  const int64_t strip_groups = Q4 ? K / 32 : groups;  // q4's strips scale per run
  const int shift = runs_shift(g);  // q4's runs a group, as a shift
  // More than a block of rows on the pairs' path: strips of 16 decoded weight rows.
  const bool pair_strips = avx2_pairs && M > MB_MAX && N >= TILE_N;
  const int64_t strip_floats = strips         ? K * 8 + 2 * strip_groups * TILE_N + 16
                               : pair_strips ? TILE_N * K / 4 + 8
                                             : 0;
  // x's rows as unsigned bytes and a scale a run for the int8 strips (IQ4's tail rows
  // take x's chunks beside them)
  const int64_t int8_floats = int8_strips ? M * (K / 4 + K / 32) : 0;
  // Rows unpacked in the row loop (and a strip's 16 before it packs them, into the same
  // buffer): Q6_K's and IQ4's off the bf16 path.
  const bool unpack = (six || iq4) && path != Path::bf16 && !avx2_pairs;
  auto unpack_row = [&](const char* row, int8_t* out) {
    if (six) unpack_q6_row(reinterpret_cast<const uint8_t*>(row), K, out);
    else unpack_iq4_row(reinterpret_cast<const uint8_t*>(row), K, out);
  };
  // a row's values, then its bytes
  const bool five_rows = five && path != Path::bf16 && !avx2_pairs;
  // x's rows, then per row its path's extra, the int8 strips' x, a strip, compact rows
  // decoded (scales, mins), then 16 rows unpacked to int8 (Q6_K's, IQ4's) or one Q5_K
  // row's values and bytes
  float* xf = scratch(M * (x_floats + per_row) + int8_floats + strip_floats +
                      2 * TILE_N * groups +
                      (six || iq4 || int8_strips ? TILE_N * K / 4 : five_rows ? K + K / 4 : 0));
  float* extra = xf + M * x_floats;
  float* strip_at = extra + M * per_row + int8_floats;
  float* scale_buf = strip_at + strip_floats;
  float* min_buf = scale_buf + TILE_N * groups;
  int8_t* unpacked = reinterpret_cast<int8_t*>(min_buf + TILE_N * groups);
  float* five_values = min_buf + TILE_N * groups;
  if (path == Path::fp32) load_rows(x, bf, xf, M * K);
#if CC_AVX2_ROWS
  if (q4_sums)
    for (int64_t m = 0; m < M; ++m) group_sums(xf + m * K, K, g, extra + m * per_row);
  for (int64_t m = 0; q4_slots && m < M; ++m) {
    slot_order(xf + m * K, K, extra + m * per_row);
    group_sums(xf + m * K, K, 32, extra + m * per_row + K);
  }
  if (avx2_pairs)
    for (int64_t m = 0; m < M; ++m) quantize_pairs(xf + m * K, K, pair_row(extra + m * per_row, K));
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
  if (int8_q4 || int8_six || int8_iq4) {
    const RunSums sums = int8_six ? RunSums::exact16 : int8_iq4 ? RunSums::quantized
                                                                : RunSums::exact;
    for (int64_t m = 0; m < M; ++m)
      quantize_chunks(static_cast<const bf16*>(x) + m * K, K, int8_chunks(m), sums);
  }
#endif
  int64_t tiled = 0;  // rows [0, tiled) of w go by strips
#if CC_AVX2_ROWS
  // The pairs' path (rows_avx2_int8.h): f called with weight row n's codes reader, and
  // the products of mb rows of x from m0 against row n, its codes read by `codes`.
  auto with_pair_codes = [&](int64_t n, auto f) {
    const uint8_t* wq = static_cast<const uint8_t*>(w) + n * row_bytes;
    if constexpr (Q4) {
      if (five) f(Q5Codes{wq});
      else f(Q4Codes{wq});
    } else if constexpr (Compact) {
      f(Q6Codes{wq});
    } else if constexpr (std::is_same_v<S, f16>) {
      f(Q8Codes{reinterpret_cast<const int8_t*>(wq)});
    } else {
      f(Iq4Codes{wq});
    }
  };
  auto pair_products = [&](int64_t n, auto codes, int64_t m0, int64_t mb, float* out) {
    PairRow rm[MB_MAX];
    for (int64_t m = 0; m < mb; ++m) rm[m] = pair_row(extra + (m0 + m) * per_row, K);
    if constexpr (Q4 && Compact) {
      const auto sc = compact8<true>(scales, groups, n), mn = compact8<true>(mins, groups, n);
      CC_BY_ROWS(mb, row_product_q4_pairs<MB>(rm, K, codes, sc, mn, out));
    } else if constexpr (Compact) {
      CC_BY_ROWS(mb, row_product_q6_pairs<MB>(rm, K, codes, compact8<false>(scales, groups, n),
                                              out));
    } else if constexpr (!Q4) {
      CC_BY_ROWS(mb, row_product_signed_pairs<MB>(rm, K, codes, scales + n * groups, out));
    }
  };
  if (pair_strips) {
    tiled = N / TILE_N * TILE_N;
    int8_t* buf = reinterpret_cast<int8_t*>((reinterpret_cast<uintptr_t>(strip_at) + 31) &
                                            ~uintptr_t(31));
#pragma omp for schedule(guided) nowait
    for (int64_t strip = 0; strip < N / TILE_N; ++strip) {
      const int64_t n0 = strip * TILE_N;
      pairs_strip(
          K, M, buf, [&](int r, auto f) { with_pair_codes(n0 + r, f); },
          [&](int r, auto codes, int64_t m0, int64_t mb) {
            float out[MB_MAX];
            pair_products(n0 + r, codes, m0, mb, out);
            store(y, flags, bias, N, n0 + r, m0, mb, out);
          });
    }
  }
#endif
#if CC_INT8_STRIPS
  if constexpr (!Q4 || Compact) {
    if (int8_strips) {
      uint8_t* xq = reinterpret_cast<uint8_t*>(extra + M * per_row);
      float* sx = extra + M * per_row + M * K / 4;
      for (int64_t m = 0; m < M; ++m)
        quantize_row_u8(static_cast<const bf16*>(x) + m * K, K, xq + m * K, sx + m * (K / 32));
      tiled = N / TILE_N * TILE_N;
      const uintptr_t at = reinterpret_cast<uintptr_t>(strip_at);
      Strip8 st;
      st.wq = reinterpret_cast<__m512i*>((at + 63) & ~uintptr_t(63));
      st.minus = st.wq + K / 4;
      st.ds = reinterpret_cast<float*>(st.minus + groups);
      st.ms = st.ds + groups * TILE_N;
#pragma omp for schedule(guided) nowait
      for (int64_t strip = 0; strip < N / TILE_N; ++strip) {
        const int64_t n0 = strip * TILE_N;
        const int8_t* rows = static_cast<const int8_t*>(w) + n0 * K;
        for (int64_t r = 0; (iq4 || six || Q4) && r < TILE_N; ++r) {
          const uint8_t* row = static_cast<const uint8_t*>(w) + (n0 + r) * row_bytes;
          if (six) unpack_q6_row(row, K, unpacked + r * K);
          else if (five) unpack_q5_row(row, K, reinterpret_cast<uint8_t*>(unpacked + r * K));
          else unpack_nibbles(row, K, Q4 ? Q4_VALUES : IQ4_VALUES, unpacked + r * K);
          rows = unpacked;
        }
        const float* ms = nullptr;  // q4's mins (Compact: S is float)
        if constexpr (Q4) ms = scale_rows<Q4, Compact>(mins, groups, n0, TILE_N, min_buf);
        pack_strip_int8(rows, scale_rows<Q4, Compact>(scales, groups, n0, TILE_N, scale_buf), ms,
                        K, groups, st);
        for (int64_t m0 = 0; m0 < M; m0 += STRIP_MB) {
          float out[STRIP_MB * TILE_N];
          const float* sums[STRIP_MB];  // q4's: x's exact run sums
          const int64_t mb = M - m0 < STRIP_MB ? M - m0 : STRIP_MB;
          for (int64_t m = 0; Q4 && m < mb; ++m) sums[m] = bf16_row(m0 + m).sum;
          const uint8_t* xm = xq + m0 * K;
          const float* sxm = sx + m0 * (K / 32);
          if (Q4) strip_rows_int8_mb<true, 1>(mb, xm, sxm, sums, K, st, out);
          else if (six) strip_rows_int8_mb<false, 2>(mb, xm, sxm, sums, K, st, out);
          else strip_rows_int8_mb<false, 1>(mb, xm, sxm, sums, K, st, out);
          store_strip(y, flags, bias, N, n0, m0, mb, out);
        }
      }
    }
  }
#endif
#if CC_BF16_PATH
  if (strips && !int8_strips) {
    tiled = N / TILE_N * TILE_N;
    const uintptr_t at = reinterpret_cast<uintptr_t>(strip_at);
    Strip st;
    st.wp = reinterpret_cast<__m512i*>((at + 63) & ~uintptr_t(63));
    st.ds = reinterpret_cast<float*>(st.wp + K / 2);
    st.ms = st.ds + strip_groups * TILE_N;
#pragma omp for schedule(guided) nowait
    for (int64_t strip = 0; strip < N / TILE_N; ++strip) {  // (x's chunks in L2: no faster)
      const int64_t n0 = strip * TILE_N;
      const S* ms = Q4 ? scale_rows<Q4, Compact>(mins, groups, n0, TILE_N, min_buf) : nullptr;
      const char* rows = static_cast<const char*>(w) + n0 * row_bytes;
      if (six || iq4) {
        for (int64_t r = 0; r < TILE_N; ++r) unpack_row(rows + r * row_bytes, unpacked + r * K);
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
#if CC_INT8_STRIPS
  // The K-quants' and IQ4's one row of x on int8 activations too: in the general loop
  // below, beside Q5_K's instance and its fp32 fallback, Q4_K's read 0.75x
  // (docs/kernel-choices.md).
  if constexpr ((Q4 && Compact) || (!Q4 && !Compact && std::is_same_v<S, float>)) {
    if ((int8_q4 || int8_iq4) && M == 1) {
      const Int8Chunks x1 = int8_chunks(0);
      const uint8_t* wq = static_cast<const uint8_t*>(w);
      auto rows = [&](auto five_k) {
        one_row_loop(row_bytes, tiled, N, y, flags, bias, [&](int64_t n) {
          float out;
          const int64_t row = Compact ? 0 : n * groups;  // fields read as they are
          const S* m_rows = Q4 ? mins : scales;  // IQ4 has no mins: its scales stand in
          const auto s = fields_at<Q4, Compact>(scales, groups, n, scales + row);
          const auto mn = fields_at<Q4, Compact>(m_rows, groups, n, m_rows + row);
          // IQ4's groups are runs: a constant 0 shift (a runtime one cost its product 7%)
          row_product_q4_int8<1, decltype(five_k)::value, !Q4>(&x1, K, wq + n * row_bytes, s,
                                                               mn, Q4 ? shift : 0, &out);
          return out;
        });
      };
      if (Q4 && five) rows(std::bool_constant<Q4>{});  // no FIVE instance for IQ4
      else rows(std::false_type{});
      return;
    }
  }
  if constexpr (!Q4 && Compact) {  // Q6_K's one row likewise
    if (int8_six && M == 1) {
      const Int8Chunks x1 = int8_chunks(0);
      const uint8_t* wq = static_cast<const uint8_t*>(w);
      one_row_loop(row_bytes, tiled, N, y, flags, bias, [&](int64_t n) {
        float out;
        const auto s = fields_at<Q4, Compact>(scales, groups, n, scales);
        row_product_q6_int8<1>(&x1, K, wq + n * row_bytes, s, &out);
        return out;
      });
      return;
    }
  }
#endif
  // One row of x: a loop of its own (q4 through it ran 0.87-1.07x, by how the compiler
  // inlined it, until the product was forced inline: docs/kernel-choices.md)
  if constexpr (Q4) {  // the exact q4 products (Q4_0, Q4_1; the K-quants' without int8)
    if (path == Path::bf16 && M == 1 && !strips && !int8_q4) {
      const Bf16Row x1 = bf16_row(0);
      const uint8_t* wq = static_cast<const uint8_t*>(w);
      auto rows = [&](auto five_k) {
        // Flattened: the product and its blocks inlined into the row loop
        one_row_loop(row_bytes, tiled, N, y, flags, bias, [&](int64_t n) __attribute__((flatten)) {
          float out;
          const int64_t row = Compact ? 0 : n * groups;  // fields read as they are
          const auto s = fields_at<Q4, Compact>(scales, groups, n, scales + row);
          const auto mn = fields_at<Q4, Compact>(mins, groups, n, mins + row);
          row_product_q4_bf16<1, decltype(five_k)::value>(&x1, K, wq + n * row_bytes, s, mn,
                                                         shift, &out);
          return out;
        });
      };
      if (five) rows(std::true_type{});
      else rows(std::false_type{});
      return;
    }
  }
  if constexpr (!Q4) {
    if (path == Path::bf16 && M == 1 && !six && !iq4) {
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
  const bool in_place = Compact && ((CC_BF16_PATH && path == Path::bf16) || avx2_pairs);
#pragma omp for schedule(guided, guided_rows(row_bytes)) nowait
  for (int64_t n = tiled; n < N; ++n) {
    const char* wrow = static_cast<const char*>(w) + n * row_bytes;
    if (unpack) {
      unpack_row(wrow, unpacked);
      wrow = reinterpret_cast<const char*>(unpacked);
    }
    const S* s = in_place ? nullptr : scale_rows<Q4, Compact>(scales, groups, n, 1, scale_buf);
    const S* mn = Q4 && !in_place ? scale_rows<Q4, Compact>(mins, groups, n, 1, min_buf)
                                  : nullptr;
#if CC_BF16_PATH
    const auto sp = fields_at<Q4, Compact>(scales, groups, n, s);
    const auto mp = fields_at<Q4, Compact>(Q4 ? mins : nullptr, groups, n, mn);
#endif
    if constexpr (Q4 && Compact) {
      if (five_rows) {  // fp32 x [M, K] (the fp32 path; no int8 path for Q5_K)
        dequantize_q5_row(reinterpret_cast<const uint8_t*>(wrow), s, mn, K, g,
                          reinterpret_cast<uint8_t*>(five_values + K), five_values);
        for (int64_t m = 0; m < M; ++m) {
          float total = 0.f;
          for (int64_t k = 0; k < K; ++k) total += xf[m * K + k] * five_values[k];
          store(y, flags, bias, N, n, m, 1, &total);
        }
        continue;
      }
    }
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
          CC_BY_ROWS(mb, row_product_q6_int8<MB>(rm, K, wq, sp, out));
          store(y, flags, bias, N, n, m0, mb, out);
          continue;
        }
      }
#endif
      if constexpr (!Q4 && !Compact && std::is_same_v<S, float>) {
#if CC_INT8_STRIPS
        if (int8_iq4) {
          Int8Chunks rm[MB_MAX];
          for (int64_t m = 0; m < mb; ++m) rm[m] = int8_chunks(m0 + m);
          const uint8_t* wq = reinterpret_cast<const uint8_t*>(wrow);
          CC_BY_ROWS(mb, (row_product_q4_int8<MB, false, true>(rm, K, wq, s, s, 0, out)));
          store(y, flags, bias, N, n, m0, mb, out);
          continue;
        }
#endif
        if (iq4 && path == Path::bf16) {
          Bf16Row rm[MB_MAX];
          for (int64_t m = 0; m < mb; ++m) rm[m] = bf16_row(m0 + m);
          const uint8_t* wq = reinterpret_cast<const uint8_t*>(wrow);
          CC_BY_ROWS(mb, row_product_iq4_bf16<MB>(rm, K, wq, s, out));
          store(y, flags, bias, N, n, m0, mb, out);
          continue;
        }
      }
      if constexpr (!Q4 && Compact) {
        if (six && path == Path::bf16) {
          Bf16Row rm[MB_MAX];
          for (int64_t m = 0; m < mb; ++m) rm[m] = bf16_row(m0 + m);
          const uint8_t* wq = reinterpret_cast<const uint8_t*>(wrow);
          CC_BY_ROWS(mb, row_product_q6_bf16<MB>(rm, K, wq, sp, out));
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
          if (five) CC_BY_ROWS(mb, rows_product_q4_int8<MB, true>(rm, K, wq, sp, mp, shift, out));
          else CC_BY_ROWS(mb, rows_product_q4_int8<MB>(rm, K, wq, sp, mp, shift, out));
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
          if (five) CC_BY_ROWS(mb, row_product_q4_bf16<MB, true>(rm, K, wq, sp, mp, shift, out));
          else CC_BY_ROWS(mb, row_product_q4_bf16<MB>(rm, K, wq, sp, mp, shift, out));
          store(y, flags, bias, N, n, m0, mb, out);
          continue;
        }
      }
#endif
#if CC_INT8_PATH
      if (path == Path::int8) {
        QuantRow rm[MB_MAX];
        for (int64_t m = 0; m < mb; ++m) rm[m] = quant_row(m0 + m);
        CC_BY_ROWS(mb, row_product_int8<MB, Q4>(rm, K, wrow, s, mn, out));
        store(y, flags, bias, N, n, m0, mb, out);
        continue;
      }
#endif
#if CC_AVX2_ROWS  // factored products (`row_product_q4_sums`, `row_product_q8`)
      if (avx2_pairs) {
        with_pair_codes(n, [&](auto codes) { pair_products(n, codes, m0, mb, out); });
        store(y, flags, bias, N, n, m0, mb, out);
        continue;
      }
      if constexpr (Q4) {
        const float* rows = extra + m0 * per_row;  // x's group sums, or its slots then sums
        const uint8_t* wq = reinterpret_cast<const uint8_t*>(wrow);
        if (q4_slots) CC_BY_ROWS(mb, row_product_q4_slots<MB>(rows, per_row, K, wq, s, mn, out));
        else CC_BY_ROWS(mb, row_product_q4_sums<MB>(xm, rows, K, g, wq, s, mn, out));
      } else if (avx2_int8) {
        const int8_t* xq[MB_MAX];
        const float* dx[MB_MAX];
        for (int64_t m = 0; m < mb; ++m) xq[m] = x_int8(m0 + m), dx[m] = x_scales(m0 + m);
        const int8_t* wq = reinterpret_cast<const int8_t*>(wrow);
        if (mb == 2) row_product_q8_int8<2>(xq, dx, K, wq, s, out);
        else row_product_q8_int8<1>(xq, dx, K, wq, s, out);
      } else {
        const int8_t* wq = reinterpret_cast<const int8_t*>(wrow);
        CC_BY_ROWS(mb, row_product_q8<MB>(xm, K, g, wq, s, out));
      }
      store(y, flags, bias, N, n, m0, mb, out);
      continue;
#endif
      CC_BY_ROWS(mb, row_product<MB, Q4>(xm, K, g, wrow, s, mn, out));
      store(y, flags, bias, N, n, m0, mb, out);
    }
  }
}

#include "quant/dequantize.h"

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

// 1 where products of AMX_ROWS_MIN-AMX_ROWS_MAX rows take AMX tiles (tiles_amx.h).
int64_t quant_kernels_amx_tiles() {
#if CC_AMX_TILES
  return amx_ready() ? 1 : 0;
#else
  return 0;
#endif
}

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

// Whether the K-quants', IQ4's and Q8_0's row products take int8 activations where flags
// bit 5 allows them, at every row count (AVX2: rows_avx2_int8.h; Q8_0's 1-2 rows by
// `row_product_q8_int8`).
int64_t quant_kernels_int8_pairs() { return CC_AVX2_ROWS; }

// Rows up to which Q8_0's row products take int8 activations where the caller allows them
// (AVX512-VNNI with AVX512-BF16, or AVX2); 0 where none do.
int64_t quant_kernels_int8_rows() { return CC_INT8_STRIPS || CC_AVX2_ROWS ? INT8_ROWS_Q8 : 0; }
int64_t quant_kernels_invariant_rows() { return INVARIANT_ROWS; }

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
// bit 6: q8's values packed in 6 bits (Q6_K's); bit 8: q8's values are IQ4's indices.
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

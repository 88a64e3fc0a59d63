// Prefill attention for CPUs: a chunk of one sequence's new tokens attends over the
// sequence's keys in the paged cache (its cached prefix and, causally, the chunk itself),
// as flash attention does: per tile of query rows an online softmax over blocks of 32
// keys, outputs in registers across the blocks. torch's SDPA ran this at ~70 GFLOP/s on
// two Zen 4 cores (docs/kernel-choices.md, Prefill attention). Two ways to multiply:
//  - `Bf16Dots` (AVX512-BF16, bf16 caches): the scores and the weighted sum of V as bf16
//    dot products (`vdpbf16ps`, 32 multiply-adds an instruction) into fp32; the weights
//    multiplying V rounded to bf16, as SDPA's bf16 path does. K is repacked as
//    [block][D / 2][32 keys][2] (a vector holds a pair of dimensions for 16 keys), V as
//    [block][16 key pairs][D][2] (16 dimensions for a pair of keys).
//  - `F32Fma` (AVX2 or AVX-512F; fp32 caches, and bf16 ones without AVX512-BF16): fp32
//    multiply-adds on the widest native vectors (passes/ops/fvec.h), K repacked as
//    [block][D][32 keys], V as [block][32 keys][D], both in fp32.
// A query row's sums run over the key blocks in order from key 0 whatever the chunking,
// the batch or the threads: its result depends on its own sequence only.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <omp.h>
#include <vector>

#include "exp16.h"
#include "fvec.h"

namespace {

constexpr int64_t kKeys = 32;      // keys per block: two vectors of scores a row
constexpr int64_t kRowBlock = 32;  // query rows per task
// The head sizes with an instance: the decode kernel's vector sizes (cpu_kernels.cpp,
// decode_task). One list for the dispatch and for `prefill_head_size`.
#define CC_PREFILL_HEAD_SIZES(X) X(64) X(80) X(96) X(128) X(256)

// Where block b's key j sits in the cache (`row`: elements a slot), or -1 past `len`.
inline int64_t key_offset(const int32_t* blocks, int64_t block_size, int64_t row, int64_t b,
                          int64_t j, int64_t len) {
  const int64_t t = b * kKeys + j;
  return t < len ? (int64_t(blocks[t / block_size]) * block_size + t % block_size) * row : -1;
}

#if defined(__AVX512BF16__)
// Key block b of one KV head, packed (zeros past `len`): kt [D / 2][kKeys] pairs of K,
// vp [kKeys / 2][D] pairs of V.
template <int64_t D>
void pack_block_bf16(const bf16* k_cache, const bf16* v_cache, const int32_t* blocks,
                     int64_t block_size, int64_t row, int64_t head, int64_t b, int64_t len,
                     uint32_t* kt, bf16* vp) {
  for (int64_t j = 0; j < kKeys; ++j) {
    const int64_t at = key_offset(blocks, block_size, row, b, j, len);
    uint32_t k[D / 2] = {};
    bf16 v[D] = {};
    if (at >= 0) {
      std::memcpy(k, k_cache + at + head * D, sizeof k);
      std::memcpy(v, v_cache + at + head * D, sizeof v);
    }
    for (int64_t p = 0; p < D / 2; ++p) kt[p * kKeys + j] = k[p];
    bf16* pair = vp + j / 2 * 2 * D + j % 2;
    for (int64_t x = 0; x < D; ++x) pair[2 * x] = v[x];
  }
}

// Query rows [pos, pos + rows) of one head (rows <= R) over keys [0, pos + rows). R rows'
// outputs (R * D / 16 vectors) stay in registers across the key blocks.
template <int64_t D, int64_t R>
void attend_tile_bf16(const bf16* q, int64_t q_stride, int64_t rows, int64_t pos,
                      const uint32_t* kt, const bf16* vp, float scale, bf16* out,
                      int64_t out_stride) {
  constexpr int64_t C = D / 16;
  __m512 o[R][C], s[R][2];
  float m[R], l[R];
  const uint32_t* qp[R];
  for (int64_t r = 0; r < R; ++r) {  // a short tile's spare rows repeat its last row
    qp[r] = reinterpret_cast<const uint32_t*>(q + std::min(r, rows - 1) * q_stride);
    m[r] = -INFINITY, l[r] = 0.f;
    for (int64_t c = 0; c < C; ++c) o[r][c] = _mm512_setzero_ps();
  }
  const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  alignas(64) uint32_t probs[R][kKeys / 2];
  for (int64_t first = 0; first < pos + rows; first += kKeys) {
    const uint32_t* kb = kt + first * D / 2;
    for (int64_t r = 0; r < R; ++r) s[r][0] = s[r][1] = _mm512_setzero_ps();
    for (int64_t p = 0; p < D / 2; ++p) {
      const __m512bh k0 = (__m512bh)_mm512_loadu_si512(kb + p * kKeys);
      const __m512bh k1 = (__m512bh)_mm512_loadu_si512(kb + p * kKeys + 16);
      for (int64_t r = 0; r < R; ++r) {
        const __m512bh qr = (__m512bh)_mm512_set1_epi32(int(qp[r][p]));
        s[r][0] = _mm512_dpbf16_ps(s[r][0], qr, k0);
        s[r][1] = _mm512_dpbf16_ps(s[r][1], qr, k1);
      }
    }
    for (int64_t r = 0; r < R; ++r) {
      __m512 s0 = _mm512_mul_ps(s[r][0], _mm512_set1_ps(scale));
      __m512 s1 = _mm512_mul_ps(s[r][1], _mm512_set1_ps(scale));
      __mmask16 v0 = 0xffff, v1 = 0xffff;
      if (first + kKeys - 1 > pos + r) {  // the causal edge: keys after the row's own
        const __m512i limit = _mm512_set1_epi32(int(pos + r - first));
        v0 = _mm512_cmple_epi32_mask(lane, limit);
        v1 = _mm512_cmple_epi32_mask(_mm512_add_epi32(lane, _mm512_set1_epi32(16)), limit);
        s0 = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), v0, s0);
        s1 = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), v1, s1);
      }
      const float mx = std::max(m[r], _mm512_reduce_max_ps(_mm512_max_ps(s0, s1)));
      const float correction = std::exp(m[r] - mx);  // 0 on the first block
      const __m512 p0 = _mm512_maskz_mov_ps(v0, exp16(_mm512_sub_ps(s0, _mm512_set1_ps(mx))));
      const __m512 p1 = _mm512_maskz_mov_ps(v1, exp16(_mm512_sub_ps(s1, _mm512_set1_ps(mx))));
      l[r] = l[r] * correction + _mm512_reduce_add_ps(_mm512_add_ps(p0, p1));
      m[r] = mx;
      for (int64_t c = 0; c < C; ++c) o[r][c] = _mm512_mul_ps(o[r][c], _mm512_set1_ps(correction));
      _mm512_store_si512(probs[r], (__m512i)_mm512_cvtne2ps_pbh(p1, p0));  // keys 0-15 low
    }
    const bf16* vb = vp + first * D;
    for (int64_t kp = 0; kp < kKeys / 2; ++kp) {
      __m512bh v[C];
      for (int64_t c = 0; c < C; ++c)
        v[c] = (__m512bh)_mm512_loadu_si512(vb + kp * 2 * D + c * 32);
      for (int64_t r = 0; r < R; ++r) {
        const __m512bh pr = (__m512bh)_mm512_set1_epi32(int(probs[r][kp]));
        for (int64_t c = 0; c < C; ++c) o[r][c] = _mm512_dpbf16_ps(o[r][c], pr, v[c]);
      }
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    const __m512 inv = _mm512_set1_ps(1.f / l[r]);
    for (int64_t c = 0; c < C; ++c) {
      const __m256bh h = _mm512_cvtneps_pbh(_mm512_mul_ps(o[r][c], inv));
      std::memcpy(out + r * out_stride + c * 16, &h, sizeof h);
    }
  }
}

struct Bf16Dots {
  using Packed = bf16;
  template <int64_t D>
  static constexpr int64_t R = 256 / D;  // 16 vectors of outputs
  template <int64_t D, typename T>
  static void pack(const T* k_cache, const T* v_cache, const int32_t* blocks,
                   int64_t block_size, int64_t row, int64_t head, int64_t b, int64_t len,
                   bf16* k, bf16* v) {
    pack_block_bf16<D>(k_cache, v_cache, blocks, block_size, row, head, b, len,
                       reinterpret_cast<uint32_t*>(k), v);
  }
  template <int64_t D, typename T>
  static void tile(const T* q, int64_t q_stride, int64_t rows, int64_t pos, const bf16* k,
                   const bf16* v, float scale, T* out, int64_t out_stride) {
    attend_tile_bf16<D, R<D>>(q, q_stride, rows, pos, reinterpret_cast<const uint32_t*>(k), v,
                              scale, out, out_stride);
  }
};
#endif

#if defined(__AVX2__) || defined(__AVX512F__)
constexpr bool kBuilt = true;

// Key block b of one KV head in fp32 (zeros past `len`): kt [D][kKeys], vt [kKeys][D].
template <int64_t D, typename T>
void pack_block_f32(const T* k_cache, const T* v_cache, const int32_t* blocks,
                    int64_t block_size, int64_t row, int64_t head, int64_t b, int64_t len,
                    float* kt, float* vt) {
  for (int64_t j = 0; j < kKeys; ++j) {
    const int64_t at = key_offset(blocks, block_size, row, b, j, len);
    for (int64_t x = 0; x < D; ++x) {
      kt[x * kKeys + j] = at >= 0 ? to_float(k_cache[at + head * D + x]) : 0.f;
      vt[j * D + x] = at >= 0 ? to_float(v_cache[at + head * D + x]) : 0.f;
    }
  }
}

// The same tile as attend_tile_bf16 in fp32 multiply-adds: q scaled once in fp32, the
// weights multiplying V kept in fp32.
template <int64_t D, int64_t R, typename T>
void attend_tile_f32(const T* q, int64_t q_stride, int64_t rows, int64_t pos, const float* kt,
                     const float* vt, float scale, T* out, int64_t out_stride) {
  constexpr int64_t C = D / W, S = kKeys / W;  // vectors a row of outputs, of scores
  vf o[R][C], s[R][S];
  float m[R], l[R], qf[R][D];
  for (int64_t r = 0; r < R; ++r) {  // a short tile's spare rows repeat its last row
    const T* src = q + std::min(r, rows - 1) * q_stride;
    for (int64_t x = 0; x < D; ++x) qf[r][x] = to_float(src[x]) * scale;
    m[r] = -INFINITY, l[r] = 0.f;
    for (int64_t c = 0; c < C; ++c) o[r][c] = vf{};
  }
  vi lane;
  for (int64_t i = 0; i < W; ++i) lane[i] = int32_t(i);
  alignas(64) float probs[R][kKeys];
  for (int64_t first = 0; first < pos + rows; first += kKeys) {
    const float* kb = kt + first * D;
    for (int64_t r = 0; r < R; ++r)
      for (int64_t j = 0; j < S; ++j) s[r][j] = vf{};
    for (int64_t x = 0; x < D; ++x) {
      vf k[S];
      for (int64_t j = 0; j < S; ++j) k[j] = loadv(kb + x * kKeys + j * W);
      for (int64_t r = 0; r < R; ++r)
        for (int64_t j = 0; j < S; ++j) s[r][j] += qf[r][x] * k[j];
    }
    for (int64_t r = 0; r < R; ++r) {
      if (first + kKeys - 1 > pos + r) {  // the causal edge: keys after the row's own
        const int32_t limit = int32_t(pos + r - first);
        for (int64_t j = 0; j < S; ++j)
          s[r][j] = lane + int32_t(j * W) > limit ? vf{} - INFINITY : s[r][j];
      }
      vf top = s[r][0];
      for (int64_t j = 1; j < S; ++j) top = top > s[r][j] ? top : s[r][j];
      float mx = m[r];
      for (int64_t i = 0; i < W; ++i) mx = std::max(mx, top[i]);
      const float correction = std::exp(m[r] - mx);  // 0 on the first block
      vf total = vf{};
      for (int64_t j = 0; j < S; ++j) {
        const vf p = vexp(s[r][j] - mx);  // 0 at -inf
        total += p;
        std::memcpy(probs[r] + j * W, &p, sizeof p);
      }
      float sum = 0.f;
      for (int64_t i = 0; i < W; ++i) sum += total[i];
      l[r] = l[r] * correction + sum;
      m[r] = mx;
      for (int64_t c = 0; c < C; ++c) o[r][c] *= correction;
    }
    const float* vb = vt + first * D;
    for (int64_t j = 0; j < kKeys; ++j) {
      vf v[C];
      for (int64_t c = 0; c < C; ++c) v[c] = loadv(vb + j * D + c * W);
      for (int64_t r = 0; r < R; ++r)
        for (int64_t c = 0; c < C; ++c) o[r][c] += probs[r][j] * v[c];
    }
  }
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < C; ++c)
      for (int64_t i = 0; i < W; ++i) store(out + r * out_stride + c * W + i, o[r][c][i] / l[r]);
}

struct F32Fma {
  using Packed = float;
#if defined(__AVX512F__)
  template <int64_t D>
  static constexpr int64_t R = 256 / D;  // 16 of 32 registers of outputs
#else
  template <int64_t D>
  static constexpr int64_t R = 1;  // AVX2's 16 registers: one row's outputs at head size 64
#endif
  template <int64_t D, typename T>
  static void pack(const T* k_cache, const T* v_cache, const int32_t* blocks,
                   int64_t block_size, int64_t row, int64_t head, int64_t b, int64_t len,
                   float* k, float* v) {
    pack_block_f32<D>(k_cache, v_cache, blocks, block_size, row, head, b, len, k, v);
  }
  template <int64_t D, typename T>
  static void tile(const T* q, int64_t q_stride, int64_t rows, int64_t pos, const float* k,
                   const float* v, float scale, T* out, int64_t out_stride) {
    attend_tile_f32<D, R<D>>(q, q_stride, rows, pos, k, v, scale, out, out_stride);
  }
};

template <typename P, int64_t D, typename T>
void prefill(const T* q, int64_t q_stride, const T* k_cache, const T* v_cache,
             const int32_t* blocks, int64_t context, int64_t rows, T* out, int64_t out_stride,
             int64_t heads, int64_t kv_heads, int64_t block_size, float scale,
             int64_t threads) {
  constexpr int64_t R = P::template R<D>;
  using Packed = typename P::Packed;
  const int64_t len = context + rows, key_blocks = (len + kKeys - 1) / kKeys;
  const int64_t group = heads / kv_heads, head_elems = key_blocks * kKeys * D;
  const int64_t row_blocks = (rows + kRowBlock - 1) / kRowBlock;
  thread_local std::vector<Packed> packed;  // K then V of each KV head; the team reads it
  packed.resize(2 * kv_heads * head_elems);
  Packed* buf = packed.data();
#pragma omp parallel num_threads(threads) if (threads > 1)
  {
#pragma omp for schedule(static)
    for (int64_t task = 0; task < kv_heads * key_blocks; ++task) {
      const int64_t h = task / key_blocks, b = task % key_blocks;
      Packed* kt = buf + 2 * h * head_elems + b * kKeys * D;
      P::template pack<D>(k_cache, v_cache, blocks, block_size, kv_heads * D, h, b, len, kt,
                          kt + head_elems);
    }
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < kv_heads * row_blocks; ++task) {
      // The last rows see the most keys: they go first.
      const int64_t rb = row_blocks - 1 - task / kv_heads, h = task % kv_heads;
      const Packed* kt = buf + 2 * h * head_elems;
      const int64_t end = std::min(rows, (rb + 1) * kRowBlock);
      for (int64_t r0 = rb * kRowBlock; r0 < end; r0 += R)
        for (int64_t g = 0; g < group; ++g) {
          const int64_t col = (h * group + g) * D;
          P::template tile<D>(q + r0 * q_stride + col, q_stride, std::min(R, end - r0),
                              context + r0, kt, kt + head_elems, scale,
                              out + r0 * out_stride + col, out_stride);
        }
    }
  }
}

// One head size's instance, or false where there is none.
template <typename P, typename T>
bool prefill_for(int64_t head_size, const T* q, int64_t q_stride, const T* k_cache,
                 const T* v_cache, const int32_t* blocks, int64_t context, int64_t rows, T* out,
                 int64_t out_stride, int64_t heads, int64_t kv_heads, int64_t block_size,
                 float scale, int64_t threads) {
#define CC_PREFILL_CASE(DIM)                                                                 \
  case DIM:                                                                                  \
    prefill<P, DIM>(q, q_stride, k_cache, v_cache, blocks, context, rows, out, out_stride,    \
                    heads, kv_heads, block_size, scale, threads);                             \
    return true;
  switch (head_size) { CC_PREFILL_HEAD_SIZES(CC_PREFILL_CASE) }
#undef CC_PREFILL_CASE
  return false;
}
#else
constexpr bool kBuilt = false;
#endif

}  // namespace

extern "C" {

// Whether this CPU's build has the kernels (AVX2 or AVX-512); where not, prefill_* do
// nothing and return 0.
int64_t prefill_built() { return kBuilt; }

// Whether prefill_* have an instance for this head size.
int64_t prefill_head_size(int64_t head_size) {
#define CC_PREFILL_SIZE(DIM) || head_size == DIM
  return kBuilt && (false CC_PREFILL_HEAD_SIZES(CC_PREFILL_SIZE));
#undef CC_PREFILL_SIZE
}

// One sequence's chunk: q [rows][q_stride] (heads * head_size per row) at positions
// [context, context + rows), keys [0, context + rows) in the cache through `blocks`.
// Returns 0 (and does nothing) for a head size it has no instance for.
#if defined(__AVX512BF16__)
#define CC_PREFILL_BF16 Bf16Dots
#else
#define CC_PREFILL_BF16 F32Fma
#endif
#define CC_PREFILL(NAME, T, POLICY)                                                          \
  int64_t prefill_##NAME(const T* q, int64_t q_stride, const T* k_cache, const T* v_cache,   \
                         const int32_t* blocks, int64_t context, int64_t rows, T* out,       \
                         int64_t out_stride, int64_t heads, int64_t kv_heads,                \
                         int64_t head_size, int64_t block_size, float scale,                 \
                         int64_t threads) {                                                  \
    return prefill_for<POLICY>(head_size, q, q_stride, k_cache, v_cache, blocks, context,    \
                               rows, out, out_stride, heads, kv_heads, block_size, scale,    \
                               threads);                                                     \
  }
#if defined(__AVX2__) || defined(__AVX512F__)
CC_PREFILL(bf16, bf16, CC_PREFILL_BF16)
CC_PREFILL(f32, float, F32Fma)
#else  // no instances: Python sees prefill_built() == 0 and never calls these
int64_t prefill_bf16() { return 0; }
int64_t prefill_f32() { return 0; }
#endif

}  // extern "C"

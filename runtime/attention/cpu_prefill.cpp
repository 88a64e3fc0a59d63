// Prefill attention for CPUs with AVX512-BF16: a chunk of one sequence's new tokens
// attends over the sequence's keys in the paged cache (its cached prefix and, causally,
// the chunk itself), as flash attention does: per tile of query rows an online softmax
// over blocks of 32 keys, the scores and the weighted sum of V as bf16 dot products
// (`vdpbf16ps`, 32 multiply-adds an instruction) accumulated in fp32. torch's SDPA ran
// this at ~70 GFLOP/s on two Zen 4 cores (docs/kernel-choices.md, Prefill attention).
//
// Each KV head's keys are first repacked into the layouts the dot products read: K as
// [block][D / 2][32 keys][2] (a vector holds a pair of dimensions for 16 keys), V as
// [block][16 key pairs][D][2] (a vector holds 16 dimensions for a pair of keys). A query
// row's sums run over the key blocks in order from key 0 whatever the chunking, the batch
// or the threads: its result depends on its own sequence only.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <omp.h>
#include <vector>

#include "exp16.h"

namespace {

using bf16 = uint16_t;
constexpr int64_t kKeys = 32;      // keys per block: two vectors of scores a row
constexpr int64_t kRowBlock = 32;  // query rows per task

#if defined(__AVX512BF16__)
constexpr bool kBuilt = true;

// Key block b of one KV head, packed (zeros past `len`): kt [D / 2][kKeys] pairs of K,
// vp [kKeys / 2][D] pairs of V.
template <int64_t D>
void pack_block(const bf16* k_cache, const bf16* v_cache, const int32_t* blocks,
                int64_t block_size, int64_t row, int64_t head, int64_t b, int64_t len,
                uint32_t* kt, bf16* vp) {
  for (int64_t j = 0; j < kKeys; ++j) {
    const int64_t t = b * kKeys + j;
    uint32_t k[D / 2] = {};
    bf16 v[D] = {};
    if (t < len) {
      const int64_t slot = int64_t(blocks[t / block_size]) * block_size + t % block_size;
      std::memcpy(k, k_cache + slot * row + head * D, sizeof k);
      std::memcpy(v, v_cache + slot * row + head * D, sizeof v);
    }
    for (int64_t p = 0; p < D / 2; ++p) kt[p * kKeys + j] = k[p];
    bf16* pair = vp + j / 2 * 2 * D + j % 2;
    for (int64_t x = 0; x < D; ++x) pair[2 * x] = v[x];
  }
}

// Query rows [pos, pos + rows) of one head (rows <= R) over keys [0, pos + rows). R rows'
// outputs (R * D / 16 vectors) stay in registers across the key blocks.
template <int64_t D, int64_t R>
void attend_tile(const bf16* q, int64_t q_stride, int64_t rows, int64_t pos,
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

template <int64_t D>
void prefill(const bf16* q, int64_t q_stride, const bf16* k_cache, const bf16* v_cache,
             const int32_t* blocks, int64_t context, int64_t rows, bf16* out,
             int64_t out_stride, int64_t heads, int64_t kv_heads, int64_t block_size,
             float scale, int64_t threads) {
  constexpr int64_t R = 256 / D;  // 16 vectors of outputs
  const int64_t len = context + rows, key_blocks = (len + kKeys - 1) / kKeys;
  const int64_t group = heads / kv_heads, head_elems = key_blocks * kKeys * D;
  const int64_t row_blocks = (rows + kRowBlock - 1) / kRowBlock;
  thread_local std::vector<bf16> packed;  // K then V of each KV head; the team reads it
  packed.resize(2 * kv_heads * head_elems);
  bf16* buf = packed.data();
#pragma omp parallel num_threads(threads) if (threads > 1)
  {
#pragma omp for schedule(static)
    for (int64_t task = 0; task < kv_heads * key_blocks; ++task) {
      const int64_t h = task / key_blocks, b = task % key_blocks;
      bf16* kt = buf + 2 * h * head_elems + b * kKeys * D;
      pack_block<D>(k_cache, v_cache, blocks, block_size, kv_heads * D, h, b, len,
                    reinterpret_cast<uint32_t*>(kt), kt + head_elems);
    }
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < kv_heads * row_blocks; ++task) {
      // The last rows see the most keys: they go first.
      const int64_t rb = row_blocks - 1 - task / kv_heads, h = task % kv_heads;
      const bf16* kt = buf + 2 * h * head_elems;
      const int64_t end = std::min(rows, (rb + 1) * kRowBlock);
      for (int64_t r0 = rb * kRowBlock; r0 < end; r0 += R)
        for (int64_t g = 0; g < group; ++g) {
          const int64_t col = (h * group + g) * D;
          attend_tile<D, R>(q + r0 * q_stride + col, q_stride, std::min(R, end - r0),
                            context + r0, reinterpret_cast<const uint32_t*>(kt),
                            kt + head_elems, scale, out + r0 * out_stride + col, out_stride);
        }
    }
  }
}
#else
constexpr bool kBuilt = false;
#endif

}  // namespace

extern "C" {

// Whether this CPU's build has the kernel (AVX512-BF16); where not, prefill_bf16 does
// nothing and returns 0.
int64_t prefill_built() { return kBuilt; }

// One sequence's chunk: q [rows][q_stride] (heads * head_size per row) at positions
// [context, context + rows), keys [0, context + rows) in the cache through `blocks`.
// Returns 0 (and does nothing) for a head size it has no instance for.
int64_t prefill_bf16(const bf16* q, int64_t q_stride, const bf16* k_cache, const bf16* v_cache,
                     const int32_t* blocks, int64_t context, int64_t rows, bf16* out,
                     int64_t out_stride, int64_t heads, int64_t kv_heads, int64_t head_size,
                     int64_t block_size, float scale, int64_t threads) {
#if defined(__AVX512BF16__)
  switch (head_size) {
    case 64:
      prefill<64>(q, q_stride, k_cache, v_cache, blocks, context, rows, out, out_stride, heads,
                  kv_heads, block_size, scale, threads);
      return 1;
    case 128:
      prefill<128>(q, q_stride, k_cache, v_cache, blocks, context, rows, out, out_stride,
                   heads, kv_heads, block_size, scale, threads);
      return 1;
  }
#endif
  (void)q, (void)q_stride, (void)k_cache, (void)v_cache, (void)blocks, (void)context;
  (void)rows, (void)out, (void)out_stride, (void)heads, (void)kv_heads, (void)head_size;
  (void)block_size, (void)scale, (void)threads;
  return 0;
}

}  // extern "C"

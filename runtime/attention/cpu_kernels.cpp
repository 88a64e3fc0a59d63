// Paged attention for CPUs: the KV-cache write and decode attention straight from the
// paged cache, without gathering K/V into padded copies. Built with g++ on first use
// (runtime/attention/cpu_build.py) and called through ctypes, so there is no torch header
// to compile and no Python binding to build.
//
// Cache layout: kv_cache [2, num_blocks, block_size, num_kv_heads, head_size], so slot s
// of K starts at k_cache + s * num_kv_heads * head_size. Each (sequence, KV head) pair is
// one task: the group of query heads that share the KV head reads each K/V row once, and
// an online softmax over chunks of tokens keeps everything in a few small stack buffers.
// With few pairs for the threads (batch-1 decode: 3 KV heads on 2 threads) each sequence
// is also split into parts whose softmax states are merged afterwards (split-KV, as in
// flash-decoding): both threads work, on cache rows and code that the weight stream has
// just evicted, and the batch-1 step between two layers is about half as long.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <omp.h>
#include <vector>

#include "fvec.h"

namespace {

constexpr int64_t kMaxGroupDims = 8192;  // query heads per KV head x head size
constexpr int64_t kChunk = 16;           // tokens per online-softmax update (W divides it)
constexpr int64_t kMaxGroup = 64;
constexpr int64_t kMaxParts = 16;        // parts a sequence is split into (split-KV)
constexpr int64_t kMinPartTokens = 32;   // no part shorter than this

// Online softmax over chunks of kChunk scores per query head (both kernels below).
struct OnlineSoftmax {
  int64_t group;
  float max[kMaxGroup], sum[kMaxGroup], correction[kMaxGroup];

  explicit OnlineSoftmax(int64_t g) : group(g) {
    for (int64_t i = 0; i < group; ++i) max[i] = -INFINITY, sum[i] = 0.f;
  }
  // scores [group][kChunk], n valid: turns them into weights and sets, per head, the
  // factor by which the caller rescales what it accumulated from earlier chunks.
  void update(float* scores, int64_t n) {
    for (int64_t g = 0; g < group; ++g) {
      float* sg = scores + g * kChunk;
      for (int64_t j = n; j < kChunk; ++j) sg[j] = -INFINITY;  // a short last chunk
      vf sv[kChunk / W], top = loadv(sg), total = vf{};
      for (int64_t i = 0; i < kChunk / W; ++i) {
        sv[i] = loadv(sg + i * W);
        top = top > sv[i] ? top : sv[i];
      }
      const float m = std::max(max[g], hmax(top));
      correction[g] = std::exp(max[g] - m);
      for (int64_t i = 0; i < kChunk / W; ++i) {
        sv[i] = vexp(sv[i] - m);
        std::memcpy(sg + i * W, &sv[i], sizeof sv[i]);
        total += sv[i];
      }
      sum[g] = sum[g] * correction[g] + hsum(total);
      max[g] = m;
    }
  }
};

// Walks a sequence's block table token by token without a division per token.
struct SlotCursor {
  const int32_t* blocks;
  int64_t block_size, block, offset;
  SlotCursor(const int32_t* b, int64_t size, int64_t first)
      : blocks(b), block_size(size), block(first / size), offset(first % size) {}
  // Element offsets (slot * row stride) of the next n tokens.
  void next(int64_t n, int64_t stride, int64_t* out) {
    for (int64_t j = 0; j < n; ++j) {
      out[j] = (int64_t(blocks[block]) * block_size + offset) * stride;
      if (++offset == block_size) {
        offset = 0;
        ++block;
      }
    }
  }
};

template <typename T>
void write_kv(const T* k, int64_t k_stride, const T* v, int64_t v_stride, T* k_cache,
              T* v_cache, const int64_t* slots, int64_t num_tokens, int64_t row) {
  for (int64_t i = 0; i < num_tokens; ++i) {
    const int64_t slot = slots[i];
    if (slot < 0) continue;  // padding writes nothing
    std::memcpy(k_cache + slot * row, k + i * k_stride, row * sizeof(T));
    std::memcpy(v_cache + slot * row, v + i * v_stride, row * sizeof(T));
  }
}

// A task's softmax state for tokens [begin, end): per query head of the group the
// unnormalized output (group * d floats), then the running max (group), then the sum of
// exponentials (group). `finish` merges the states of one (sequence, KV head).
inline int64_t state_size(int64_t group, int64_t d) { return group * (d + 2); }

inline void save_state(const OnlineSoftmax& softmax, int64_t group, int64_t d, float* state) {
  for (int64_t g = 0; g < group; ++g) {
    state[group * d + g] = softmax.max[g];
    state[group * d + group + g] = softmax.sum[g];
  }
}

template <typename T>
void finish(const float* states, int64_t parts, int64_t group, int64_t d, T* out) {
  const int64_t size = state_size(group, d);
  for (int64_t g = 0; g < group; ++g) {
    float m = -INFINITY, total = 0.f;
    for (int64_t p = 0; p < parts; ++p) m = std::max(m, states[p * size + group * d + g]);
    float weight[kMaxParts];
    for (int64_t p = 0; p < parts; ++p) {  // an empty part (max -inf) weighs nothing
      const float pm = states[p * size + group * d + g];
      weight[p] = pm == -INFINITY ? 0.f : std::exp(pm - m);
      total += weight[p] * states[p * size + group * d + group + g];
    }
    const float inv = total > 0.f ? 1.f / total : 0.f;
    for (int64_t x = 0; x < d; ++x) {
      float acc = 0.f;
      for (int64_t p = 0; p < parts; ++p) acc += weight[p] * states[p * size + g * d + x];
      store(out + g * d + x, acc * inv);
    }
  }
}

template <typename T>
void decode_one(const T* q, const T* k_cache, const T* v_cache, const int32_t* blocks,
                int64_t begin, int64_t end, float* state, int64_t group, int64_t num_kv_heads,
                int64_t kv_head, int64_t d, int64_t block_size, float scale) {
  float qf[kMaxGroupDims], acc[kMaxGroupDims], row[512];
  float scores[kMaxGroup * kChunk];
  OnlineSoftmax softmax(group);
  for (int64_t i = 0; i < group * d; ++i) {
    qf[i] = to_float(q[i]) * scale;
    acc[i] = 0.f;
  }
  SlotCursor cursor(blocks, block_size, begin);
  int64_t rows[kChunk];
  for (int64_t start = begin; start < end; start += kChunk) {
    const int64_t n = end - start < kChunk ? end - start : kChunk;
    cursor.next(n, num_kv_heads * d, rows);
    for (int64_t j = 0; j < n; ++j) {
      const T* k = k_cache + rows[j] + kv_head * d;
#pragma omp simd
      for (int64_t x = 0; x < d; ++x) row[x] = to_float(k[x]);
      for (int64_t g = 0; g < group; ++g) {
        float dot = 0.f;
#pragma omp simd reduction(+ : dot)
        for (int64_t x = 0; x < d; ++x) dot += qf[g * d + x] * row[x];
        scores[g * kChunk + j] = dot;
      }
    }
    softmax.update(scores, n);
    for (int64_t g = 0; g < group; ++g) {
#pragma omp simd
      for (int64_t x = 0; x < d; ++x) acc[g * d + x] *= softmax.correction[g];
    }
    for (int64_t j = 0; j < n; ++j) {
      const T* v = v_cache + rows[j] + kv_head * d;
#pragma omp simd
      for (int64_t x = 0; x < d; ++x) row[x] = to_float(v[x]);
      for (int64_t g = 0; g < group; ++g) {
        const float p = scores[g * kChunk + j];
#pragma omp simd
        for (int64_t x = 0; x < d; ++x) acc[g * d + x] += p * row[x];
      }
    }
  }
  std::memcpy(state, acc, group * d * sizeof(float));
  save_state(softmax, group, d, state);
}

// The same online softmax with the head dimension in registers: D is a compile-time
// multiple of 16, so each K/V row is D / W vector loads and every dot product is D / W
// independent multiplies and one horizontal sum.
template <typename T, int64_t D>
void decode_one_vec(const T* q, const T* k_cache, const T* v_cache, const int32_t* blocks,
                    int64_t begin, int64_t end, float* state, int64_t group,
                    int64_t num_kv_heads, int64_t kv_head, int64_t block_size, float scale) {
  constexpr int64_t C = D / W;
  vf qv[kMaxGroupDims / W], acc[kMaxGroupDims / W], row[C];
  float scores[kMaxGroup * kChunk];
  OnlineSoftmax softmax(group);
  for (int64_t i = 0; i < group * C; ++i) {
    qv[i] = loadv(q + i * W) * scale;
    acc[i] = vf{};
  }
  SlotCursor cursor(blocks, block_size, begin);
  int64_t rows[kChunk];
  for (int64_t start = begin; start < end; start += kChunk) {
    const int64_t n = end - start < kChunk ? end - start : kChunk;
    cursor.next(n, num_kv_heads * D, rows);
    for (int64_t j = 0; j < n; ++j) {
      const T* k = k_cache + rows[j] + kv_head * D;
      for (int64_t c = 0; c < C; ++c) row[c] = loadv(k + c * W);
      for (int64_t g = 0; g < group; ++g) {
        vf dot = qv[g * C] * row[0];
        for (int64_t c = 1; c < C; ++c) dot += qv[g * C + c] * row[c];
        scores[g * kChunk + j] = hsum(dot);
      }
    }
    softmax.update(scores, n);
    for (int64_t g = 0; g < group; ++g)
      for (int64_t c = 0; c < C; ++c) acc[g * C + c] *= softmax.correction[g];
    for (int64_t j = 0; j < n; ++j) {
      const T* v = v_cache + rows[j] + kv_head * D;
      for (int64_t c = 0; c < C; ++c) row[c] = loadv(v + c * W);
      for (int64_t g = 0; g < group; ++g) {
        const float p = scores[g * kChunk + j];
        for (int64_t c = 0; c < C; ++c) acc[g * C + c] += p * row[c];
      }
    }
  }
  std::memcpy(state, acc, group * D * sizeof(float));
  save_state(softmax, group, D, state);
}

template <typename T>
void decode_task(const T* q, const T* k_cache, const T* v_cache, const int32_t* blocks,
                 int64_t begin, int64_t end, float* state, int64_t group,
                 int64_t num_kv_heads, int64_t kv_head, int64_t d, int64_t block_size,
                 float scale) {
#define VEC_CASE(DIM)                                                                      \
  case DIM:                                                                                \
    return decode_one_vec<T, DIM>(q, k_cache, v_cache, blocks, begin, end, state, group,  \
                                  num_kv_heads, kv_head, block_size, scale);
  switch (d) {
    VEC_CASE(64)
    VEC_CASE(80)
    VEC_CASE(96)
    VEC_CASE(128)
    VEC_CASE(256)
    default:
      return decode_one(q, k_cache, v_cache, blocks, begin, end, state, group, num_kv_heads,
                        kv_head, d, block_size, scale);
  }
#undef VEC_CASE
}

inline int64_t longest(const int32_t* seq_lens, int64_t num_seqs) {
  int64_t n = 0;
  for (int64_t s = 0; s < num_seqs; ++s) n = std::max<int64_t>(n, seq_lens[s]);
  return n;
}

// Parts per sequence: enough (sequence, KV head, part) tasks for two per thread, none
// shorter than kMinPartTokens; 1 when the pairs alone keep the threads busy.
inline int64_t num_parts(int64_t pairs, int64_t longest_len, int64_t num_threads) {
  if (num_threads <= 1 || pairs >= 2 * num_threads) return 1;
  const int64_t want = (2 * num_threads + pairs - 1) / pairs;
  const int64_t most = std::max<int64_t>(1, longest_len / kMinPartTokens);
  return std::min({want, most, kMaxParts});
}

// Batch-invariant mode (max_parts > 0): a sequence's parts depend on its own length only,
// at most max_parts (the engine's threads), so its bits never depend on the batch
// (tests/test_batch_invariant.py). 0: every sequence gets the batch's `parts`.
inline int64_t parts_of(int64_t parts, int64_t max_parts, int64_t len) {
  if (max_parts <= 0) return parts;
  return std::clamp<int64_t>(len / kMinPartTokens, 1, std::min(max_parts, kMaxParts));
}

template <typename T>
void decode(const T* q, int64_t q_stride, const T* k_cache, const T* v_cache,
            const int32_t* block_table, int64_t bt_stride, const int32_t* seq_lens, T* out,
            int64_t out_stride, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
            int64_t head_size, int64_t block_size, float scale, int64_t num_threads,
            int64_t max_parts) {
  const int64_t group = num_heads / num_kv_heads;
  // Parts slots a (sequence, KV head) pair has; its own count may be fewer.
  const int64_t parts = max_parts > 0 ? std::min(max_parts, kMaxParts)
                                      : num_parts(num_seqs * num_kv_heads,
                                                  longest(seq_lens, num_seqs), num_threads);
  const int64_t size = state_size(group, head_size);
  // Parts' states live until the merge (in the calling thread's buffer, kept between
  // calls: this runs once a layer every step); one part's state stays on the task's stack.
  thread_local std::vector<float> buffer;
  if (parts > 1) buffer.resize(num_seqs * num_kv_heads * parts * size);
  float* states = buffer.data();  // the team's threads see this thread's buffer through it
  // Small batches are cheaper on one thread than waking the OpenMP pool.
#pragma omp parallel for collapse(3) schedule(dynamic, 1) num_threads(num_threads) \
    if (num_threads > 1)
  for (int64_t s = 0; s < num_seqs; ++s) {
    for (int64_t h = 0; h < num_kv_heads; ++h) {
      for (int64_t p = 0; p < parts; ++p) {
        const int64_t first = h * group * head_size, len = seq_lens[s];
        const int64_t own = parts_of(parts, max_parts, len);
        if (p >= own) continue;
        float local[kMaxGroupDims + 2 * kMaxGroup];
        float* state = own > 1 ? states + ((s * num_kv_heads + h) * parts + p) * size : local;
        decode_task(q + s * q_stride + first, k_cache, v_cache, block_table + s * bt_stride,
                    len * p / own, len * (p + 1) / own, state, group, num_kv_heads, h,
                    head_size, block_size, scale);
        if (own == 1) finish(state, 1, group, head_size, out + s * out_stride + first);
      }
    }
  }
  for (int64_t s = 0; parts > 1 && s < num_seqs; ++s) {
    const int64_t own = parts_of(parts, max_parts, seq_lens[s]);
    for (int64_t h = 0; own > 1 && h < num_kv_heads; ++h)
      finish(states + (s * num_kv_heads + h) * parts * size, own, group, head_size,
             out + s * out_stride + h * group * head_size);
  }
}

// The KV write and decode on the calling thread's share of an OpenMP team that a CPU
// graph's replay keeps open across the step's layers (compilecore/cpu_graph.py): no pool
// to wake per call, so both threads work at any length. Orphaned worksharing loops bind to
// that team; their implicit barriers order the parts' states before their merge.
template <typename T>
void write_kv_team(const T* k, int64_t k_stride, const T* v, int64_t v_stride, T* k_cache,
                   T* v_cache, const int64_t* slots, int64_t num_tokens, int64_t row) {
  const int64_t t = omp_get_thread_num(), n = omp_get_num_threads();
  const int64_t first = num_tokens * t / n, last = num_tokens * (t + 1) / n;
  write_kv(k + first * k_stride, k_stride, v + first * v_stride, v_stride, k_cache, v_cache,
           slots + first, last - first, row);
}

// Loads every K and V row of tokens [begin, end), token by token: a token's rows of all KV
// heads are one contiguous run, so the loads walk memory in order and many are in flight at
// once. Inside a CPU graph's step the weight stream has evicted these rows since the last
// step; a task that meets them one head's row at a time waits ~9 ns a line, in memory order
// they arrive at ~5-6 ns a line (docs/kernel-choices.md, Decode attention; software
// prefetches of the same rows did not arrive in time).
template <typename T>
void load_rows(const T* k_cache, const T* v_cache, const int32_t* blocks, int64_t begin,
               int64_t end, int64_t row, int64_t block_size) {
  uint32_t seen = 0;
  SlotCursor cursor(blocks, block_size, begin);
  int64_t offsets[kChunk];
  for (int64_t start = begin; start < end; start += kChunk) {
    const int64_t n = std::min(end - start, kChunk);
    cursor.next(n, row, offsets);
    for (const T* cache : {k_cache, v_cache})
      for (int64_t j = 0; j < n; ++j) {
        const auto* bytes = reinterpret_cast<const uint8_t*>(cache + offsets[j]);
        for (int64_t b = 0; b < row * int64_t(sizeof(T)); b += 64) seen += bytes[b];
      }
  }
  asm volatile("" : : "r"(seen));  // keeps the loads, writes nothing shared
}

template <typename T>
void decode_team(const T* q, int64_t q_stride, const T* k_cache, const T* v_cache,
                 const int32_t* block_table, int64_t bt_stride, const int32_t* seq_lens, T* out,
                 int64_t out_stride, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
                 int64_t head_size, int64_t block_size, float scale, float* states,
                 int64_t max_parts) {
  const int64_t group = num_heads / num_kv_heads, pairs = num_seqs * num_kv_heads;
  const int64_t threads = omp_get_num_threads(), me = omp_get_thread_num();
  const int64_t parts = max_parts > 0 ? std::min(max_parts, kMaxParts)
                                      : num_parts(pairs, longest(seq_lens, num_seqs), threads);
  const int64_t size = state_size(group, head_size);
  // Tasks are dealt round robin (not taken dynamically), so a thread knows its tasks before
  // it starts. One sequence split into one part per thread (batch 1): this thread's tasks
  // are part `me` of every KV head, one token range, whose rows it loads in memory order.
  if (num_seqs == 1 && parts_of(parts, max_parts, seq_lens[0]) == threads) {
    const int64_t len = seq_lens[0];
    load_rows(k_cache, v_cache, block_table, len * me / threads, len * (me + 1) / threads,
              num_kv_heads * head_size, block_size);
  }
#pragma omp for schedule(static, 1)
  for (int64_t task = 0; task < pairs * parts; ++task) {
    const int64_t s = task / (num_kv_heads * parts), h = task / parts % num_kv_heads;
    const int64_t p = task % parts, first = h * group * head_size, len = seq_lens[s];
    const int64_t own = parts_of(parts, max_parts, len);
    if (p >= own) continue;
    float local[kMaxGroupDims + 2 * kMaxGroup];
    float* state = own > 1 ? states + task * size : local;
    decode_task(q + s * q_stride + first, k_cache, v_cache, block_table + s * bt_stride,
                len * p / own, len * (p + 1) / own, state, group, num_kv_heads, h,
                head_size, block_size, scale);
    if (own == 1) finish(state, 1, group, head_size, out + s * out_stride + first);
  }
  if (parts == 1) return;
#pragma omp for nowait
  for (int64_t pair = 0; pair < pairs; ++pair) {
    const int64_t own = parts_of(parts, max_parts, seq_lens[pair / num_kv_heads]);
    if (own > 1)
      finish(states + pair * parts * size, own, group, head_size,
             out + pair / num_kv_heads * out_stride + pair % num_kv_heads * group * head_size);
  }
}

}  // namespace

extern "C" {

int64_t max_group_dims() { return kMaxGroupDims; }
// Parts each sequence's decode is split into (for tests and readers of a profile).
int64_t decode_parts(int64_t pairs, int64_t longest_len, int64_t num_threads) {
  return num_parts(pairs, longest_len, num_threads);
}
int64_t max_group() { return kMaxGroup; }
// Floats of split-KV state `decode_team_*` needs for a batch.
int64_t decode_team_states(int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
                           int64_t head_size) {
  return num_seqs * num_kv_heads * kMaxParts * state_size(num_heads / num_kv_heads, head_size);
}

#define COMPILECORE_KERNELS(NAME, T)                                                       \
  void write_kv_##NAME(const T* k, int64_t k_stride, const T* v, int64_t v_stride,        \
                       T* k_cache, T* v_cache, const int64_t* slots, int64_t num_tokens,   \
                       int64_t row) {                                                      \
    write_kv(k, k_stride, v, v_stride, k_cache, v_cache, slots, num_tokens, row);          \
  }                                                                                        \
  void decode_##NAME(const T* q, int64_t q_stride, const T* k_cache, const T* v_cache,     \
                     const int32_t* block_table, int64_t bt_stride, const int32_t* seq_lens, \
                     T* out, int64_t out_stride, int64_t num_seqs, int64_t num_heads,      \
                     int64_t num_kv_heads, int64_t head_size, int64_t block_size,          \
                     float scale, int64_t num_threads, int64_t max_parts) {                \
    decode(q, q_stride, k_cache, v_cache, block_table, bt_stride, seq_lens, out,           \
           out_stride, num_seqs, num_heads, num_kv_heads, head_size, block_size, scale,    \
           num_threads, max_parts);                                                        \
  }                                                                                        \
  /* Team functions (see write_kv_team): called on every thread of a replay's region. */   \
  void write_kv_team_##NAME(const T* k, int64_t k_stride, const T* v, int64_t v_stride,   \
                            T* k_cache, T* v_cache, const int64_t* slots,                  \
                            int64_t num_tokens, int64_t row) {                             \
    write_kv_team(k, k_stride, v, v_stride, k_cache, v_cache, slots, num_tokens, row);     \
  }                                                                                        \
  void decode_team_##NAME(const T* q, int64_t q_stride, const T* k_cache, const T* v_cache, \
                          const int32_t* block_table, int64_t bt_stride,                   \
                          const int32_t* seq_lens, T* out, int64_t out_stride,             \
                          int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,       \
                          int64_t head_size, int64_t block_size, const float* scale,       \
                          float* states, int64_t max_parts) {                              \
    decode_team(q, q_stride, k_cache, v_cache, block_table, bt_stride, seq_lens, out,      \
                out_stride, num_seqs, num_heads, num_kv_heads, head_size, block_size,      \
                *scale, states, max_parts);                                                \
  }

COMPILECORE_KERNELS(f32, float)
COMPILECORE_KERNELS(bf16, bf16)

}  // extern "C"

// Sampling rows of fp32 logits on CPU: the kernel behind runtime/cpu_sampling.py's
// `sample_rows`, with the same filters and the same kept set as its numpy `kept_weights`
// (temperature, min-p, top-k with ties, top-p renormalized after top-k), drawn by the
// inverse CDF of one uniform per row.
//
// Why C: in numpy each row costs ~15 calls, each cold after the weights have streamed
// through the caches (~0.4 ms a batch-1 step), and a batch's rows run one after another on
// one core. Here one pass computes the weights, their sum, per-block sums for the draw and
// how many tokens (and how much weight) lie above a few thresholds; only the tokens above
// the threshold that holds the top-k or the top-p mass are sorted; rows run in parallel.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

namespace {

// Weights relative to the top token's, as in cpu_sampling.py's _THRESHOLDS.
constexpr int kLevels = 9;
constexpr float kThresholds[kLevels] = {1e-1f, 1e-2f, 1e-3f, 1e-4f, 1e-6f,
                                        1e-9f, 1e-14f, 1e-20f, 1e-30f};
constexpr int64_t kBlock = 1024;  // the draw: block sums first, then one block's scan
// What a row with no distribution to draw from gives: a nan logit, or every logit -inf
// (the request's own filters masked every token). runtime/sampler.py's NO_TOKEN.
constexpr int64_t kNoToken = -1;

// exp(x) for x <= 0 (a weight relative to the top token's): range reduction by ln 2 and a
// degree-6 polynomial, plain code that the compiler vectorizes (libm's expf does not).
inline float exp_nonpositive(float x) {
  const bool zero = x < -103.f;  // below fp32's smallest denormal (~e^-103), and -inf
  x = std::max(x, -103.f);
  const float n = std::nearbyint(x * 1.44269504f);
  const float r = (x - n * 0.693145752f) - n * 1.42860677e-6f;
  float p = 1.f / 720;
  p = p * r + 1.f / 120;
  p = p * r + 1.f / 24;
  p = p * r + 1.f / 6;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  // 2^n in two steps, so that n down to -149 (denormals) stays exact.
  const int32_t e = int32_t(n);
  const int32_t half = e / 2;
  float a, b;
  const int32_t ab = (half + 127) << 23, bb = (e - half + 127) << 23;
  std::memcpy(&a, &ab, 4);
  std::memcpy(&b, &bb, 4);
  return zero ? 0.f : p * a * b;
}

struct Row {
  const float* logits;
  int64_t vocab;
  float inv_temperature, min_p;
  int64_t top_k;  // 0: off
  double top_p;   // 1: off
  double u;       // uniform in [0, 1)
};

// The index of the first weight whose running sum passes `target` (the last nonzero one
// where rounding left `target` at the very end).
int64_t search(const float* w, int64_t n, double target) {
  double run = 0;
  int64_t last = -1;
  for (int64_t i = 0; i < n; ++i) {
    if (w[i] == 0.f) continue;
    run += w[i];
    last = i;
    if (run > target) return i;
  }
  return last;
}

// Not inlined: inside the parallel loop GCC left this reduction scalar (~4x slower).
__attribute__((noinline)) float row_max(const float* x, int64_t V) {
  float top = x[0];
#pragma omp simd reduction(max : top)
  for (int64_t i = 0; i < V; ++i) top = top > x[i] ? top : x[i];
  return top;
}

// Fills w with the row's weights (relative to the top token's, min-p applied) and the
// per-block sums; returns their total. Locals only in the loops: a store to w could alias
// a float member of `row`, which keeps the compiler from vectorizing.
double weigh(const Row& row, float top, float* w, double* blocks, int64_t nblocks) {
  const float* x = row.logits;
  const float inv_t = row.inv_temperature, min_p = row.min_p;
  double total = 0;
  for (int64_t b = 0; b < nblocks; ++b) {
    const int64_t lo = b * kBlock, hi = std::min(row.vocab, lo + kBlock);
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = lo; i < hi; ++i) {
      float wi = exp_nonpositive((x[i] - top) * inv_t);
      wi = wi < min_p ? 0.f : wi;  // probability below min_p x the top one's
      w[i] = wi;
      sum += wi;
    }
    blocks[b] = sum;
    total += sum;
  }
  return total;
}

// The largest threshold above which the tokens hold the top-k (k > 0) or `need` of the
// weight (usually the first or second: a pass each), or -1 where none does.
int candidate_level(const float* w, int64_t V, int64_t k, double need) {
  for (int l = 0; l < kLevels; ++l) {
    const float t = kThresholds[l];
    // The count in a float (exact below 2^24 tokens): a loop of one element type. With
    // int64 counters beside float sums in a similar loop, GCC emitted an aligned vector
    // load at a misaligned address (a crash standalone, wrong sums in the library).
    float count = 0.f, mass = 0.f;
#pragma omp simd reduction(+ : count, mass)
    for (int64_t i = 0; i < V; ++i) {
      count += w[i] >= t ? 1.f : 0.f;
      mass += w[i] >= t ? w[i] : 0.f;
    }
    if (k > 0 ? count >= float(k) : mass >= need) return l;
  }
  return -1;
}

using Candidates = std::vector<std::pair<float, int32_t>>;

// Appends (weight, id) of the tokens with lowest <= weight < highest; a block is scanned
// token by token only where a vector pass finds one.
void gather(const float* w, int64_t V, float lowest, float highest, Candidates& out) {
  for (int64_t lo = 0; lo < V; lo += kBlock) {
    const int64_t hi = std::min(V, lo + kBlock);
    int64_t count = 0;
#pragma omp simd reduction(+ : count)
    for (int64_t i = lo; i < hi; ++i) count += w[i] >= lowest && w[i] < highest;
    for (int64_t i = lo; count > 0 && i < hi; ++i)
      if (w[i] >= lowest && w[i] < highest) out.emplace_back(w[i], int32_t(i)), --count;
  }
}

bool heavier(const std::pair<float, int32_t>& a, const std::pair<float, int32_t>& b) {
  return a.first > b.first || (a.first == b.first && a.second < b.second);
}

// Top-p over cand[start:], sorted heaviest first, after cand[:start] (all kept, weighing
// `before`): keeps the tokens whose weight before them is below `need` (the first always)
// and the ties of the last kept.
void nucleus(Candidates& cand, size_t start, double before, double need) {
  size_t n = start;
  while (n < cand.size() && (n == 0 || before < need)) before += cand[n++].first;
  if (n > start) {
    const float last = cand[n - 1].first;
    while (n < cand.size() && cand[n].first >= last) ++n;
  }
  cand.resize(n);
}

// The kept tokens of a filtered row, in `cand` (any order): top-k keeps every token as
// heavy as the k-th (vLLM's ties), then top-p over what top-k kept, renormalized.
void keep(const Row& row, const float* w, double total, Candidates& cand) {
  const float kSmallest = 1e-45f;  // fp32's smallest denormal: weight > 0
  const int level = candidate_level(w, row.vocab, row.top_k, row.top_p * total);
  const float lowest = level < 0 ? kSmallest : kThresholds[level];
  cand.clear();
  if (row.top_k > 0) {
    gather(w, row.vocab, lowest, INFINITY, cand);
    if (int64_t(cand.size()) > row.top_k) {
      std::nth_element(cand.begin(), cand.begin() + row.top_k - 1, cand.end(), heavier);
      const float kth = cand[row.top_k - 1].first;
      cand.erase(std::partition(cand.begin() + row.top_k, cand.end(),
                                [kth](const auto& c) { return c.first >= kth; }),
                 cand.end());
    }
    if (row.top_p < 1.0) {
      double kept = 0;
      for (const auto& c : cand) kept += c.first;
      std::sort(cand.begin(), cand.end(), heavier);
      nucleus(cand, 0, 0.0, row.top_p * kept);
    }
    return;
  }
  // Top-p alone: above the threshold before `level` everything stays (less than top_p of
  // the weight lies there), so only the band below it is sorted.
  const float highest = level <= 0 ? INFINITY : kThresholds[level - 1];
  gather(w, row.vocab, highest, INFINITY, cand);
  const size_t sure = cand.size();
  double before = 0;
  for (const auto& c : cand) before += c.first;
  gather(w, row.vocab, lowest, highest, cand);
  std::sort(cand.begin() + sure, cand.end(), heavier);
  nucleus(cand, sure, before, row.top_p * total);
}

int64_t sample_row(const Row& row, std::vector<float>& weights, std::vector<double>& blocks,
                   Candidates& cand) {
  const float* x = row.logits;
  const int64_t V = row.vocab;
  const float top = row_max(x, V);
  weights.resize(V);
  float* w = weights.data();
  const int64_t nblocks = (V + kBlock - 1) / kBlock;
  blocks.resize(nblocks);
  const double total = weigh(row, top, w, blocks.data(), nblocks);
  if (std::isnan(total)) {  // a nan, a +inf or every logit -inf: no distribution
    for (int64_t i = 0; i < V; ++i)
      if (std::isnan(x[i])) return kNoToken;
    for (int64_t i = 0; i < V; ++i)
      if (x[i] == INFINITY) return i;
    return kNoToken;  // every token masked
  }
  if (row.top_k <= 0 && row.top_p >= 1.0) {  // the whole row: the block, then the token
    double target = row.u * total;
    int64_t b = 0;
    while (b + 1 < nblocks && (target >= blocks[b] || blocks[b] == 0.0)) target -= blocks[b++];
    while (blocks[b] == 0.0) --b;  // rounding past the last block that may be drawn
    const int64_t lo = b * kBlock;
    return lo + search(w + lo, std::min(V, lo + kBlock) - lo, target);
  }
  keep(row, w, total, cand);
  double kept_total = 0;
  for (const auto& c : cand) kept_total += c.first;
  const double target = row.u * kept_total;
  double run = 0;
  for (const auto& c : cand) {
    run += c.first;
    if (run > target) return c.second;
  }
  return cand.empty() ? kNoToken : cand.back().second;  // rounding at the range's end
}

}  // namespace

extern "C" {

int64_t sample_rows_available() { return 1; }

// Row r of the batch samples a row of `logits` ([*, vocab], `stride` floats apart) into
// tokens[r] as `spec[6 r ...]` says: (logits row, 1 / temperature, min_p, top_k or 0,
// top_p, uniform draw). The rows run in parallel when there are several.
void sample_rows(const float* logits, int64_t stride, int64_t vocab, int64_t rows,
                 const double* spec, int64_t* tokens) {
#pragma omp parallel if (rows > 1)
  {
    // Kept per thread across calls: a fresh row-sized buffer each call is fresh pages.
    static thread_local std::vector<float> w;
    static thread_local std::vector<double> blocks;
    static thread_local std::vector<std::pair<float, int32_t>> cand;
#pragma omp for schedule(dynamic, 1)
    for (int64_t r = 0; r < rows; ++r) {
      const double* sp = spec + 6 * r;
      const Row row{logits + int64_t(sp[0]) * stride, vocab, float(sp[1]), float(sp[2]),
                    int64_t(sp[3]), sp[4], sp[5]};
      tokens[r] = sample_row(row, w, blocks, cand);
    }
  }
}

}  // extern "C"

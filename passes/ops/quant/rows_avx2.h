// Part of quant_kernels.cpp, which includes it inside its anonymous namespace (the build
// inlines the text: passes/native.py `op_source`); the row products on AVX2 + FMA
// without AVX-512.

// AVX2 + FMA without AVX-512 (Zen 1-3, Haswell to Ice Lake clients): the fp32 path's row
// products, with the products factored as the bf16 path factors them.
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
#define CC_AVX2_ROWS 1
inline float hsum8(__m256 t) {
  const __m128 h = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
  const __m128 q = _mm_add_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_add_ss(q, _mm_movehdup_ps(q)));
}

inline __m256 load8(const f16* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }

// x's sums per group of g, for q4's mins (`row_product_q4_sums`), once a call.
inline void group_sums(const float* x, int64_t K, int64_t g, float* sums) {
  for (int64_t gi = 0; gi < K / g; ++gi) {
    __m256 a = _mm256_setzero_ps();
    for (int64_t k = gi * g; k < (gi + 1) * g; k += 8) a = _mm256_add_ps(a, _mm256_loadu_ps(x + k));
    sums[gi] = hsum8(a);
  }
}

// A row's total plus its mins' term: the sum over groups of min times x's group sum.
template <typename S>
inline float with_mins(__m256 total, const float* sums, int64_t groups, const S* mn) {
  __m256 mins = _mm256_setzero_ps();
  int64_t gi = 0;
  for (; gi + 8 <= groups; gi += 8)
    mins = _mm256_fmadd_ps(load8(mn + gi), _mm256_loadu_ps(sums + gi), mins);
  float tail = 0.f;
  for (; gi < groups; ++gi) tail += scale1(mn[gi]) * sums[gi];
  return hsum8(_mm256_add_ps(total, mins)) + tail;
}

// q4 on AVX2: out[m] = sum over groups of scale (q . x) + min (sum of x), the integers'
// products exact in fp32 as on the bf16 path, x's sums from `group_sums`: 14 vector ops a
// run of 32 where dequantizing every value first (as the AVX-512 `row_product` does) took
// 18; single-threaded 1.17x (9.7 -> 11.3 G values/s, 2048x8192 blocks from memory).
template <int MB, typename S>
inline void row_product_q4_sums(const float* x, const float* sums, int64_t K, int64_t g,
                                const uint8_t* w, const S* s, const S* mn, float* out) {
  const int64_t groups = K / g;
  __m256 total[MB_MAX];
  for (int m = 0; m < MB; ++m) total[m] = _mm256_setzero_ps();
  const __m256i low4 = _mm256_set1_epi32(15);
  for (int64_t gi = 0, k0 = 0; gi < groups; ++gi, k0 += g) {
    __m256 lo_acc[MB_MAX], hi_acc[MB_MAX];
    for (int m = 0; m < MB; ++m) lo_acc[m] = hi_acc[m] = _mm256_setzero_ps();
    for (int64_t k = k0; k < k0 + g; k += 32) {
      for (int h = 0; h < 2; ++h) {  // values k + 8h.. (low nibbles), k + 16 + 8h.. (high)
        const __m256i v = _mm256_cvtepu8_epi32(
            _mm_loadl_epi64(reinterpret_cast<const __m128i*>(w + k / 2 + 8 * h)));
        const __m256 lo = _mm256_cvtepi32_ps(_mm256_and_si256(v, low4));
        const __m256 hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4));
        for (int m = 0; m < MB; ++m) {
          lo_acc[m] = _mm256_fmadd_ps(lo, _mm256_loadu_ps(x + m * K + k + 8 * h), lo_acc[m]);
          hi_acc[m] = _mm256_fmadd_ps(hi, _mm256_loadu_ps(x + m * K + k + 16 + 8 * h), hi_acc[m]);
        }
      }
    }
    const __m256 scale = _mm256_set1_ps(scale1(s[gi]));
    for (int m = 0; m < MB; ++m)
      total[m] = _mm256_fmadd_ps(_mm256_add_ps(lo_acc[m], hi_acc[m]), scale, total[m]);
  }
  for (int m = 0; m < MB; ++m) out[m] = with_mins(total[m], sums + m * groups, groups, mn);
}

// q4 in groups of 32 (Q4_0, Q4_1, Q4_K's exact products) on AVX2, two runs a 256-bit
// load: a 32-bit lane's nibbles masked in place (v & 15 << 4t, then the same of v >> 16)
// are the integers q 2^4t, exact in fp32 after one conversion, so 8 values cost a mask, a
// conversion and an FMA, where widening the bytes first (`row_product_q4_sums`) took 4 ops
// and a group's scalar scale. x is laid out once a call in the lanes' order and scaled by
// 2^-4t (`slot_order`: exact unless a value is below 2^-114), its run sums after it.
// Single-threaded on a 2048x2048 block in L2 (Zen 3): 7.0 -> 11.5 G values/s.
inline void slot_order(const float* x, int64_t K, float* xs) {
  const float shrink[4] = {1.f, 1.f / 16, 1.f / 256, 1.f / 4096};
  for (int64_t p = 0; p < K / 64; ++p)
    for (int t = 0; t < 8; ++t)
      for (int i = 0; i < 8; ++i) {
        const int byte = 4 * (i % 4) + 2 * (t / 4) + (t % 4) / 2;
        const int e = 32 * (i / 4) + byte + 16 * (t % 2);  // odd slots: high nibbles
        xs[64 * p + 8 * t + i] = x[64 * p + e] * shrink[t % 4];
      }
}

// Lanes [i x4 | j x4] of v.
inline __m256 lanes(__m256 v, int i, int j) {
  return _mm256_permutevar8x32_ps(v, _mm256_setr_epi32(i, i, i, i, j, j, j, j));
}

// Two runs' scales as [a x4 | b x4] (fp32: IQ4's, decoded Q4_K's; fp16: Q8_0's, q4's).
inline __m256 two_scales(const float* s) {
  const __m128 two = _mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(s)));
  return lanes(_mm256_castps128_ps256(two), 0, 1);
}
inline __m256 two_scales(const f16* s) {
  uint32_t bits;
  std::memcpy(&bits, s, sizeof bits);
  return lanes(_mm256_castps128_ps256(_mm_cvtph_ps(_mm_cvtsi32_si128(int(bits)))), 0, 1);
}

// Rows of x at xs + m stride (`slot_order`), each row's run sums K floats after it.
template <int MB, typename S>
inline void row_product_q4_slots(const float* xs, int64_t stride, int64_t K,
                                 const uint8_t* w, const S* s, const S* mn, float* out) {
  __m256 total[MB_MAX];
  for (int m = 0; m < MB; ++m) total[m] = _mm256_setzero_ps();
  for (int64_t p = 0; p < K / 64; ++p) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 32 * p));
    const __m256i u = _mm256_srli_epi32(v, 16);
    __m256 q[8];
    for (int t = 0; t < 4; ++t) {
      const __m256i mask = _mm256_set1_epi32(15 << (4 * t));
      q[t] = _mm256_cvtepi32_ps(_mm256_and_si256(v, mask));
      q[t + 4] = _mm256_cvtepi32_ps(_mm256_and_si256(u, mask));
    }
    const __m256 scale = two_scales(s + 2 * p);
    for (int m = 0; m < MB; ++m) {  // two chains a row
      const float* xp = xs + m * stride + 64 * p;
      __m256 a = _mm256_mul_ps(q[0], _mm256_loadu_ps(xp));
      __m256 b = _mm256_mul_ps(q[1], _mm256_loadu_ps(xp + 8));
      for (int t = 2; t < 8; t += 2) {
        a = _mm256_fmadd_ps(q[t], _mm256_loadu_ps(xp + 8 * t), a);
        b = _mm256_fmadd_ps(q[t + 1], _mm256_loadu_ps(xp + 8 * t + 8), b);
      }
      total[m] = _mm256_fmadd_ps(_mm256_add_ps(a, b), scale, total[m]);
    }
  }
  for (int m = 0; m < MB; ++m) out[m] = with_mins(total[m], xs + m * stride + K, K / 32, mn);
}

// q8 on AVX2 likewise: out[m] = sum over groups of scale (q . x), the products exact in
// fp32; groups of 16 (Q6_K's), 32 (Q8_0's) or the whole row.
template <int MB, typename S>
inline void row_product_q8(const float* x, int64_t K, int64_t g, const int8_t* w, const S* s,
                           float* out) {
  __m256 total[MB_MAX];
  for (int m = 0; m < MB; ++m) total[m] = _mm256_setzero_ps();
  for (int64_t gi = 0, k0 = 0; k0 < K; ++gi, k0 += g) {
    __m256 acc[MB_MAX][2];
    for (int m = 0; m < MB; ++m) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
    for (int64_t k = k0; k < k0 + g; k += 16) {
      for (int h = 0; h < 2; ++h) {
        const __m256 v = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
            _mm_loadl_epi64(reinterpret_cast<const __m128i*>(w + k + 8 * h))));
        for (int m = 0; m < MB; ++m)
          acc[m][h] = _mm256_fmadd_ps(v, _mm256_loadu_ps(x + m * K + k + 8 * h), acc[m][h]);
      }
    }
    const __m256 scale = _mm256_set1_ps(scale1(s[gi]));
    for (int m = 0; m < MB; ++m)
      total[m] = _mm256_fmadd_ps(_mm256_add_ps(acc[m][0], acc[m][1]), scale, total[m]);
  }
  for (int m = 0; m < MB; ++m) out[m] = hsum8(total[m]);
}

// Q8_0 with int8 activations (flags bit 5) on AVX2, as llama.cpp multiplies it there: x
// quantized per run of 32 against max |x| / 127 (as `quantize_run` on AVX-512), then
// |w| times x's bytes with w's signs (vpmaddubsw: pairs of products, < 2^15) summed to
// int32, one FMA a run with both scales. 11 vector ops a run where the exact product
// takes 17.
inline float quantize_run8(const float* x, int8_t* q) {
  __m256 v[4];
  __m256 amax = _mm256_setzero_ps();
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  for (int i = 0; i < 4; ++i) {
    v[i] = _mm256_loadu_ps(x + 8 * i);
    amax = _mm256_max_ps(amax, _mm256_and_ps(v[i], abs_mask));
  }
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  const float top = _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
  const __m256 inv = _mm256_set1_ps(top > 0.f ? 127.f / top : 0.f);
  __m256i i32[4];
  for (int i = 0; i < 4; ++i) i32[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv));
  // packs interleave 128-bit lanes; the permutation puts the 32 bytes back in order
  const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(i32[0], i32[1]),
                                           _mm256_packs_epi32(i32[2], i32[3]));
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), _mm256_permutevar8x32_epi32(bytes, order));
  return top / 127.f;
}

template <int MB, typename S>
inline void row_product_q8_int8(const int8_t* const* xq, const float* const* dx, int64_t K,
                                const int8_t* w, const S* s, float* out) {
  __m256 acc[MB_MAX];
  for (int m = 0; m < MB; ++m) acc[m] = _mm256_setzero_ps();
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t r = 0; r < K / 32; ++r) {
    const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 32 * r));
    const __m256i aw = _mm256_sign_epi8(wv, wv);
    const float dw = scale1(s[r]);
    for (int m = 0; m < MB; ++m) {
      const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq[m] + 32 * r));
      const __m256i pairs = _mm256_maddubs_epi16(aw, _mm256_sign_epi8(xv, wv));
      const __m256 dot = _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, ones));
      acc[m] = _mm256_fmadd_ps(dot, _mm256_set1_ps(dw * dx[m][r]), acc[m]);
    }
  }
  for (int m = 0; m < MB; ++m) out[m] = hsum8(acc[m]);
}
#endif

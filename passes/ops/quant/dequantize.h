// Part of quant_kernels.cpp, which includes it inside its anonymous namespace (the build
// inlines the text: passes/native.py `op_source`); dense copies of the blocks, for the products of
// many rows (a prefill).

// One weight row dequantized into fp32: the reference's values exactly (scale * q is exact
// in fp32, the min added with one rounding, as torch's mul then add).
template <bool Q4, typename S>
inline void dequantize_row(const void* wrow, const S* s, const S* mn, int64_t K, int64_t g,
                           float* out) {
  for (int64_t gi = 0, k0 = 0; k0 < K; ++gi, k0 += g) {
    const float d = scale1(s[gi]), m = Q4 ? scale1(mn[gi]) : 0.f;
#if defined(__AVX512F__)
    const __m512 scale = _mm512_set1_ps(d);
    if constexpr (Q4) {
      const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
      const __m512 table = _mm512_fmadd_ps(iota, scale, _mm512_set1_ps(m));
      for (int64_t k = k0; k < k0 + g; k += 32) {
        __m512 lo, hi;
        q4_run(static_cast<const uint8_t*>(wrow) + k / 2, table, lo, hi);
        _mm512_storeu_ps(out + k, lo);
        _mm512_storeu_ps(out + k + 16, hi);
      }
    } else {
      for (int64_t k = k0; k < k0 + g; k += 16)
        _mm512_storeu_ps(out + k, q8_16(static_cast<const int8_t*>(wrow) + k, scale));
    }
#else
    int64_t k = k0;
#if defined(__AVX2__)
    const __m256 scale = _mm256_set1_ps(d), mv = _mm256_set1_ps(m);
    if constexpr (Q4) {
      for (; k + 32 <= k0 + g; k += 32)
        for (int h = 0; h < 2; ++h) {  // bytes 8h..: values 8h.. (low), 16 + 8h.. (high)
          const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(
              reinterpret_cast<const __m128i*>(static_cast<const uint8_t*>(wrow) + k / 2 + 8 * h)));
          const __m256 lo = _mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_set1_epi32(15)));
          const __m256 hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4));
          _mm256_storeu_ps(out + k + 8 * h, _mm256_fmadd_ps(lo, scale, mv));
          _mm256_storeu_ps(out + k + 16 + 8 * h, _mm256_fmadd_ps(hi, scale, mv));
        }
    } else {
      for (; k + 8 <= k0 + g; k += 8) {
        const __m256i v = _mm256_cvtepi8_epi32(_mm_loadl_epi64(
            reinterpret_cast<const __m128i*>(static_cast<const int8_t*>(wrow) + k)));
        _mm256_storeu_ps(out + k, _mm256_mul_ps(_mm256_cvtepi32_ps(v), scale));
      }
    }
#endif
    for (; k < k0 + g; ++k) {
      if constexpr (Q4) {
        const uint8_t byte = static_cast<const uint8_t*>(wrow)[(k / 32) * 16 + (k % 16)];
        out[k] = float((k % 32) < 16 ? byte & 15 : byte >> 4) * d + m;
      } else {
        out[k] = float(static_cast<const int8_t*>(wrow)[k]) * d;
      }
    }
#endif
  }
}

// Rows [N, K] of blocks into a dense weight, the calling thread's share of the rows: a
// prefill's products (more rows than `product_team` reads blocks for) run on this copy;
// torch's own dequantization of the reference took ~10x longer. `flags` bit 0: bf16 (else
// fp32); bit 3 (with bit 0): each row [hi | lo] of 2K bf16, hi = bf16(v), lo = bf16(v - hi),
// so that one bf16 GEMM over [x | x] sums x * v with 16 of v's bits (q8's have up to 19).
template <bool Q4, typename S, bool Compact = false>
void dequantize_team(const void* w, const S* scales, const S* mins, void* out, int64_t flags,
                     int64_t N, int64_t K, int64_t g) {
  const bool bf = flags & 1, split = bf && (flags & 8);
  const bool six = !Q4 && Compact && (flags & 64);  // Q6_K's packed rows, unpacked first
  const bool five = Q4 && Compact && (flags & 64);  // Q5_K's
  const bool iq4 = !Q4 && !Compact && (flags & 256);  // IQ4's indices, looked up first
  const auto [begin, end] = share(N);
  const int64_t row_bytes =
      five ? K / 128 * Q5_CHUNK_BYTES : Q4 || iq4 ? K / 2 : six ? K / 4 * 3 : K;
  const int64_t groups = K / g;
  float* row = scratch(K + 2 * groups + K / 4);
  float *scale_buf = row + K, *min_buf = scale_buf + groups;
  int8_t* unpacked = reinterpret_cast<int8_t*>(min_buf + groups);
  for (int64_t n = begin; n < end; ++n) {
    const char* wrow = static_cast<const char*>(w) + n * row_bytes;
    if (six || iq4) {
      if (six) unpack_q6_row(reinterpret_cast<const uint8_t*>(wrow), K, unpacked);
      else unpack_iq4_row(reinterpret_cast<const uint8_t*>(wrow), K, unpacked);
      wrow = reinterpret_cast<const char*>(unpacked);
    }
    float* dst = bf ? row : static_cast<float*>(out) + n * K;
    const S* mn = Q4 ? scale_rows<Q4, Compact>(mins, groups, n, 1, min_buf) : nullptr;
    const S* s = scale_rows<Q4, Compact>(scales, groups, n, 1, scale_buf);
    if constexpr (Q4 && Compact) {
      if (five) {
        dequantize_q5_row(reinterpret_cast<const uint8_t*>(wrow), s, mn, K, g,
                          reinterpret_cast<uint8_t*>(unpacked), dst);
      } else {
        dequantize_row<Q4>(wrow, s, mn, K, g, dst);
      }
    } else {
      dequantize_row<Q4>(wrow, s, mn, K, g, dst);
    }
    if (!bf) continue;
    bf16* y = static_cast<bf16*>(out) + n * K * (split ? 2 : 1);
    for (int64_t k = 0; k < K; ++k) y[k] = to_bf16(row[k]);
    if (split)  // v - hi is exact in fp32
      for (int64_t k = 0; k < K; ++k) y[K + k] = to_bf16(row[k] - to_f32(y[k]));
  }
}

// SIMD helpers shared by the CPU kernels: bf16/fp32 row conversion, dot, axpy and a vectorised exp.
// AVX-512 paths where the compiler targets it (built with -march=native on the machine that runs it), plain loops
// otherwise.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace kvserve {

// ---------------------------------------------------------------- row conversion (fp32 / bf16 -> fp32)

inline void load_row(const float* src, float* dst, int n) {
  for (int i = 0; i < n; ++i) dst[i] = src[i];
}


inline void load_row(const at::BFloat16* src, float* dst, int n) {
#if defined(__AVX512F__)
  if (n % 16 == 0) {
    const uint16_t* bits = reinterpret_cast<const uint16_t*>(src);
    for (int i = 0; i < n; i += 16) {
      __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bits + i));
      __m512i w = _mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16);  // bf16 is the top half of an fp32
      _mm512_storeu_ps(dst + i, _mm512_castsi512_ps(w));
    }
    return;
  }
#endif
  for (int i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

// A cache row as fp32: fp32 rows are used in place, bf16 rows are converted into `buf`.
inline const float* row_as_float(const float* src, float* /*buf*/, int /*n*/) { return src; }
inline const float* row_as_float(const at::BFloat16* src, float* buf, int n) {
  load_row(src, buf, n);
  return buf;
}

inline void store_row(const float* src, float* dst, int n) { std::memcpy(dst, src, sizeof(float) * n); }

inline void store_row(const float* src, at::BFloat16* dst, int n) {
  for (int i = 0; i < n; ++i) dst[i] = at::BFloat16(src[i]);  // round to nearest even, as torch does
}

// ---------------------------------------------------------------- per-token primitives

inline float dot(const float* a, const float* b, int n) {
#if defined(__AVX512F__)
  if (n % 16 == 0) {
    __m512 acc = _mm512_setzero_ps();
    for (int i = 0; i < n; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
    return _mm512_reduce_add_ps(acc);
  }
#endif
  float s = 0.f;
  for (int i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

// acc = acc * scale_acc + p * row
inline void axpy(float* acc, float p, const float* row, int n) {
#if defined(__AVX512F__)
  if (n % 16 == 0) {
    const __m512 vp = _mm512_set1_ps(p);
    for (int i = 0; i < n; i += 16)
      _mm512_storeu_ps(acc + i, _mm512_fmadd_ps(vp, _mm512_loadu_ps(row + i), _mm512_loadu_ps(acc + i)));
    return;
  }
#endif
  for (int i = 0; i < n; ++i) acc[i] += p * row[i];
}

inline void scale_row(float* acc, float s, int n) {
  for (int i = 0; i < n; ++i) acc[i] *= s;
}

#if defined(__AVX512F__)
// exp(x) for x <= 0: 2^(x log2 e) split into an integer part (applied with scalef) and a fraction in
// [-0.5, 0.5] whose power of two comes from a degree-6 Taylor polynomial (relative error ~1e-7).
inline __m512 exp_ps(__m512 x) {
  // Below -87.3 the true result underflows: return exactly 0, so that masked (-inf) entries get no mass.
  const __mmask16 tiny = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.3f), _CMP_LT_OQ);
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.3f));
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.4426950408889634f));
  const __m512 k = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 y = _mm512_mul_ps(_mm512_sub_ps(t, k), _mm512_set1_ps(0.6931471805599453f));
  __m512 p = _mm512_set1_ps(1.0f / 720);
  p = _mm512_fmadd_ps(p, y, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, y, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, y, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, y, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, y, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, y, _mm512_set1_ps(1.0f));
  return _mm512_maskz_mov_ps(static_cast<__mmask16>(~tiny), _mm512_scalef_ps(p, k));
}
#endif

// scores[t] <- exp(scores[t] - max), t < n; returns the sum.
inline float exp_shift_sum(float* scores, float max, int n) {
  int t = 0;
  float sum = 0.f;
#if defined(__AVX512F__)
  const __m512 vmax = _mm512_set1_ps(max);
  __m512 vsum = _mm512_setzero_ps();
  for (; t + 16 <= n; t += 16) {
    __m512 e = exp_ps(_mm512_sub_ps(_mm512_loadu_ps(scores + t), vmax));
    _mm512_storeu_ps(scores + t, e);
    vsum = _mm512_add_ps(vsum, e);
  }
  sum = _mm512_reduce_add_ps(vsum);
#endif
  for (; t < n; ++t) {
    scores[t] = std::exp(scores[t] - max);
    sum += scores[t];
  }
  return sum;
}


// max over x[0..n)
inline float max_of(const float* x, int64_t n) {
  int64_t i = 0;
  float m = -std::numeric_limits<float>::infinity();
#if defined(__AVX512F__)
  __m512 vm = _mm512_set1_ps(m);
  for (; i + 16 <= n; i += 16) vm = _mm512_max_ps(vm, _mm512_loadu_ps(x + i));
  m = _mm512_reduce_max_ps(vm);
#endif
  for (; i < n; ++i) m = std::max(m, x[i]);
  return m;
}

#if defined(__AVX512F__)
// 16 fp32 values starting at p (bf16 widened exactly: bf16 is the top half of an fp32).
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const at::BFloat16* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// Store 16 floats as T, and round 16 floats to T's precision (fp32: identity; bf16: round to nearest even, as
// c10::BFloat16 does for finite values).
inline __m256i bf16_bits(__m512 v) {
  const __m512i b = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_add_epi32(b, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16));
}
inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
inline void store16(at::BFloat16* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), bf16_bits(v));
}
inline __m512 round16(float, __m512 v) { return v; }
inline __m512 round16(at::BFloat16, __m512 v) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bf16_bits(v)), 16));
}

// Natural log for x > 0 (exponent/mantissa split and the Cephes polynomial; relative error < 1e-7).
inline __m512 log_ps(__m512 x) {
  __m512 e = _mm512_getexp_ps(x);
  __m512 m = _mm512_getmant_ps(x, _MM_MANT_NORM_1_2, _MM_MANT_SIGN_src);
  const __mmask16 big = _mm512_cmp_ps_mask(m, _mm512_set1_ps(1.41421356f), _CMP_GT_OQ);
  m = _mm512_mask_mul_ps(m, big, m, _mm512_set1_ps(0.5f));
  e = _mm512_mask_add_ps(e, big, e, _mm512_set1_ps(1.0f));
  const __m512 f = _mm512_sub_ps(m, _mm512_set1_ps(1.0f));
  const __m512 z = _mm512_mul_ps(f, f);
  __m512 y = _mm512_set1_ps(7.0376836292E-2f);
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(-1.1514610310E-1f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(1.1676998740E-1f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(-1.2420140846E-1f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(1.4249322787E-1f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(-1.6668057665E-1f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(2.0000714765E-1f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(-2.4999993993E-1f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(3.3333331174E-1f));
  y = _mm512_mul_ps(_mm512_mul_ps(y, f), z);
  y = _mm512_fnmadd_ps(z, _mm512_set1_ps(0.5f), y);
  return _mm512_fmadd_ps(e, _mm512_set1_ps(0.69314718056f), _mm512_add_ps(f, y));
}

// [sum(v[0]), ..., sum(v[15])]: 16 horizontal sums in one butterfly (~46 instructions instead of 16 reductions).
inline __m512 hsum16(const __m512* v) {
  __m512 s1[8];
  for (int i = 0; i < 8; ++i)
    s1[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  // s1[i], lane L: partial sums of v[2i] (positions 0, 2) and v[2i+1] (positions 1, 3) over that lane.
  __m512 s2[4];
  for (int i = 0; i < 4; ++i)
    s2[i] = _mm512_add_ps(_mm512_shuffle_ps(s1[2 * i], s1[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                          _mm512_shuffle_ps(s1[2 * i], s1[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  // s2[i], element 4L + k: the lane-L sum of v[4i + k]. Now add the four 128-bit lanes together.
  __m512 s3[2];
  for (int i = 0; i < 2; ++i)
    s3[i] = _mm512_add_ps(_mm512_shuffle_f32x4(s2[2 * i], s2[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                          _mm512_shuffle_f32x4(s2[2 * i], s2[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(s3[0], s3[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(s3[0], s3[1], _MM_SHUFFLE(3, 1, 3, 1)));
}
#endif

}  // namespace kvserve

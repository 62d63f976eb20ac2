// Activation quantization for the int8 linear (int8_linear.cpp, kvserve/layers/quant/int8_linear.py), one pass
// per row:
//
//   rotated = (x * signs) H_64 per block of 64 features (H_64 the orthonormal Hadamard matrix, a fast
//             Walsh-Hadamard transform here), then q = round(rotated * 127 / max|rotated|) in int8.
//
// The rotation spreads a row's outlier features over their block, so per-row 8-bit quantization keeps more of the
// other features' bits; the weight is rotated the same way when it is quantized, so in exact arithmetic the
// product is unchanged.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "simd.h"

namespace {

using namespace kvserve;

constexpr int kBlock = 64;
constexpr int kVecs = kBlock / kW;

// One in-vector step of the transform: lane i gets v[i] + v[i ^ h] if bit h of i is clear, v[i ^ h] - v[i] if set.
template <int H>
inline vf butterfly(vf v) {
  alignas(64) float a[kW], b[kW];
  vstore(a, v);
  for (int i = 0; i < kW; ++i) b[i] = (i & H) ? a[i ^ H] - a[i] : a[i] + a[i ^ H];
  return vload(b);
}

#if defined(__AVX512F__)
template <int H>
inline __m512i xor_lanes() {
  return _mm512_xor_si512(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                          _mm512_set1_epi32(H));
}
template <int H>
inline __mmask16 high_lanes() {
  __mmask16 m = 0;
  for (int i = 0; i < 16; ++i)
    if (i & H) m |= static_cast<__mmask16>(1u << i);
  return m;
}
template <>
inline vf butterfly<1>(vf v) {
  const vf p = _mm512_permutexvar_ps(xor_lanes<1>(), v);
  return _mm512_mask_sub_ps(_mm512_add_ps(v, p), high_lanes<1>(), p, v);
}
template <>
inline vf butterfly<2>(vf v) {
  const vf p = _mm512_permutexvar_ps(xor_lanes<2>(), v);
  return _mm512_mask_sub_ps(_mm512_add_ps(v, p), high_lanes<2>(), p, v);
}
template <>
inline vf butterfly<4>(vf v) {
  const vf p = _mm512_permutexvar_ps(xor_lanes<4>(), v);
  return _mm512_mask_sub_ps(_mm512_add_ps(v, p), high_lanes<4>(), p, v);
}
template <>
inline vf butterfly<8>(vf v) {
  const vf p = _mm512_permutexvar_ps(xor_lanes<8>(), v);
  return _mm512_mask_sub_ps(_mm512_add_ps(v, p), high_lanes<8>(), p, v);
}
#elif defined(__AVX2__) && defined(__FMA__)  // as vec.h: AVX2 without FMA builds the generic helpers
template <int H>
inline vf butterfly_avx2(vf v) {
  const __m256i idx = _mm256_xor_si256(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(H));
  const vf p = _mm256_permutevar8x32_ps(v, idx);
  const int mask = (H == 1) ? 0xAA : (H == 2) ? 0xCC : 0xF0;
  return _mm256_blend_ps(_mm256_add_ps(v, p), _mm256_sub_ps(p, v), mask);
}
template <>
inline vf butterfly<1>(vf v) { return butterfly_avx2<1>(v); }
template <>
inline vf butterfly<2>(vf v) { return butterfly_avx2<2>(v); }
template <>
inline vf butterfly<4>(vf v) { return butterfly_avx2<4>(v); }
#endif

// In-vector steps h = 1 .. kW/2 on one vector.
template <int H>
inline vf lane_steps(vf v) {
  if constexpr (H < kW) return lane_steps<H * 2>(butterfly<H>(v));
  return v;
}

// The unnormalised Walsh-Hadamard transform of one block held in kVecs vectors (lane i of v[k]: feature k*kW+i).
inline void fwht_block(vf* v) {
  for (int k = 0; k < kVecs; ++k) v[k] = lane_steps<1>(v[k]);
  for (int h = 1; h < kVecs; h <<= 1)  // steps across vectors: features kW * h apart
    for (int k = 0; k < kVecs; k += 2 * h)
      for (int j = k; j < k + h; ++j) {
        const vf a = v[j], b = v[j + h];
        v[j] = vadd(a, b);
        v[j + h] = vsub(a, b);
      }
}

// One row into `o` [dim] fp32: (x * signs) H_64 per block of 64 features, without H_64's factor 1/8 (or x itself
// when signs is null); returns max |o|, or nan if the row holds a nan or an inf (a max alone drops nans).
template <typename T>
inline float rotate_row(const T* xr, const vf* s, float* o, int64_t dim) {
  if (s == nullptr) {
    load_row(xr, o, static_cast<int>(dim));
    float m = 0.0f, zero = 0.0f;
    for (int64_t i = 0; i < dim; ++i) {
      m = std::max(m, std::abs(o[i]));
      zero += o[i] * 0.0f;  // stays 0 unless some o[i] is nan or inf
    }
    return zero == 0.0f ? m : std::numeric_limits<float>::quiet_NaN();
  }
  vf vmx = vzero(), vzero_sum = vzero();
  for (int64_t b = 0; b < dim; b += kBlock) {
    vf v[kVecs];
    for (int k = 0; k < kVecs; ++k) v[k] = vmul(vload(xr + b + k * kW), s[k]);
    fwht_block(v);
    for (int k = 0; k < kVecs; ++k) {
      vstore(o + b + k * kW, v[k]);
      vmx = vmax(vmx, vmax(v[k], vsub(vzero(), v[k])));
      vzero_sum = vfma(v[k], vzero(), vzero_sum);
    }
  }
  return vsum(vzero_sum) == 0.0f ? vmax_all(vmx) : std::numeric_limits<float>::quiet_NaN();
}

// q[i] = round(v[i] * inv) (to nearest even; |v[i] * inv| <= 127), XOR 0x80 when `flip` (= q + 128 as a uint8).
inline void quantize_row(const float* v, float inv, int8_t* q, int64_t dim, bool flip) {
  int64_t i = 0;
#if defined(__AVX512F__)
  const __m512 vinv = _mm512_set1_ps(inv);
  const __m128i x80 = _mm_set1_epi8(flip ? static_cast<char>(0x80) : 0);
  for (; i + 16 <= dim; i += 16) {
    const __m512i r = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(v + i), vinv));  // MXCSR: nearest even
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + i), _mm_xor_si128(_mm512_cvtsepi32_epi8(r), x80));
  }
#elif defined(__AVX2__) && defined(__FMA__)
  const __m256 vinv = _mm256_set1_ps(inv);
  const __m128i x80 = _mm_set1_epi8(flip ? static_cast<char>(0x80) : 0);
  for (; i + 8 <= dim; i += 8) {
    const __m256i r = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(v + i), vinv));
    const __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(q + i), _mm_xor_si128(_mm_packs_epi16(w, w), x80));
  }
#endif
  for (; i < dim; ++i) {
    const int32_t r = static_cast<int32_t>(std::nearbyint(v[i] * inv));
    q[i] = static_cast<int8_t>(flip ? r ^ 0x80 : r);
  }
}

template <typename T>
void quantize_rows(const T* x, int64_t x_stride, const float* signs, int8_t* q, int64_t q_stride, float* q_scale,
                   int64_t rows, int64_t dim, bool flip) {
  at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
    vf s[kVecs];
    if (signs != nullptr)
      for (int k = 0; k < kVecs; ++k) s[k] = vload(signs + k * kW);
    std::vector<float> buf(dim);
    for (int64_t row = begin; row < end; ++row) {
      const float m = rotate_row(x + row * x_stride, signs != nullptr ? s : nullptr, buf.data(), dim);
      int8_t* qr = q + row * q_stride;
      if (!(m > 0.0f) || !std::isfinite(m)) {  // all zeros; or a nan/inf, which must not pass as a number
        std::fill(qr, qr + dim, static_cast<int8_t>(flip ? 0x80 : 0));
        q_scale[row] = m == 0.0f ? 0.0f : std::numeric_limits<float>::quiet_NaN();
        continue;
      }
      quantize_row(buf.data(), 127.0f / m, qr, dim, flip);
      // The transform above lacks H_64's factor 1/8; the scale takes it.
      q_scale[row] = (signs != nullptr ? m * 0.125f : m) / 127.0f;
    }
  });
}

}  // namespace

// Rows of x [T, K] (fp32 or bf16, unit column stride) into int8 codes q (row stride q_stride, the first K bytes of
// each row written) and scales: x' = x, or (x * signs) H_64 per block of 64 features (orthonormal H_64; K a multiple
// of 64) when signs [64] is given; q = round(x' * 127 / max|x'|), q_scale = max|x'| / 127, so q * q_scale ~= x'.
// An all-zero row gives zeros and scale 0; a row with inf or nan, zeros and scale nan. With `flip`, each code is
// stored XOR 0x80, i.e. as the uint8 q + 128 (the form VNNI's unsigned-by-signed dot product takes).
void quantize_rows_int8(const at::Tensor& x, const float* signs, int8_t* q, int64_t q_stride, float* q_scale,
                        bool flip) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "quantize_rows_int8: x [T, K] rows");
  TORCH_CHECK(signs == nullptr || x.size(1) % kBlock == 0, "quantize_rows_int8: K must be a multiple of 64 to rotate");
  dispatch_float(x, [&](auto tag) {
    using T = decltype(tag);
    quantize_rows<T>(x.data_ptr<T>(), x.stride(0), signs, q, q_stride, q_scale, x.size(0), x.size(1), flip);
  });
}

// The same as a torch op, for tests: x [T, K] -> (q [T, K] int8, q_scale [T] fp32).
std::tuple<at::Tensor, at::Tensor> int8_quantize_rows(at::Tensor x, c10::optional<at::Tensor> signs) {
  const bool rotate = signs.has_value() && signs->defined();
  TORCH_CHECK(!rotate || (signs->scalar_type() == at::kFloat && signs->is_contiguous() && signs->numel() == kBlock),
              "int8_quantize_rows: signs [64] fp32");
  auto q = at::empty({x.size(0), x.size(1)}, x.options().dtype(at::kChar));
  auto q_scale = at::empty({x.size(0)}, x.options().dtype(at::kFloat));
  quantize_rows_int8(x, rotate ? signs->data_ptr<float>() : nullptr, q.data_ptr<int8_t>(), x.size(1),
                     q_scale.data_ptr<float>(), /*flip=*/false);
  return {q, q_scale};
}

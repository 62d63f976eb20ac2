// Activation preparation for the int8 linear (kvserve/layers/quant/int8_linear.py), one pass per row:
//
//   rotated = (x * signs) H_64 per block of 64 features (H_64 the orthonormal Hadamard matrix, a fast
//             Walsh-Hadamard transform here), then out = rotated / max|rotated|, row_max = max|rotated|.
//
// The rotation spreads a row's outlier features over their block, so per-row 8-bit quantization keeps more of the
// other features' bits; the weight is rotated the same way when it is quantized, so in exact arithmetic the
// product is unchanged. fbgemm then quantizes `out` with the fixed range [-1, 1].

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

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

template <typename T>
void rotate_normalize_rows(const T* x, int64_t x_stride, const float* signs, float* out, float* row_max, int64_t rows,
                           int64_t dim) {
  at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
    vf s[kVecs];
    if (signs != nullptr)
      for (int k = 0; k < kVecs; ++k) s[k] = vload(signs + k * kW);
    for (int64_t row = begin; row < end; ++row) {
      const T* xr = x + row * x_stride;
      float* o = out + row * dim;
      float m = 0.0f;
      if (signs != nullptr) {
        vf vmx = vzero();
        for (int64_t b = 0; b < dim; b += kBlock) {
          vf v[kVecs];
          for (int k = 0; k < kVecs; ++k) v[k] = vmul(vload(xr + b + k * kW), s[k]);
          fwht_block(v);
          for (int k = 0; k < kVecs; ++k) {
            vstore(o + b + k * kW, v[k]);
            vmx = vmax(vmx, vmax(v[k], vsub(vzero(), v[k])));
          }
        }
        m = vmax_all(vmx);
      } else {
        load_row(xr, o, static_cast<int>(dim));
        for (int64_t i = 0; i < dim; ++i) m = std::max(m, std::abs(o[i]));
      }
      scale_row(o, m > 0.0f ? 1.0f / m : 0.0f, static_cast<int>(dim));
      // The transform above lacks H_64's factor 1/8; dividing by the row's own maximum cancels it.
      row_max[row] = signs != nullptr ? m * 0.125f : m;
    }
  });
}

}  // namespace

// x [T, K] (fp32 or bf16, unit column stride), signs [64] fp32 (+-1) or None -> (out [T, K] fp32 in [-1, 1],
// row_max [T, 1] fp32) with out * row_max = x, or with signs, per block of 64 features (x * signs) H_64
// (orthonormal; K a multiple of 64). An all-zero row gives zeros and row_max 0.
std::tuple<at::Tensor, at::Tensor> rotate_normalize(at::Tensor x, c10::optional<at::Tensor> signs) {
  const bool rotate = signs.has_value() && signs->defined();
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "rotate_normalize: x [T, K] rows");
  TORCH_CHECK(!rotate || x.size(1) % kBlock == 0, "rotate_normalize: K must be a multiple of 64 to rotate");
  TORCH_CHECK(!rotate || (signs->scalar_type() == at::kFloat && signs->is_contiguous() && signs->numel() == kBlock),
              "rotate_normalize: signs [64] fp32");
  const int64_t rows = x.size(0), dim = x.size(1);
  auto out = at::empty({rows, dim}, x.options().dtype(at::kFloat));
  auto row_max = at::empty({rows, 1}, x.options().dtype(at::kFloat));
  dispatch_float(x, [&](auto tag) {
    using T = decltype(tag);
    rotate_normalize_rows<T>(x.data_ptr<T>(), x.stride(0), rotate ? signs->data_ptr<float>() : nullptr,
                             out.data_ptr<float>(), row_max.data_ptr<float>(), rows, dim);
  });
  return {out, row_max};
}

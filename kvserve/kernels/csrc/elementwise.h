// The row bodies of elementwise.cpp's kernels, shared with decoder_layer_row.cpp, which runs them inside its own
// parallel region on parts of a row: one definition, so both give the same bits.
//
// Rounding follows the torch code they replace (HF's order of operations): every intermediate that torch would
// store in the model dtype is rounded to it here too, so bf16 results stay as close to HF as the torch path, and
// fp32 results are the same up to the order of a sum.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "simd.h"

namespace kvserve {

// Round a float to T's precision and back (identity for fp32).
template <typename T>
inline float r(float x) {
  return to_f(static_cast<T>(x));
}

// out <- rmsnorm(s) * weight over one row of dim, where s = x + res rounded to T (stored to sum_out) when res is
// given, else s = x. In place (out = x, sum_out = res) is allowed: each element is read before it is written.
template <typename T>
inline void rms_norm_row(const T* x, const T* res, T* sum_out, const T* weight, T* out, int64_t dim, float eps) {
  const bool add = res != nullptr;
  const T* src = add ? sum_out : x;  // what gets normalised
  double sum_sq = 0.0;
  int64_t i0 = 0;
  vf vsq = vzero();
  for (; i0 + kW <= dim; i0 += kW) {
    vf sv = vload(x + i0);
    if (add) {
      sv = vround(T{}, vadd(sv, vload(res + i0)));
      vstore(sum_out + i0, sv);
    }
    vsq = vfma(sv, sv, vsq);
  }
  sum_sq = vsum(vsq);
  for (int64_t i = i0; i < dim; ++i) {
    const float s = add ? r<T>(to_f(x[i]) + to_f(res[i])) : to_f(x[i]);
    if (add) sum_out[i] = static_cast<T>(s);
    sum_sq += static_cast<double>(s) * s;
  }
  const float inv = 1.0f / std::sqrt(static_cast<float>(sum_sq / dim) + eps);
  int64_t j0 = 0;
  const vf vinv = vset(inv);
  for (; j0 + kW <= dim; j0 += kW)
    vstore(out + j0, vmul(vload(weight + j0), vround(T{}, vmul(vload(src + j0), vinv))));
  for (int64_t i = j0; i < dim; ++i) out[i] = static_cast<T>(to_f(weight[i]) * r<T>(to_f(src[i]) * inv));
}

// Rotate-half RoPE of one head in place; c, s: the position's cos and sin rows [head_dim / 2].
template <typename T>
inline void rotary_head(T* x, const T* c, const T* s, int64_t head_dim) {
  const int64_t half = head_dim / 2;
  int64_t i0 = 0;
  for (; i0 + kW <= half; i0 += kW) {
    const vf x1 = vload(x + i0), x2 = vload(x + i0 + half);
    const vf ci = vload(c + i0), si = vload(s + i0);
    const vf o1 = vsub(vround(T{}, vmul(x1, ci)), vround(T{}, vmul(x2, si)));
    const vf o2 = vadd(vround(T{}, vmul(x2, ci)), vround(T{}, vmul(x1, si)));
    vstore(x + i0, o1);
    vstore(x + i0 + half, o2);
  }
  for (int64_t i = i0; i < half; ++i) {
    const float x1 = to_f(x[i]), x2 = to_f(x[i + half]);
    const float ci = to_f(c[i]), si = to_f(s[i]);
    x[i] = static_cast<T>(r<T>(x1 * ci) - r<T>(x2 * si));
    x[i + half] = static_cast<T>(r<T>(x2 * ci) + r<T>(x1 * si));
  }
}

// o[i] = silu(gate[i]) * up[i] for i < n. A span that is part of a longer row must start at a multiple of kW and,
// unless it ends the row, be a multiple of kW long: the vector and scalar exps differ in their last bits.
template <typename T>
inline void silu_and_mul_span(const T* gate, const T* up, T* o, int64_t n) {
  int64_t i0 = 0;
  const vf one = vset(1.0f);
  for (; i0 + kW <= n; i0 += kW) {
    const vf g = vload(gate + i0);
    const vf sg = vdiv(g, vadd(one, vexp(vsub(vzero(), g))));
    vstore(o + i0, vmul(vround(T{}, sg), vload(up + i0)));
  }
  for (int64_t i = i0; i < n; ++i) {
    const float g = to_f(gate[i]);
    o[i] = static_cast<T>(r<T>(g / (1.0f + std::exp(-g))) * to_f(up[i]));
  }
}

template <typename T>
inline T finite(T x) {
  const float f = to_f(x);
  if (std::isnan(f)) return static_cast<T>(0.0f);
  // The type's own largest finite value: FLT_MAX would round up to +inf in bf16.
  if (std::isinf(f)) return f > 0 ? std::numeric_limits<T>::max() : std::numeric_limits<T>::lowest();
  return x;
}

// Non-finite values have all exponent bits set.
inline bool all_finite(const float* x, int64_t n) {
  uint32_t bad = 0;
  for (int64_t i = 0; i < n; ++i) {
    uint32_t b;
    std::memcpy(&b, &x[i], 4);
    bad |= static_cast<uint32_t>((b & 0x7F800000u) == 0x7F800000u);
  }
  return bad == 0;
}
inline bool all_finite(const at::BFloat16* x, int64_t n) {
  const uint16_t* b = reinterpret_cast<const uint16_t*>(x);
  uint32_t bad = 0;
  for (int64_t i = 0; i < n; ++i) bad |= static_cast<uint32_t>((b[i] & 0x7F80u) == 0x7F80u);
  return bad == 0;
}

template <typename T>
inline void sanitise(T* x, int64_t n) {
  if (all_finite(x, n)) return;
  for (int64_t i = 0; i < n; ++i) x[i] = finite(x[i]);
}

// n values of a K or V row into the cache (standard layout, the model's dtype): NaN becomes 0 and +-inf the largest
// finite value, so the cache never holds a non-finite number.
template <typename T>
inline void write_kv_span(const T* src, T* dst, int64_t n) {
  std::memcpy(dst, src, n * sizeof(T));
  sanitise(dst, n);
}

}  // namespace kvserve

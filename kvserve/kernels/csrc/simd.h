// Row helpers shared by the CPU kernels (bf16/fp32 row conversion, dot, axpy, exp-and-sum, max), written once
// on the vector helpers of vec.h, with scalar tails for lengths that are not a multiple of the vector width.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#include "vec.h"

namespace kvserve {

inline float to_f(float x) { return x; }
inline float to_f(at::BFloat16 x) { return static_cast<float>(x); }
inline float to_f(Fp8E4M3 x) { return static_cast<float>(x); }
inline float to_f(Fp8E5M2 x) { return static_cast<float>(x); }

template <typename T>
inline constexpr bool kIsFp8 = std::is_same_v<T, Fp8E4M3> || std::is_same_v<T, Fp8E5M2>;

// ---------------------------------------------------------------- row conversion (fp32 / bf16 -> fp32)

inline void load_row(const float* src, float* dst, int n) { std::memcpy(dst, src, sizeof(float) * n); }

// bf16 and fp8 rows (exact).
template <typename T, typename = std::enable_if_t<std::is_same_v<T, at::BFloat16> || kIsFp8<T>>>
inline void load_row(const T* src, float* dst, int n) {
  int i = 0;
  for (; i + kW <= n; i += kW) vstore(dst + i, vload(src + i));
  for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

// A cache row as fp32: fp32 rows are used in place, bf16 and fp8 rows are converted into `buf`.
inline const float* row_as_float(const float* src, float* /*buf*/, int /*n*/) { return src; }
template <typename T>
inline const float* row_as_float(const T* src, float* buf, int n) {
  load_row(src, buf, n);
  return buf;
}

// x as an fp8 cache stores it: NaN -> 0, saturated to the format's largest finite value, rounded to nearest even
// by c10's conversion (the same as torch's .to(): attention/kv_dtype.py's quantize_kv is the reference).
template <typename F8>
inline F8 to_fp8(float x) {
  const float limit = static_cast<float>(std::numeric_limits<F8>::max());
  if (std::isnan(x)) x = 0.f;
  return F8(std::min(std::max(x, -limit), limit));
}

// to_fp8 on kW lanes at once, byte for byte the same: each lane's code in its low byte. After to_fp8's NaN -> 0 and
// saturation, the rounding is c10's, on the fp32 bits: a normal result drops 23 - M mantissa bits, rounding to
// nearest even, and rebiases the exponent; below F8's smallest normal, the code is the integer nearest x over the
// smallest subnormal, to which adding 2^23 rounds (the FPU's default mode is nearest even). fp32 K/V rows into an
// fp8 cache, 2,048 rows of 192: 0.57 ms a call with the scalar conversion, 0.15 ms with this (kind A, 2 threads).
template <typename F8>
inline vi vfp8_codes(vf x) {
  constexpr bool kE4M3 = std::is_same_v<F8, Fp8E4M3>;
  constexpr int M = kE4M3 ? 3 : 2, B = kE4M3 ? 7 : 15, kShift = 23 - M;
  const float limit = static_cast<float>(std::numeric_limits<F8>::max());
  const float inf = std::numeric_limits<float>::infinity(), big = std::numeric_limits<float>::max();
  const vf mag = vfrombits(viand(vbits(x), viset(0x7FFFFFFF)));
  vf c = vselect(vlt(mag, vset(inf)), vzero(), x);  // NaN and +-inf: 0 for now
  c = vselect(vgt(x, vset(big)), c, vset(limit));
  c = vselect(vlt(x, vset(-big)), c, vset(-limit));
  c = vmax(vmin(c, vset(limit)), vset(-limit));
  const vi bits = vbits(c), abits = viand(bits, viset(0x7FFFFFFF));
  const vi odd = viand(visrl<kShift>(abits), viset(1));
  const vi normal = visub(visrl<kShift>(viadd(viadd(abits, viset((1 << (kShift - 1)) - 1)), odd)),
                          viset((127 - B) << M));
  const vf a = vfrombits(abits);
  const vi sub = visub(vbits(vadd(vmul(a, vset(std::ldexp(1.f, B - 1 + M))), vset(8388608.f))), viset(0x4B000000));
  const vi code = vselect(vlt(a, vset(std::ldexp(1.f, 1 - B))), normal, sub);
  return vior(code, visrl<24>(viand(bits, viset(std::numeric_limits<int32_t>::min()))));
}

// n fp32 values as F8 codes (to_fp8's), kW at a time.
template <typename F8>
inline void store_fp8_row(const float* src, F8* dst, int64_t n) {
  int64_t i = 0;
  alignas(64) int32_t codes[kW];
  for (; i + kW <= n; i += kW) {
    vistore(codes, vfp8_codes<F8>(vload(src + i)));
    for (int j = 0; j < kW; ++j) dst[i + j] = F8(static_cast<uint8_t>(codes[j]), F8::from_bits());
  }
  for (; i < n; ++i) dst[i] = to_fp8<F8>(src[i]);
}

inline void store_row(const float* src, float* dst, int n) { std::memcpy(dst, src, sizeof(float) * n); }

inline void store_row(const float* src, at::BFloat16* dst, int n) {
  int i = 0;
  for (; i + kW <= n; i += kW) vstore(dst + i, vload(src + i));
  for (; i < n; ++i) dst[i] = at::BFloat16(src[i]);  // round to nearest even, as torch does
}

// ---------------------------------------------------------------- per-row primitives

inline float dot(const float* a, const float* b, int n) {
  vf acc = vzero();
  int i = 0;
  for (; i + kW <= n; i += kW) acc = vfma(vload(a + i), vload(b + i), acc);
  float s = vsum(acc);
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

// acc += p * row
inline void axpy(float* acc, float p, const float* row, int n) {
  const vf vp = vset(p);
  int i = 0;
  for (; i + kW <= n; i += kW) vstore(acc + i, vfma(vp, vload(row + i), vload(acc + i)));
  for (; i < n; ++i) acc[i] += p * row[i];
}

inline void scale_row(float* acc, float s, int n) {
  const vf vs = vset(s);
  int i = 0;
  for (; i + kW <= n; i += kW) vstore(acc + i, vmul(vload(acc + i), vs));
  for (; i < n; ++i) acc[i] *= s;
}

// scores[t] <- exp(scores[t] - max), t < n; returns the sum.
inline float exp_shift_sum(float* scores, float max, int n) {
  const vf vmx = vset(max);
  vf vs = vzero();
  int t = 0;
  for (; t + kW <= n; t += kW) {
    const vf e = vexp(vsub(vload(scores + t), vmx));
    vstore(scores + t, e);
    vs = vadd(vs, e);
  }
  float sum = vsum(vs);
  for (; t < n; ++t) {
    scores[t] = std::exp(scores[t] - max);
    sum += scores[t];
  }
  return sum;
}

// max over x[0..n)
inline float max_of(const float* x, int64_t n) {
  vf vm_ = vset(-std::numeric_limits<float>::infinity());
  int64_t i = 0;
  for (; i + kW <= n; i += kW) vm_ = vmax(vm_, vload(x + i));
  float m = vmax_all(vm_);
  for (; i < n; ++i) m = std::max(m, x[i]);
  return m;
}

// Calls f(C{}) with C the KV cache's element type: `same` (the model's dtype, T{} of dispatch_float) or an fp8.
template <typename T, typename F>
void dispatch_kv_cache(const at::Tensor& cache, T same, F&& f) {
  if (cache.scalar_type() == at::kFloat8_e4m3fn) {
    f(Fp8E4M3{});
  } else if (cache.scalar_type() == at::kFloat8_e5m2) {
    f(Fp8E5M2{});
  } else {
    f(same);
  }
}

inline bool is_fp8(at::ScalarType t) { return t == at::kFloat8_e4m3fn || t == at::kFloat8_e5m2; }

// Calls f(T{}) with T = float or at::BFloat16, the dtypes every kernel takes.
template <typename F>
void dispatch_float(const at::Tensor& t, F&& f) {
  if (t.scalar_type() == at::kFloat) {
    f(float{});
  } else if (t.scalar_type() == at::kBFloat16) {
    f(at::BFloat16{});
  } else {
    TORCH_CHECK(false, "unsupported dtype ", t.scalar_type());
  }
}

}  // namespace kvserve

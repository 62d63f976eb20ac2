// The vector helpers every CPU kernel is written against: one source per algorithm, one implementation of these
// helpers per ISA level. The level is fixed at compile time by the flags kvserve/kernels/cpu.py builds with
// (kvserve/platform.py): AVX-512 (16 fp32 lanes), AVX2 + FMA (8 lanes), or generic (8 lanes of GCC/Clang vector
// extensions, which the compiler lowers to whatever the target has: SSE, NEON, or scalar code).
//
//   vf: kW fp32 lanes    vi: kW int32 lanes    vm: a lane mask (from a comparison)
//
// bf16 loads widen exactly (bf16 is the top half of an fp32); bf16 stores round to nearest even, as c10::BFloat16
// does for finite values. fp8 loads (the KV cache's one-byte formats, vload(const Fp8E5M2*) / vload(const Fp8E4M3*))
// widen exactly too, through fp16 (vcvtph2ps where the level has F16C):
//   e5m2 is the top byte of an fp16, so its fp16 bits are byte << 8;
//   e4m3 (exponent bias 7) placed as s.0eeee.mmm0000000 is an fp16 (bias 15) of 2^-8 times its value, subnormals
//   included (they become fp16 subnormals, which vcvtph2ps widens exactly): one multiply by 256 restores it.
//   Its NaN encodings (0x7F, 0xFF) would read as 480; the cache never holds them (writes saturate).
#pragma once

#include <ATen/ATen.h>

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace kvserve {

using Fp8E4M3 = c10::Float8_e4m3fn;
using Fp8E5M2 = c10::Float8_e5m2;

#if defined(__AVX512F__)
// ================================================================ AVX-512
constexpr int kW = 16;
constexpr int kNumVecRegs = 32;
constexpr const char* kVecIsa = "avx512";
using vf = __m512;
using vi = __m512i;
using vm = __mmask16;

inline vf vzero() { return _mm512_setzero_ps(); }
inline vf vset(float x) { return _mm512_set1_ps(x); }
inline vf vload(const float* p) { return _mm512_loadu_ps(p); }
inline vf vload(const at::BFloat16* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline vf vload(const Fp8E5M2* p) {
  const __m256i h = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm512_cvtph_ps(_mm256_slli_epi16(h, 8));
}
inline vf vload(const Fp8E4M3* p) {
  const __m256i h = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  // byte << 8, then an arithmetic shift right by 1 moves exponent and mantissa down one bit and copies the sign
  // into bit 14, which the mask clears.
  const __m256i f16 = _mm256_and_si256(_mm256_srai_epi16(_mm256_slli_epi16(h, 8), 1), _mm256_set1_epi16(static_cast<short>(0xBFFF)));
  return _mm512_mul_ps(_mm512_cvtph_ps(f16), _mm512_set1_ps(256.0f));
}
inline void vstore(float* p, vf v) { _mm512_storeu_ps(p, v); }
inline vi vbits(vf v) { return _mm512_castps_si512(v); }
inline vf vfrombits(vi v) { return _mm512_castsi512_ps(v); }
inline vf vadd(vf a, vf b) { return _mm512_add_ps(a, b); }
inline vf vsub(vf a, vf b) { return _mm512_sub_ps(a, b); }
inline vf vmul(vf a, vf b) { return _mm512_mul_ps(a, b); }
inline vf vdiv(vf a, vf b) { return _mm512_div_ps(a, b); }
inline vf vmax(vf a, vf b) { return _mm512_max_ps(a, b); }
inline vf vmin(vf a, vf b) { return _mm512_min_ps(a, b); }
inline vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }  // a * b + c
inline vf vround_int(vf v) { return _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
// 2^k for integral k in [-126, 127].
inline vf vexp2_int(vf k) { return _mm512_scalef_ps(_mm512_set1_ps(1.0f), k); }
inline float vsum(vf v) { return _mm512_reduce_add_ps(v); }
inline float vmax_all(vf v) { return _mm512_reduce_max_ps(v); }
inline vm vgt(vf a, vf b) { return _mm512_cmp_ps_mask(a, b, _CMP_GT_OQ); }
inline vm vlt(vf a, vf b) { return _mm512_cmp_ps_mask(a, b, _CMP_LT_OQ); }
inline bool vany(vm m) { return m != 0; }
inline vf vselect(vm m, vf if_false, vf if_true) { return _mm512_mask_mov_ps(if_false, m, if_true); }
inline vi vselect(vm m, vi if_false, vi if_true) { return _mm512_mask_mov_epi32(if_false, m, if_true); }

inline vi viset(int32_t x) { return _mm512_set1_epi32(x); }
inline vi viota() { return _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15); }
inline vi viadd(vi a, vi b) { return _mm512_add_epi32(a, b); }
inline vi visub(vi a, vi b) { return _mm512_sub_epi32(a, b); }
inline vi vimul(vi a, vi b) { return _mm512_mullo_epi32(a, b); }
inline vi vixor(vi a, vi b) { return _mm512_xor_si512(a, b); }
inline vi viand(vi a, vi b) { return _mm512_and_si512(a, b); }
inline vi vior(vi a, vi b) { return _mm512_or_si512(a, b); }
template <int S>
inline vi visrl(vi a) { return _mm512_srli_epi32(a, S); }
template <int S>
inline vi visll(vi a) { return _mm512_slli_epi32(a, S); }
inline vf vitof(vi a) { return _mm512_cvtepi32_ps(a); }
inline void vistore(int32_t* p, vi v) { _mm512_storeu_si512(p, v); }

// bf16 bits of each lane (round to nearest even), packed into 16 uint16.
inline void vstore_bf16_bits(uint16_t* p, vi rounded_hi) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(rounded_hi));
}

// [sum(v[0]), ..., sum(v[15])]: 16 horizontal sums in one butterfly (~46 instructions instead of 16 reductions).
inline vf vhsum(const vf* v) {
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

#elif defined(__AVX2__) && defined(__FMA__)
// ================================================================ AVX2 + FMA
constexpr int kW = 8;
constexpr int kNumVecRegs = 16;
constexpr const char* kVecIsa = "avx2";
using vf = __m256;
using vi = __m256i;
using vm = __m256;  // all-ones / all-zero lanes

inline vf vzero() { return _mm256_setzero_ps(); }
inline vf vset(float x) { return _mm256_set1_ps(x); }
inline vf vload(const float* p) { return _mm256_loadu_ps(p); }
inline vf vload(const at::BFloat16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline vf vload(const Fp8E5M2* p) {
  const __m128i h = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  return _mm256_cvtph_ps(_mm_slli_epi16(h, 8));
}
inline vf vload(const Fp8E4M3* p) {
  const __m128i h = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m128i f16 = _mm_and_si128(_mm_srai_epi16(_mm_slli_epi16(h, 8), 1), _mm_set1_epi16(static_cast<short>(0xBFFF)));
  return _mm256_mul_ps(_mm256_cvtph_ps(f16), _mm256_set1_ps(256.0f));
}
inline void vstore(float* p, vf v) { _mm256_storeu_ps(p, v); }
inline vi vbits(vf v) { return _mm256_castps_si256(v); }
inline vf vfrombits(vi v) { return _mm256_castsi256_ps(v); }
inline vf vadd(vf a, vf b) { return _mm256_add_ps(a, b); }
inline vf vsub(vf a, vf b) { return _mm256_sub_ps(a, b); }
inline vf vmul(vf a, vf b) { return _mm256_mul_ps(a, b); }
inline vf vdiv(vf a, vf b) { return _mm256_div_ps(a, b); }
inline vf vmax(vf a, vf b) { return _mm256_max_ps(a, b); }
inline vf vmin(vf a, vf b) { return _mm256_min_ps(a, b); }
inline vf vfma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
inline vf vround_int(vf v) { return _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline vf vexp2_int(vf k) {
  const __m256i e = _mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127));
  return _mm256_castsi256_ps(_mm256_slli_epi32(e, 23));
}
inline float vsum(vf v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
inline float vmax_all(vf v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
inline vm vgt(vf a, vf b) { return _mm256_cmp_ps(a, b, _CMP_GT_OQ); }
inline vm vlt(vf a, vf b) { return _mm256_cmp_ps(a, b, _CMP_LT_OQ); }
inline bool vany(vm m) { return _mm256_movemask_ps(m) != 0; }
inline vf vselect(vm m, vf if_false, vf if_true) { return _mm256_blendv_ps(if_false, if_true, m); }
inline vi vselect(vm m, vi if_false, vi if_true) {
  return _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(if_false), _mm256_castsi256_ps(if_true), m));
}

inline vi viset(int32_t x) { return _mm256_set1_epi32(x); }
inline vi viota() { return _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7); }
inline vi viadd(vi a, vi b) { return _mm256_add_epi32(a, b); }
inline vi visub(vi a, vi b) { return _mm256_sub_epi32(a, b); }
inline vi vimul(vi a, vi b) { return _mm256_mullo_epi32(a, b); }
inline vi vixor(vi a, vi b) { return _mm256_xor_si256(a, b); }
inline vi viand(vi a, vi b) { return _mm256_and_si256(a, b); }
inline vi vior(vi a, vi b) { return _mm256_or_si256(a, b); }
template <int S>
inline vi visrl(vi a) { return _mm256_srli_epi32(a, S); }
template <int S>
inline vi visll(vi a) { return _mm256_slli_epi32(a, S); }
inline vf vitof(vi a) { return _mm256_cvtepi32_ps(a); }
inline void vistore(int32_t* p, vi v) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), v); }

inline void vstore_bf16_bits(uint16_t* p, vi rounded_hi) {
  // packus works within 128-bit lanes: [h0..h3 h0..h3 | h4..h7 h4..h7]; gather quadwords 0 and 2.
  const __m256i packed = _mm256_packus_epi32(rounded_hi, rounded_hi);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(_mm256_permute4x64_epi64(packed, 0x08)));
}

// [sum(v[0]), ..., sum(v[7])].
inline vf vhsum(const vf* v) {
  const __m256 s01 = _mm256_hadd_ps(v[0], v[1]), s23 = _mm256_hadd_ps(v[2], v[3]);
  const __m256 s45 = _mm256_hadd_ps(v[4], v[5]), s67 = _mm256_hadd_ps(v[6], v[7]);
  // Per 128-bit lane: the sums of v0..v3 (resp. v4..v7) over that lane's half of each vector.
  const __m256 s0123 = _mm256_hadd_ps(s01, s23), s4567 = _mm256_hadd_ps(s45, s67);
  return _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20), _mm256_permute2f128_ps(s0123, s4567, 0x31));
}

#else
// ================================================================ generic (compiler vector extensions)
constexpr int kW = 8;
constexpr int kNumVecRegs = 16;
constexpr const char* kVecIsa = "generic";
typedef float vf __attribute__((vector_size(32), aligned(4)));
typedef int32_t vi __attribute__((vector_size(32), aligned(4)));
using vm = vi;  // -1 / 0 lanes

inline vf vzero() { return vf{}; }
inline vf vset(float x) { return vf{} + x; }
inline vf vload(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline vf vload(const at::BFloat16* p) {
  uint16_t h[kW];
  std::memcpy(h, p, sizeof(h));
  vi w;
  for (int i = 0; i < kW; ++i) w[i] = static_cast<int32_t>(static_cast<uint32_t>(h[i]) << 16);
  return reinterpret_cast<vf&>(w);
}
// fp8: c10's exact scalar widening per lane (this level is for portability, not speed).
template <typename F8>
inline vf vload_fp8(const F8* p) {
  vf v;
  for (int i = 0; i < kW; ++i) v[i] = static_cast<float>(p[i]);
  return v;
}
inline vf vload(const Fp8E5M2* p) { return vload_fp8(p); }
inline vf vload(const Fp8E4M3* p) { return vload_fp8(p); }
inline void vstore(float* p, vf v) { std::memcpy(p, &v, sizeof(v)); }
inline vi vbits(vf v) { return reinterpret_cast<vi&>(v); }
inline vf vfrombits(vi v) { return reinterpret_cast<vf&>(v); }
inline vf vadd(vf a, vf b) { return a + b; }
inline vf vsub(vf a, vf b) { return a - b; }
inline vf vmul(vf a, vf b) { return a * b; }
inline vf vdiv(vf a, vf b) { return a / b; }
inline vf vmax(vf a, vf b) { return a > b ? a : b; }
inline vf vmin(vf a, vf b) { return a < b ? a : b; }
inline vf vfma(vf a, vf b, vf c) { return a * b + c; }
inline vf vround_int(vf v) {
  // Half away from zero (exp only needs a fraction within [-0.5, 0.5]).
  const vf half = v >= 0 ? vset(0.5f) : vset(-0.5f);
  return __builtin_convertvector(__builtin_convertvector(v + half, vi), vf);
}
inline vf vexp2_int(vf k) {
  const vi e = (__builtin_convertvector(k, vi) + 127) << 23;
  return reinterpret_cast<const vf&>(e);
}
inline float vsum(vf v) {
  float s = 0.f;
  for (int i = 0; i < kW; ++i) s += v[i];
  return s;
}
inline float vmax_all(vf v) {
  float m = v[0];
  for (int i = 1; i < kW; ++i) m = v[i] > m ? v[i] : m;
  return m;
}
inline vm vgt(vf a, vf b) { return a > b; }
inline vm vlt(vf a, vf b) { return a < b; }
inline bool vany(vm m) {
  for (int i = 0; i < kW; ++i)
    if (m[i]) return true;
  return false;
}
inline vf vselect(vm m, vf if_false, vf if_true) { return vfrombits((vbits(if_true) & m) | (vbits(if_false) & ~m)); }
inline vi vselect(vm m, vi if_false, vi if_true) { return (if_true & m) | (if_false & ~m); }

inline vi viset(int32_t x) { return vi{} + x; }
inline vi viota() { return vi{0, 1, 2, 3, 4, 5, 6, 7}; }
inline vi viadd(vi a, vi b) { return a + b; }
inline vi visub(vi a, vi b) { return a - b; }
inline vi vimul(vi a, vi b) {  // wrapping, as mullo does
  typedef uint32_t vu __attribute__((vector_size(32)));
  return reinterpret_cast<vi>(reinterpret_cast<vu>(a) * reinterpret_cast<vu>(b));
}
inline vi vixor(vi a, vi b) { return a ^ b; }
inline vi viand(vi a, vi b) { return a & b; }
inline vi vior(vi a, vi b) { return a | b; }
template <int S>
inline vi visrl(vi a) {
  typedef uint32_t vu __attribute__((vector_size(32)));
  return reinterpret_cast<vi>(reinterpret_cast<vu>(a) >> S);
}
template <int S>
inline vi visll(vi a) {
  typedef uint32_t vu __attribute__((vector_size(32)));
  return reinterpret_cast<vi>(reinterpret_cast<vu>(a) << S);
}
inline vf vitof(vi a) { return __builtin_convertvector(a, vf); }
inline void vistore(int32_t* p, vi v) { std::memcpy(p, &v, sizeof(v)); }

inline void vstore_bf16_bits(uint16_t* p, vi rounded_hi) {
  for (int i = 0; i < kW; ++i) p[i] = static_cast<uint16_t>(rounded_hi[i]);
}

inline vf vhsum(const vf* v) {
  vf out;
  for (int i = 0; i < kW; ++i) out[i] = vsum(v[i]);
  return out;
}
#endif

// ================================================================ the same on every level

// bf16 rounding of each lane (nearest even), as the high 16 bits' value in each int32 lane.
inline vi vbf16_rounded_hi(vf v) {
  const vi b = vbits(v);
  const vi lsb = viand(visrl<16>(b), viset(1));
  return visrl<16>(viadd(b, viadd(lsb, viset(0x7FFF))));
}
inline void vstore(at::BFloat16* p, vf v) { vstore_bf16_bits(reinterpret_cast<uint16_t*>(p), vbf16_rounded_hi(v)); }
// The first `count` lanes of v (all of them when count >= kW): the last columns of a row.
template <typename TO>
inline void vstore_n(TO* p, vf v, int64_t count) {
  if (count >= kW) return vstore(p, v);
  alignas(64) float tmp[kW];
  vstore(tmp, v);
  for (int64_t i = 0; i < count; ++i) p[i] = static_cast<TO>(tmp[i]);
}

// Round each lane to T's precision (fp32: identity; bf16: nearest even).
inline vf vround(float, vf v) { return v; }
inline vf vround(at::BFloat16, vf v) { return vfrombits(visll<16>(vbf16_rounded_hi(v))); }

// exp(x): 2^(x log2 e) split into an integer power (exact) and a fraction in [-0.5, 0.5] whose power of two is a
// degree-6 Taylor polynomial (relative error ~1e-7). Below -87.3 it returns exactly 0, so that masked (-inf)
// entries get no mass; above 88.72 (where fp32 overflows) +inf.
inline vf vexp(vf x) {
  const vm tiny = vlt(x, vset(-87.3f));
  const vm huge = vgt(x, vset(88.72f));
  x = vmin(vmax(x, vset(-87.3f)), vset(88.3f));
  const vf t = vmul(x, vset(1.4426950408889634f));
  const vf k = vround_int(t);
  const vf y = vmul(vsub(t, k), vset(0.6931471805599453f));
  vf p = vset(1.0f / 720);
  p = vfma(p, y, vset(1.0f / 120));
  p = vfma(p, y, vset(1.0f / 24));
  p = vfma(p, y, vset(1.0f / 6));
  p = vfma(p, y, vset(0.5f));
  p = vfma(p, y, vset(1.0f));
  p = vfma(p, y, vset(1.0f));
  const vf r = vmul(p, vexp2_int(k));
  return vselect(huge, vselect(tiny, r, vzero()), vset(INFINITY));
}

// Natural log for normal x > 0: exponent/mantissa split and the Cephes polynomial (relative error < 1e-7).
inline vf vlog(vf x) {
  const vi b = vbits(x);
  vf e = vitof(visub(viand(visrl<23>(b), viset(0xFF)), viset(127)));
  vf m = vfrombits(vior(viand(b, viset(0x007FFFFF)), viset(0x3F800000)));  // in [1, 2)
  const vm big = vgt(m, vset(1.41421356f));
  m = vselect(big, m, vmul(m, vset(0.5f)));
  e = vselect(big, e, vadd(e, vset(1.0f)));
  const vf f = vsub(m, vset(1.0f));
  const vf z = vmul(f, f);
  vf y = vset(7.0376836292E-2f);
  y = vfma(y, f, vset(-1.1514610310E-1f));
  y = vfma(y, f, vset(1.1676998740E-1f));
  y = vfma(y, f, vset(-1.2420140846E-1f));
  y = vfma(y, f, vset(1.4249322787E-1f));
  y = vfma(y, f, vset(-1.6668057665E-1f));
  y = vfma(y, f, vset(2.0000714765E-1f));
  y = vfma(y, f, vset(-2.4999993993E-1f));
  y = vfma(y, f, vset(3.3333331174E-1f));
  y = vmul(vmul(y, f), z);
  y = vsub(y, vmul(z, vset(0.5f)));
  return vfma(e, vset(0.69314718056f), vadd(f, y));
}

}  // namespace kvserve

// 4-bit block linear layers on the CPU (kvserve/layers/quant/int4_linear.py): weights as GGUF Q4_0 / Q4_1 hold
// them, in blocks of 32 input features with an fp16 scale d and offset m per (output channel, block):
//
//   w[n, k] = d[n, b] * c[n, k] + m[n, b]      c in 0..15, b = k / 32   (Q4_0: c = q + 8, m = -8 d)
//
// Activations are quantized per row and per block of 32 (as llama.cpp's Q8_1): q = round(x * 127 / amax) in int8,
// dx = amax / 127, mx = dx * sum(q). Then, exactly in integers per block and in fp32 across blocks:
//
//   y[r, n] = sum_b ( dot_b(c[n], q[r]) * (d[n, b] * dx[r, b]) + m[n, b] * mx[r, b] )   (+ bias[n])
//
// with each block's term added by two fmas in block order, so that a row's output depends only on that row.
//
// Weight layout (pack_int4_weight in int4_linear.py; one layout for every ISA level): output channels in panels of
// 16; per (panel p, block b) one record of 320 bytes, records in (p, b) order:
//   bytes [0, 256): 4 steps of 8 features; step j is 64 bytes, byte 4 c + i (channel c of the panel, i in 0..3)
//                   holding c[n, 32 b + 8 j + i] in its low nibble and c[n, 32 b + 8 j + 4 + i] in its high nibble;
//   bytes [256, 288): d of the panel's 16 channels, fp16;  [288, 320): m, fp16.
// One 64-byte load and two masks give two vectors of 16 channels x 4 consecutive features, which is what the
// 4-way byte dot products multiply by 4 broadcast activations:
// - AVX512-VNNI: vpdpbusd (codes unsigned, activations signed) into int32;
// - AVX-512BW / AVX2: vpmaddubsw gives pair sums of at most 2 * 15 * 127 = 3810, so a block's 8 steps add up in
//   int16 (<= 30480) and widen once per block (vpmaddwd by 1);
// - generic: plain integer loops.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "panel_loops.h"
#include "vec.h"

namespace {

using namespace kvserve;

constexpr int kNP = 16;                     // output channels per panel
constexpr int kQB = 32;                     // features per block
constexpr int kStepBytes = 64;              // one step: 16 channels x 8 features
constexpr int kCodeBytes = 4 * kStepBytes;  // a block's codes
constexpr int kRecord = kCodeBytes + 2 * kNP * 2;  // codes, d, m (fp16)
constexpr int kFV = kNP / kW;               // fp32 vectors per panel

inline int32_t load_quad(const int8_t* x) {
  int32_t v;
  std::memcpy(&v, x, sizeof(v));
  return v;
}

// fp16 -> fp32 for kW lanes (exact).
inline vf vload_half(const uint16_t* p) {
#if defined(__AVX512F__)
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
#elif defined(__AVX2__) && defined(__F16C__)
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
  alignas(64) float f[kW];
  for (int i = 0; i < kW; ++i) f[i] = static_cast<float>(c10::Half(p[i], c10::Half::from_bits()));
  return vload(f);
#endif
}

// ---------------------------------------------------------------- one block's integer dot product, per ISA
// W: one step's codes (lo: features 8j..8j+3, hi: 8j+4..8j+7, per channel); IAcc: a block's sums for the panel's
// 16 channels; step(acc, w, x): acc += the step's products with the 8 activations at x; widen: IAcc -> kFV int32
// vectors.
#if defined(__AVX512VNNI__)
constexpr int kMR = 8;
struct W {
  __m512i lo, hi;
};
using IAcc = __m512i;
inline W load_w(const uint8_t* p) {
  const __m512i v = _mm512_loadu_si512(p), mask = _mm512_set1_epi8(0x0F);
  return {_mm512_and_si512(v, mask), _mm512_and_si512(_mm512_srli_epi16(v, 4), mask)};
}
inline IAcc izero() { return _mm512_setzero_si512(); }
inline IAcc step(IAcc a, const W& w, const int8_t* x) {
  a = _mm512_dpbusd_epi32(a, w.lo, _mm512_set1_epi32(load_quad(x)));
  return _mm512_dpbusd_epi32(a, w.hi, _mm512_set1_epi32(load_quad(x + 4)));
}
inline void widen(IAcc a, vi* out) { out[0] = a; }
#elif defined(__AVX512BW__)
constexpr int kMR = 8;
struct W {
  __m512i lo, hi;
};
using IAcc = __m512i;  // int16 pair sums
inline W load_w(const uint8_t* p) {
  const __m512i v = _mm512_loadu_si512(p), mask = _mm512_set1_epi8(0x0F);
  return {_mm512_and_si512(v, mask), _mm512_and_si512(_mm512_srli_epi16(v, 4), mask)};
}
inline IAcc izero() { return _mm512_setzero_si512(); }
inline IAcc step(IAcc a, const W& w, const int8_t* x) {
  a = _mm512_add_epi16(a, _mm512_maddubs_epi16(w.lo, _mm512_set1_epi32(load_quad(x))));
  return _mm512_add_epi16(a, _mm512_maddubs_epi16(w.hi, _mm512_set1_epi32(load_quad(x + 4))));
}
inline void widen(IAcc a, vi* out) { out[0] = _mm512_madd_epi16(a, _mm512_set1_epi16(1)); }
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int kMR = 2;
struct W {
  __m256i lo[2], hi[2];  // channels 0..7, 8..15
};
struct IAcc {
  __m256i h[2];  // int16 pair sums
};
inline W load_w(const uint8_t* p) {
  const __m256i mask = _mm256_set1_epi8(0x0F);
  W w;
  for (int i = 0; i < 2; ++i) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32 * i));
    w.lo[i] = _mm256_and_si256(v, mask);
    w.hi[i] = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask);
  }
  return w;
}
inline IAcc izero() { return {{_mm256_setzero_si256(), _mm256_setzero_si256()}}; }
inline IAcc step(IAcc a, const W& w, const int8_t* x) {
  const __m256i xl = _mm256_set1_epi32(load_quad(x)), xh = _mm256_set1_epi32(load_quad(x + 4));
  // The barriers keep each step's sums in their registers: without them GCC reassociates a tile's int16 sums,
  // computes every vpmaddubsw of a block first and spills them all to the stack. The two channel halves alternate
  // so that consecutive adds do not wait on each other.
  for (int i = 0; i < 2; ++i) a.h[i] = _mm256_add_epi16(a.h[i], _mm256_maddubs_epi16(w.lo[i], xl));
  __asm__("" : "+x"(a.h[0]), "+x"(a.h[1]));
  for (int i = 0; i < 2; ++i) a.h[i] = _mm256_add_epi16(a.h[i], _mm256_maddubs_epi16(w.hi[i], xh));
  __asm__("" : "+x"(a.h[0]), "+x"(a.h[1]));
  return a;
}
inline void widen(IAcc a, vi* out) {
  for (int i = 0; i < 2; ++i) out[i] = _mm256_madd_epi16(a.h[i], _mm256_set1_epi16(1));
}
// Batched rows on AVX2: a panel's codes are unpacked once per row block into a buffer of W records (kUnpacked
// bytes per step, the same vectors load_w makes; after a block's 4 steps its d and m, converted to fp32), so the
// tiles' inner loop is loads, vpmaddubsw and vpaddw only: the mask-and-shift unpacking (6 of the ~28 vector
// operations of a step for 2 rows) leaves the loop, and without the packed vectors' registers a tile takes kMRU rows
// instead of kMR (tile_unpacked).
#define KVSERVE_INT4_UNPACKED 1
constexpr int kMRU = 4;
constexpr int kUnpacked = 4 * 32;                            // one step's W
constexpr int kUnpackedBlock = 4 * kUnpacked + 2 * kNP * 4;  // a block: 4 steps, then d and m in fp32
inline void store_w(const W& w, uint8_t* p) {
  for (int i = 0; i < 2; ++i) {
    _mm256_store_si256(reinterpret_cast<__m256i*>(p + 64 * i), w.lo[i]);
    _mm256_store_si256(reinterpret_cast<__m256i*>(p + 64 * i + 32), w.hi[i]);
  }
}
#else
constexpr int kMR = 4;
struct W {
  const uint8_t* p;
};
struct IAcc {
  int32_t c[kNP];
};
inline W load_w(const uint8_t* p) { return {p}; }
inline IAcc izero() { return {}; }
inline IAcc step(IAcc a, const W& w, const int8_t* x) {
  for (int c = 0; c < kNP; ++c) {
    int32_t s = 0;
    for (int i = 0; i < 4; ++i) {
      const uint8_t b = w.p[4 * c + i];
      s += (b & 0x0F) * x[i] + (b >> 4) * x[4 + i];
    }
    a.c[c] += s;
  }
  return a;
}
inline void widen(IAcc a, vi* out) {
  for (int v = 0; v < kFV; ++v) std::memcpy(&out[v], a.c + v * kW, sizeof(vi));
}
#endif

static_assert(kFV * kW == kNP, "a panel is a whole number of vectors");

// Activations of the rows: q [M, K] int8, dx / mx [M, K / 32] fp32.
struct Rows {
  const int8_t* q;
  const float* dx;
  const float* mx;
  int64_t kb;  // blocks per row
};

// Where a tile reads a step's codes: the packed records (every level), or on AVX2 a panel unpacked beforehand.
struct PackedCodes {
  const uint8_t* wp;
  int64_t kb;
  W operator()(int64_t p, int64_t b, int j) const { return load_w(wp + (p * kb + b) * kRecord + j * kStepBytes); }
};

// One row's outputs of the panel whose first column is c0: its 16 sums (+ bias) into yr's columns below n.
template <typename TO>
inline void store_panel_row(const vf* sums, const float* bias, TO* yr, int64_t c0, int64_t n) {
  for (int v = 0; v < kFV; ++v) {
    const int64_t c = c0 + v * kW;
    if (c >= n) break;
    vf out = sums[v];
    if (bias != nullptr) out = vadd(out, vload(bias + c));
    vstore_n(yr + c, out, n - c);
  }
}

// R rows x G panels, all blocks: facc[r][g] accumulates the panel's 16 outputs for row r across blocks.
template <int R, int G, typename TO, typename Codes = PackedCodes>
inline void tile(const Rows& x, int64_t r0, const uint8_t* wp, int64_t p0, const float* bias, TO* y, int64_t ldy,
                 int64_t n, const Codes& codes) {
  vf facc[R][G][kFV];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 16
    for (int g = 0; g < G; ++g)
#pragma GCC unroll 4
      for (int v = 0; v < kFV; ++v) facc[r][g][v] = vzero();
  const int64_t kb = x.kb;
  for (int64_t b = 0; b < kb; ++b) {
    IAcc iacc[R][G];
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 16
      for (int g = 0; g < G; ++g) iacc[r][g] = izero();
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
#pragma GCC unroll 16
      for (int g = 0; g < G; ++g) {
        const W w = codes(p0 + g, b, j);
#pragma GCC unroll 16
        for (int r = 0; r < R; ++r) iacc[r][g] = step(iacc[r][g], w, x.q + (r0 + r) * kb * kQB + b * kQB + 8 * j);
      }
    }
#pragma GCC unroll 16
    for (int g = 0; g < G; ++g) {
      const uint8_t* rec = wp + ((p0 + g) * kb + b) * kRecord;
      const uint16_t* d = reinterpret_cast<const uint16_t*>(rec + kCodeBytes);
      const uint16_t* m = d + kNP;
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) {
        const vf dx = vset(x.dx[(r0 + r) * kb + b]), mx = vset(x.mx[(r0 + r) * kb + b]);
        vi s[kFV];
        widen(iacc[r][g], s);
#pragma GCC unroll 4
        for (int v = 0; v < kFV; ++v) {
          const vf t = vfma(vitof(s[v]), vmul(vload_half(d + v * kW), dx), facc[r][g][v]);
          facc[r][g][v] = vfma(vload_half(m + v * kW), mx, t);
        }
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int g = 0; g < G; ++g) store_panel_row(facc[r][g], bias, y + (r0 + r) * ldy, (p0 + g) * kNP, n);
}

#if defined(KVSERVE_INT4_UNPACKED)
// R rows x one panel from an unpacked panel (AVX2), the same arithmetic as tile<R, 1>. The 8 int16 sums and a
// step's 4 code vectors take 12 of the 16 registers, so the fp32 sums live in memory (touched once per block), and
// the code vectors are pinned: left to GCC, tile<4, 1> kept the fp32 sums in registers and reloaded the codes for
// every row (16 more loads a step; this tile is ~1.15x faster on Zen 3).
template <int R, typename TO>
inline void tile_unpacked(const Rows& x, int64_t r0, const uint8_t* u, int64_t p0, const float* bias, TO* y,
                          int64_t ldy, int64_t n) {
  alignas(32) float acc[R][kNP] = {};
  const int64_t kb = x.kb;
  const int8_t* q = x.q + r0 * kb * kQB;
  const float* dxs = x.dx + r0 * kb;
  const float* mxs = x.mx + r0 * kb;
  for (int64_t b = 0; b < kb; ++b) {
    const uint8_t* blk = u + b * kUnpackedBlock;
    IAcc iacc[R];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) iacc[r] = izero();
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      const __m256i* wv = reinterpret_cast<const __m256i*>(blk + j * kUnpacked);
      __m256i w0 = _mm256_load_si256(wv), w1 = _mm256_load_si256(wv + 1), w2 = _mm256_load_si256(wv + 2),
              w3 = _mm256_load_si256(wv + 3);
      // Pins the step's code vectors in registers for all rows (GCC otherwise spills and reloads them per row).
      __asm__("" : "+x"(w0), "+x"(w1), "+x"(w2), "+x"(w3));
      const W w{{w0, w2}, {w1, w3}};  // the order store_w wrote
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) iacc[r] = step(iacc[r], w, q + r * kb * kQB + b * kQB + 8 * j);
      __asm__("" : "+x"(w0), "+x"(w1), "+x"(w2), "+x"(w3));
    }
    const float* d = reinterpret_cast<const float*>(blk + 4 * kUnpacked);
    const float* m = d + kNP;
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const vf dx = vset(dxs[r * kb + b]), mx = vset(mxs[r * kb + b]);
      vi s[kFV];
      widen(iacc[r], s);
#pragma GCC unroll 4
      for (int v = 0; v < kFV; ++v) {
        const vf t = vfma(vitof(s[v]), vmul(vload(d + v * kW), dx), vload(acc[r] + v * kW));
        vstore(acc[r] + v * kW, vfma(vload(m + v * kW), mx, t));
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    vf sums[kFV];
    for (int v = 0; v < kFV; ++v) sums[v] = vload(acc[r] + v * kW);
    store_panel_row(sums, bias, y + (r0 + r) * ldy, p0 * kNP, n);
  }
}

template <int MR, typename TO>
inline void tail_unpacked(int rows, const Rows& x, int64_t r0, const uint8_t* u, int64_t p, const float* bias, TO* y,
                          int64_t ldy, int64_t n) {
  if constexpr (MR > 0) {
    if (rows == MR) return tile_unpacked<MR, TO>(x, r0, u, p, bias, y, ldy, n);
    tail_unpacked<MR - 1, TO>(rows, x, r0, u, p, bias, y, ldy, n);
  }
}
#endif

template <int R, typename TO, typename Codes, int MR = R>
inline void tail_rows(int rows, const Rows& x, int64_t r0, const uint8_t* wp, int64_t p, const float* bias, TO* y,
                      int64_t ldy, int64_t n, const Codes& codes) {
  if constexpr (MR > 0) {
    if (rows == MR) return tile<MR, 1, TO>(x, r0, wp, p, bias, y, ldy, n, codes);
    tail_rows<R, TO, Codes, MR - 1>(rows, x, r0, wp, p, bias, y, ldy, n, codes);
  }
}

constexpr int kGP = 4;  // panels a batch-1 tile covers

// One row against panels [p_begin, p_end) (a thread's part of a batch-1 GEMV).
template <typename TO>
void gemv_panels(const Rows& x, const uint8_t* wp, const float* bias, TO* y, int64_t N, int64_t p_begin,
                 int64_t p_end) {
  for_each_panel_group_in<kGP>(p_begin, p_end, N, kNP, [&](int64_t p, bool whole, int) {
    if (whole)
      tile<1, kGP, TO>(x, 0, wp, p, bias, y, N, N, PackedCodes{wp, x.kb});
    else
      tile<1, 1, TO>(x, 0, wp, p, bias, y, N, N, PackedCodes{wp, x.kb});
  });
}

template <typename TO>
void gemm_int4(const Rows& x, const uint8_t* wp, const float* bias, TO* y, int64_t M, int64_t N) {
  const int64_t num_panels = cdiv(N, kNP);
  if (M == 1) {
    at::parallel_for(0, num_panels, kGP, [&](int64_t a, int64_t e) { gemv_panels<TO>(x, wp, bias, y, N, a, e); });
    return;
  }
#if defined(KVSERVE_INT4_UNPACKED)
  const int64_t mc = row_block_rows(M, x.kb * kQB, kMRU);
  const PackedCodes packed{wp, x.kb};
  for_each_gemm_block(M, N, kNP, 1, 1, mc, [&](int64_t m0, int64_t mcur, int64_t p, int, int64_t, int64_t) {
    if (mcur < 4 * kMRU) {  // too few rows to repay the unpacking (the same arithmetic either way)
      for_each_even_tile(mcur, kMR, [&](int64_t i, int rows) {
        tail_rows<kMR, TO>(rows, x, m0 + i, wp, p, bias, y, N, N, packed);
      });
      return;
    }
    // This thread's panel p, unpacked for the row block's tiles (a panel of K = 1536 takes 30 KiB).
    thread_local std::vector<uint8_t> buf;
    buf.resize(x.kb * kUnpackedBlock + 32);
    uint8_t* u = buf.data() + (-reinterpret_cast<uintptr_t>(buf.data()) & 31);  // 32-byte aligned
    for (int64_t b = 0; b < x.kb; ++b) {
      uint8_t* blk = u + b * kUnpackedBlock;
      for (int j = 0; j < 4; ++j) store_w(packed(p, b, j), blk + j * kUnpacked);
      const uint16_t* dm = reinterpret_cast<const uint16_t*>(wp + (p * x.kb + b) * kRecord + kCodeBytes);
      float* f = reinterpret_cast<float*>(blk + 4 * kUnpacked);
      for (int v = 0; v < 2 * kFV; ++v) vstore(f + v * kW, vload_half(dm + v * kW));
    }
    for_each_even_tile(mcur, kMRU, [&](int64_t i, int rows) {
      tail_unpacked<kMRU, TO>(rows, x, m0 + i, u, p, bias, y, N, N);
    });
  });
#else
  const int64_t mc = row_block_rows(M, x.kb * kQB, kMR);
  const PackedCodes codes{wp, x.kb};
  for_each_gemm_block(M, N, kNP, 1, 1, mc, [&](int64_t m0, int64_t mcur, int64_t p, int, int64_t, int64_t) {
    for_each_even_tile(mcur, kMR, [&](int64_t i, int rows) {
      tail_rows<kMR, TO>(rows, x, m0 + i, wp, p, bias, y, N, N, codes);
    });
  });
#endif
}

// Row r of x [M, K] -> q (K int8), dx and mx per block of 32: q = round(x * (127 / amax)) to nearest even, dx =
// amax / 127, mx = dx * sum(q); an all-zero block gives q = 0, dx = mx = 0, one with an inf or nan q = 0 and
// dx = mx = nan (so that the outputs are nan, not numbers).
template <typename T>
void quantize_row(const T* xr, int64_t kb, int8_t* q, float* dx, float* mx) {
  for (int64_t b = 0; b < kb; ++b) {
    vf v[kQB / kW];
    vf amax = vzero(), nonfinite = vzero();  // x * 0 is nan exactly where x is inf or nan
    for (int i = 0; i < kQB / kW; ++i) {
      v[i] = vload(xr + b * kQB + i * kW);
      amax = vmax(amax, vmax(v[i], vsub(vzero(), v[i])));
      nonfinite = vadd(nonfinite, vmul(v[i], vzero()));
    }
    const float a = vmax_all(amax);
    int8_t* qb = q + b * kQB;
    if (std::isnan(vsum(nonfinite)) || !(a > 0.0f)) {
      std::memset(qb, 0, kQB);
      dx[b] = mx[b] = std::isnan(vsum(nonfinite)) ? std::numeric_limits<float>::quiet_NaN() : 0.0f;
      continue;
    }
    const vf inv = vset(127.0f / a);
    alignas(64) float r[kQB];
#if defined(__AVX512F__) || defined(__AVX2__)
    for (int i = 0; i < kQB / kW; ++i) vstore(r + i * kW, vround_int(vmul(v[i], inv)));  // to nearest even
#else
    // (vec.h's generic vround_int rounds half away from zero; torch.round and the SIMD levels round to even.)
    for (int i = 0; i < kQB / kW; ++i) vstore(r + i * kW, vmul(v[i], inv));
    for (int i = 0; i < kQB; ++i) r[i] = std::nearbyint(r[i]);
#endif
    int32_t sum = 0;
    for (int i = 0; i < kQB; ++i) {
      qb[i] = static_cast<int8_t>(r[i]);
      sum += qb[i];
    }
    dx[b] = a / 127.0f;
    mx[b] = dx[b] * static_cast<float>(sum);
  }
}

void quantize_rows(const at::Tensor& x, int8_t* q, float* dx, float* mx) {
  const int64_t M = x.size(0), K = x.size(1), kb = K / kQB, ld = x.stride(0);
  AT_DISPATCH_SWITCH(x.scalar_type(), "int4_linear",
                     AT_DISPATCH_CASE(at::kFloat,
                                      [&] {
                                        const float* p = x.data_ptr<float>();
                                        at::parallel_for(0, M, 16, [&](int64_t a, int64_t e) {
                                          for (int64_t r = a; r < e; ++r)
                                            quantize_row(p + r * ld, kb, q + r * K, dx + r * kb, mx + r * kb);
                                        });
                                      })
                         AT_DISPATCH_CASE(at::kBFloat16, [&] {
                           const at::BFloat16* p = x.data_ptr<at::BFloat16>();
                           at::parallel_for(0, M, 16, [&](int64_t a, int64_t e) {
                             for (int64_t r = a; r < e; ++r)
                               quantize_row(p + r * ld, kb, q + r * K, dx + r * kb, mx + r * kb);
                           });
                         }));
}

void check_x(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "int4_linear: x [M, K] rows");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "int4_linear: fp32 or bf16 x");
  TORCH_CHECK(x.size(1) % kQB == 0, "int4_linear: K must be a multiple of 32, got ", x.size(1));
}

}  // namespace

namespace kvserve {

void int4_quantize_row(const float* x, int64_t kb, int8_t* q, float* dx, float* mx) { quantize_row(x, kb, q, dx, mx); }
void int4_quantize_row(const at::BFloat16* x, int64_t kb, int8_t* q, float* dx, float* mx) {
  quantize_row(x, kb, q, dx, mx);
}
void int4_gemv_panels(const int8_t* q, const float* dx, const float* mx, int64_t kb, const uint8_t* wp,
                      const float* bias, float* y, int64_t n, int64_t p_begin, int64_t p_end) {
  gemv_panels<float>(Rows{q, dx, mx, kb}, wp, bias, y, n, p_begin, p_end);
}
void int4_gemv_panels(const int8_t* q, const float* dx, const float* mx, int64_t kb, const uint8_t* wp,
                      const float* bias, at::BFloat16* y, int64_t n, int64_t p_begin, int64_t p_end) {
  gemv_panels<at::BFloat16>(Rows{q, dx, mx, kb}, wp, bias, y, n, p_begin, p_end);
}

}  // namespace kvserve

// The activation quantization above as a torch op, for tests: x [M, K] -> (q [M, K] int8, dx, mx [M, K / 32]).
std::tuple<at::Tensor, at::Tensor, at::Tensor> int4_quantize_rows(at::Tensor x) {
  check_x(x);
  const int64_t M = x.size(0), K = x.size(1);
  auto q = at::empty({M, K}, x.options().dtype(at::kChar));
  auto dx = at::empty({M, K / kQB}, x.options().dtype(at::kFloat));
  auto mx = at::empty({M, K / kQB}, x.options().dtype(at::kFloat));
  if (M > 0) quantize_rows(x, q.data_ptr<int8_t>(), dx.data_ptr<float>(), mx.data_ptr<float>());
  return {q, dx, mx};
}

// x [M, K] (fp32 or bf16, unit column stride) -> y [M, n] in out_dtype (fp32 or bf16). packed: uint8
// [ceil(n / 16), K / 32, 320], the layout at the top of this file; bias [n] fp32 or None.
at::Tensor int4_linear(at::Tensor x, at::Tensor packed, int64_t n, c10::optional<at::Tensor> bias,
                       at::ScalarType out_dtype) {
  check_x(x);
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == kRecord && packed.is_contiguous() &&
                  packed.scalar_type() == at::kByte,
              "int4_linear: packed [panels, blocks, 320] uint8 from pack_int4_weight");
  const int64_t M = x.size(0), K = x.size(1), P = packed.size(0);
  TORCH_CHECK(packed.size(1) * kQB == K, "int4_linear: x has ", K, " features, the weight ", packed.size(1) * kQB);
  TORCH_CHECK(n > (P - 1) * kNP && n <= P * kNP, "int4_linear: n does not match the panels");
  TORCH_CHECK(out_dtype == at::kFloat || out_dtype == at::kBFloat16, "int4_linear: fp32 or bf16 output");
  at::Tensor bias_padded;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == n, "int4_linear: bias [n]");
    bias_padded = at::zeros({P * kNP}, x.options().dtype(at::kFloat));
    bias_padded.narrow(0, 0, n).copy_(bias->reshape({n}));
  }
  auto y = at::empty({M, n}, x.options().dtype(out_dtype));
  if (M == 0) return y;
  auto q = at::empty({M, K}, x.options().dtype(at::kChar));
  auto dx = at::empty({M, K / kQB}, x.options().dtype(at::kFloat));
  auto mx = at::empty({M, K / kQB}, x.options().dtype(at::kFloat));
  quantize_rows(x, q.data_ptr<int8_t>(), dx.data_ptr<float>(), mx.data_ptr<float>());
  const Rows rows{q.data_ptr<int8_t>(), dx.data_ptr<float>(), mx.data_ptr<float>(), K / kQB};
  const float* b = bias_padded.defined() ? bias_padded.data_ptr<float>() : nullptr;
  if (out_dtype == at::kFloat)
    gemm_int4<float>(rows, packed.data_ptr<uint8_t>(), b, y.data_ptr<float>(), M, n);
  else
    gemm_int4<at::BFloat16>(rows, packed.data_ptr<uint8_t>(), b, y.data_ptr<at::BFloat16>(), M, n);
  return y;
}

// Int8 linear layers on the CPU (W8A8, kvserve/layers/quant/int8_linear.py), in one call per layer:
//
//   q[m]  = round(x'[m] * 127 / max|x'[m]|)   int8, per input row (x' = x rotated per 64-block when asked, quant.cpp)
//   y[m, n] = (sum_k q[m, k] codes[n, k]) * (max|x'[m]| / 127) * scale[n] (+ bias[n])
//
// The dot products are exact int32 sums, so a row's output depends only on that row (batch composition, chunked
// prefill and prefix caching see the same numbers), and the kernel's result equals the torch reference
// (int8_linear.py's forward_native) given the same codes.
//
// Why our own kernel rather than fbgemm's dynamic quantized linear (which the first version used): at batch 1 a
// 135M model spends ~0.1 ms per layer in the fbgemm route's separate passes (input normalisation, fbgemm's own
// input quantization, the fp32 output, our rescale) and Python between them, and fbgemm's opaque packed weight
// cannot be called from the fused C++ decoder layer; measured on kind A the whole route decoded at 0.69x
// llama.cpp's speed (docs/benchmarks.md). Here quantization, the GEMM and the rescale are one pass each over
// registers, and the weight is in a panel layout the fused layer reads directly.
//
// Weight layout (pack_int8_weight): the output channels are grouped in panels of kNP (two vectors of int32 lanes,
// as linear.cpp's fp32 panels); a panel is stored as [K/4, kNP, 4]: one vector load gives kW channels x 4
// consecutive k, which is what the ISA's 4-way int8 dot instruction multiplies with 4 broadcast activations:
// - AVX512-VNNI (vpdpbusd): unsigned x signed bytes, so the activations enter as q + 128 and 128 * sum_k codes[n, k]
//   (the column sum, kept with the panels) is taken off afterwards;
// - AVX-512BW / AVX2 (vpmaddubsw + vpmaddwd): |q| times codes with q's sign, pairwise sums of two products of at
//   most 127 * 127, which never saturate int16 (codes are kept in [-127, 127] for this);
// - generic: plain integer loops.
// Where the CPU has AMX-INT8 (with AVX512-VNNI), the same panels are AMX B tiles (a 64-byte tile row = 16 channels
// x one quad), and `tdpbusd` takes the same unsigned x signed bytes as `vpdpbusd`: batched rows run on the tile
// unit. Integer sums are exact in any order, so the tiles give the same bits as the vectors; batch 1 keeps the
// GEMV (it streams the panels at the rate of a plain read).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <utility>

#include "amx.h"
#include "panel_loops.h"
#include "simd.h"

void quantize_rows_int8(const at::Tensor& x, const float* signs, int8_t* q, int64_t q_stride, float* q_scale,
                        bool flip);

namespace {

using namespace kvserve;

constexpr int kNV = 2;         // vectors per panel row
constexpr int kNP = kNV * kW;  // panel width: output channels per panel
constexpr int kQ = 4;          // k values per int32 lane in one dot step

inline int32_t load_quad(const int8_t* x) {
  int32_t v;
  std::memcpy(&v, x, sizeof(v));
  return v;
}

// ---------------------------------------------------------------- the 4-way int8 dot step, per ISA
// Quad: 4 activations broadcast to every lane, prepared once per k step and row; dot(acc, x, w): lane j of acc
// += sum_b x[b] * w[4 j + b] for the kW lanes of weights at w.
#if defined(__AVX512VNNI__)
constexpr int32_t kOffset = 128;  // activations are stored as unsigned bytes, q + 128 (quantize_rows_int8's flip)
constexpr int kMR = 12;           // rows per tile: 12 x 2 accumulators + 2 weights + 1 broadcast of 32 registers
struct Quad {
  __m512i u;
};
inline Quad quad(const int8_t* x) { return {_mm512_set1_epi32(load_quad(x))}; }
inline vi dot(vi acc, const Quad& x, const int8_t* w) {
  return _mm512_dpbusd_epi32(acc, x.u, _mm512_loadu_si512(w));
}
#elif defined(__AVX512BW__)
constexpr int32_t kOffset = 0;
constexpr int kMR = 8;  // the sign step needs temporaries beside the 2 x MR accumulators
struct Quad {
  __m512i abs;
  __mmask64 neg;
};
inline Quad quad(const int8_t* x) {
  const __m512i v = _mm512_set1_epi32(load_quad(x));
  return {_mm512_abs_epi8(v), _mm512_movepi8_mask(v)};
}
inline vi dot(vi acc, const Quad& x, const int8_t* w) {
  const __m512i wv = _mm512_loadu_si512(w);
  const __m512i ws = _mm512_mask_sub_epi8(wv, x.neg, _mm512_setzero_si512(), wv);  // w with q's sign
  return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(x.abs, ws), _mm512_set1_epi16(1)));
}
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int32_t kOffset = 0;
constexpr int kMR = 4;  // 2 x 4 accumulators + 2 weights + broadcast, |broadcast|, temporaries of 16 registers
struct Quad {
  __m256i v, abs;
};
inline Quad quad(const int8_t* x) {
  const __m256i v = _mm256_set1_epi32(load_quad(x));
  return {v, _mm256_abs_epi8(v)};
}
inline vi dot(vi acc, const Quad& x, const int8_t* w) {
  const __m256i ws = _mm256_sign_epi8(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w)), x.v);
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(x.abs, ws), _mm256_set1_epi16(1)));
}
#else
constexpr int32_t kOffset = 0;
constexpr int kMR = 4;
struct Quad {
  int32_t x[kQ];
};
inline Quad quad(const int8_t* x) { return {{x[0], x[1], x[2], x[3]}}; }
inline vi dot(vi acc, const Quad& x, const int8_t* w) {
  for (int j = 0; j < kW; ++j)
    acc[j] += x.x[0] * w[4 * j] + x.x[1] * w[4 * j + 1] + x.x[2] * w[4 * j + 2] + x.x[3] * w[4 * j + 3];
  return acc;
}
#endif

// A row tile asks for the weights this many k quads ahead (as linear_bf16.cpp's row tiles do; the hardware
// prefetcher alone left the arithmetic waiting on memory from about 7 rows on).
constexpr int64_t kPrefetchQuads = 64;

// What turns one panel's int32 sums into outputs: per-channel scale and column sum (both padded to whole panels),
// the bias (padded, or null).
struct PanelEpilogue {
  const float* scale;
  const int32_t* colsum;
  const float* bias;
};

// y[0..ncols) = (acc - kOffset * colsum) * (row_scale * scale) (+ bias) for vector v of one row of one panel (its
// channels v * kW ..; ncols counts from the panel's start). The accumulator comes by value, so the tiles' arrays
// never have their address taken (see the note on the tiles below).
template <typename TO>
inline void finish_vec(vi a, int v, float row_scale, const PanelEpilogue& e, TO* y, int ncols) {
  const int c0 = v * kW;
  if (c0 >= ncols) return;
  if constexpr (kOffset != 0) {
    vi c;
    std::memcpy(&c, e.colsum + c0, sizeof(c));
    a = visub(a, vimul(c, viset(kOffset)));
  }
  // One explicit rounding sequence (the compiler may not contract a separate multiply and add differently in
  // the GEMV and the GEMM), so a row's output does not depend on its batch.
  const vf a_f = vitof(a), s = vmul(vset(row_scale), vload(e.scale + c0));
  const vf r = e.bias != nullptr ? vfma(a_f, s, vload(e.bias + c0)) : vmul(a_f, s);
  vstore_n(y + c0, r, ncols - c0);
}

static_assert(kNV == 2, "the tiles below are written for two vectors per panel row");

// The row and panel loops below are folds over compile-time index packs, not `for` loops: GCC keeps an accumulator
// array in vector registers only when every index into it is a constant from the start (with a `for` over the
// rows, even fully unrolled, the GEMM tile's 24 accumulators stayed in memory, loaded and stored on every k step,
// at half the speed).

// Rows I... of the input against one panel, over all k: 2 accumulators per row.
template <typename TO, size_t... I>
inline void row_tile(std::index_sequence<I...>, const int8_t* xq, int64_t ldx, const float* row_scale,
                     const int8_t* panel, int64_t k4, const PanelEpilogue& e, TO* y, int64_t ldy, int ncols) {
  vi acc[sizeof...(I)][kNV];
  ((acc[I][0] = viset(0), acc[I][1] = viset(0)), ...);
  for (int64_t q = 0; q < k4; ++q) {
    const int8_t* w = panel + q * kNP * kQ;
    const int8_t* x = xq + q * kQ;
    for (int l = 0; l < kNP * kQ / 64; ++l) prefetch_l1(w + kPrefetchQuads * kNP * kQ + 64 * l);
    ((acc[I][0] = dot(acc[I][0], quad(x + I * ldx), w), acc[I][1] = dot(acc[I][1], quad(x + I * ldx), w + kW * kQ)),
     ...);
  }
  ((finish_vec(acc[I][0], 0, row_scale[I], e, y + I * ldy, ncols),
    finish_vec(acc[I][1], 1, row_scale[I], e, y + I * ldy, ncols)),
   ...);
}

// The last rows of a block (fewer than kMR): the same tile with `rows` rows.
template <typename TO, int MR = kMR - 1>
inline void tail_tile(int rows, const int8_t* xq, int64_t ldx, const float* row_scale, const int8_t* panel,
                      int64_t k4, const PanelEpilogue& e, TO* y, int64_t ldy, int ncols) {
  if constexpr (MR > 0) {
    if (rows == MR)
      return row_tile<TO>(std::make_index_sequence<MR>{}, xq, ldx, row_scale, panel, k4, e, y, ldy, ncols);
    tail_tile<TO, MR - 1>(rows, xq, ldx, row_scale, panel, k4, e, y, ldy, ncols);
  }
}

// One input row (batch-1 decode) against panels P...: 2 x NP independent accumulator chains and NP sequential weight
// streams, as linear.cpp's gemv_panels.
template <typename TO, size_t... P>
inline void gemv_panels(std::index_sequence<P...>, const int8_t* xq, float row_scale, const int8_t* panels,
                        int64_t k4, const PanelEpilogue& e, TO* y, int ncols) {
  vi acc[sizeof...(P)][kNV];
  ((acc[P][0] = viset(0), acc[P][1] = viset(0)), ...);
  for (int64_t q = 0; q < k4; ++q) {
    const Quad x = quad(xq + q * kQ);
    ((acc[P][0] = dot(acc[P][0], x, panels + ((P * k4 + q) * kNP) * kQ),
      acc[P][1] = dot(acc[P][1], x, panels + ((P * k4 + q) * kNP + kW) * kQ)),
     ...);
  }
  auto finish_panel = [&](const vi* a, int64_t p) {
    const PanelEpilogue ep{e.scale + p * kNP, e.colsum + p * kNP, e.bias ? e.bias + p * kNP : nullptr};
    const int nc = static_cast<int>(std::min<int64_t>(ncols - p * kNP, kNP));
    finish_vec(a[0], 0, row_scale, ep, y + p * kNP, nc);
    finish_vec(a[1], 1, row_scale, ep, y + p * kNP, nc);
  };
  (finish_panel(acc[P], P), ...);
}

#if defined(__AVX512VNNI__)
// Rows m0.. (mcur of them) x one whole panel (all k4 quads), on the tile unit: tiles as amx.h describes, int32 sums
// finished by the vectors' epilogue. A last group of fewer than 16 rows is configured with fewer rows.
// `configured`: the rows the calling thread's tiles are configured for (0: none), kept across its panels (as in
// linear_bf16.cpp: configuring per call cost more than a small call's products). `next_panel`: the panel the
// thread takes next (prefetched during the first row group), or null.
template <typename TO>
__attribute__((target("amx-tile,amx-int8"))) void amx_block(const int8_t* xq, int64_t ldx, const float* row_scale,
                                                             const int8_t* panel, int64_t k4,
                                                             const PanelEpilogue& e, TO* y, int64_t ldy,
                                                             int64_t mcur, int ncols, int& configured,
                                                             const int8_t* next_panel) {
  constexpr int kQuads = amx::kTileK / kQ;  // k quads per tile step
  const int64_t full = k4 / kQuads;
  const int tail = static_cast<int>(k4 % kQuads);
  constexpr int64_t ldw = kNP * kQ;  // bytes per panel quad-row
  alignas(64) int32_t sums[amx::kTileRows * kNP];
  for (int64_t r = 0; r < mcur; r += amx::kTileRows) {
    const int rows = static_cast<int>(std::min<int64_t>(amx::kTileRows, mcur - r));
    if (rows != configured) {
      const amx::TileConfig cfg = amx::tile_config(rows, tail);
      _tile_loadconfig(&cfg);
      configured = rows;
    }
    const int8_t* xa = xq + r * ldx;
    _tile_zero(0);
    _tile_zero(1);
    for (int64_t kb = 0; kb < full; ++kb) {
      const int8_t* w = panel + kb * kQuads * kNP * kQ;
      // The next panel's same k rows, while this one's products run: with a few rows (a draft tree's verification,
      // a small batch) the tile products take about as long as the panel's read from memory, and without this
      // they ran one after the other (30 layers at 13 rows: 1.6-1.8x one row's time -> 1.4-1.5x, kind C).
      if (r == 0 && next_panel != nullptr)
        for (int l = 0; l < kQuads * kNP * kQ / 64; ++l) prefetch_l1(next_panel + kb * kQuads * kNP * kQ + 64 * l);
      _tile_loadd(2, xa + kb * amx::kTileK, ldx);
      _tile_loadd(3, w, ldw);
      _tile_loadd(4, w + kW * kQ, ldw);
      _tile_dpbusd(0, 2, 3);
      _tile_dpbusd(1, 2, 4);
    }
    if (tail) {
      const int8_t* w = panel + full * kQuads * kNP * kQ;
      _tile_loadd(5, xa + full * amx::kTileK, ldx);
      _tile_loadd(6, w, ldw);
      _tile_loadd(7, w + kW * kQ, ldw);
      _tile_dpbusd(0, 5, 6);
      _tile_dpbusd(1, 5, 7);
    }
    _tile_stored(0, sums, kNP * sizeof(int32_t));
    _tile_stored(1, sums + kW, kNP * sizeof(int32_t));
    for (int i = 0; i < rows; ++i) {
      TO* yr = y + (r + i) * ldy;
      finish_vec(_mm512_load_si512(sums + i * kNP), 0, row_scale[r + i], e, yr, ncols);
      finish_vec(_mm512_load_si512(sums + i * kNP + kW), 1, row_scale[r + i], e, yr, ncols);
    }
  }
}

__attribute__((target("amx-tile"))) void tile_release() { _tile_release(); }
#endif

template <typename TO>
void gemm_int8(const int8_t* xq, const float* row_scale, const int8_t* wp, const PanelEpilogue& e, TO* y, int64_t M,
               int64_t N, int64_t k4) {
  const int64_t num_panels = cdiv(N, kNP);
  const int64_t ldx = k4 * kQ;
  auto epilogue = [&](int64_t p) {
    return PanelEpilogue{e.scale + p * kNP, e.colsum + p * kNP, e.bias ? e.bias + p * kNP : nullptr};
  };
  if (M == 1) {
    constexpr int kGP = 4;  // panels per gemv call
    for_each_panel_group<kGP>(num_panels, N, kNP, [&](int64_t p, bool whole, int ncols) {
      const int8_t* panels = wp + p * k4 * kNP * kQ;
      if (whole)
        gemv_panels<TO>(std::make_index_sequence<kGP>{}, xq, row_scale[0], panels, k4, epilogue(p), y + p * kNP,
                        ncols);
      else
        gemv_panels<TO>(std::make_index_sequence<1>{}, xq, row_scale[0], panels, k4, epilogue(p), y + p * kNP,
                        ncols);
    });
    return;
  }
#if defined(__AVX512VNNI__)
  if (amx::active(amx::kInt8)) {
    const int64_t mc = row_block_rows(M, ldx, amx::kTileRows, amx::kRowBlockBytes);
    // for_each_gemm_block's loops, with the tiles configured once per thread's share and released at its end.
    at::parallel_for(0, cdiv(N, kNP), 1, [&](int64_t p_begin, int64_t p_end) {
      int configured = 0;
      for (int64_t m0 = 0; m0 < M; m0 += mc) {
        const int64_t mcur = std::min(mc, M - m0);
        for (int64_t p = p_begin; p < p_end; ++p) {
          const int ncols = static_cast<int>(std::min<int64_t>(kNP, N - p * kNP));
          const int8_t* next = m0 == 0 && p + 1 < p_end ? wp + (p + 1) * k4 * kNP * kQ : nullptr;
          amx_block<TO>(xq + m0 * ldx, ldx, row_scale + m0, wp + p * k4 * kNP * kQ, k4, epilogue(p),
                        y + m0 * N + p * kNP, N, mcur, ncols, configured, next);
        }
      }
      if (configured) tile_release();
    });
    return;
  }
#endif
  // Input rows in blocks (panel_loops.h); a panel (K x kNP bytes, 18-48 KiB here) stays in L1/L2 across the
  // block's row tiles.
  const int64_t mc = row_block_rows(M, ldx, kMR);
  // One k block: the whole panel.
  for_each_gemm_block(M, N, kNP, k4, k4, mc, [&](int64_t m0, int64_t mcur, int64_t p, int ncols, int64_t, int64_t) {
    const int8_t* panel = wp + p * k4 * kNP * kQ;
    const PanelEpilogue ep = epilogue(p);
    TO* yp = y + m0 * N + p * kNP;
    const int8_t* xp = xq + m0 * ldx;
    const float* rs = row_scale + m0;
    for_each_even_tile(mcur, kMR, [&](int64_t i, int rows) {
      if (rows == kMR)
        row_tile<TO>(std::make_index_sequence<kMR>{}, xp + i * ldx, ldx, rs + i, panel, k4, ep, yp + i * N, N, ncols);
      else tail_tile<TO>(rows, xp + i * ldx, ldx, rs + i, panel, k4, ep, yp + i * N, N, ncols);
    });
  });
}

}  // namespace

int64_t int8_panel_width() { return kNP; }

// Whether batched int8 rows run on AMX tiles here (AVX512-VNNI build, a CPU with AMX-INT8, the tile paths on).
bool int8_linear_amx_active() {
#if defined(__AVX512VNNI__)
  return amx::active(amx::kInt8);
#else
  return false;
#endif
}

// codes [N, K] int8 in [-127, 127] -> (panels [ceil(N / kNP), ceil(K / 4), kNP, 4] int8, zero-padded in N and K;
// colsum [ceil(N / kNP) * kNP] int32: sum_k codes[n, k], zero past N).
std::tuple<at::Tensor, at::Tensor> pack_int8_weight(at::Tensor codes) {
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == at::kChar, "pack_int8_weight: int8 codes [N, K]");
  TORCH_CHECK(codes.numel() == 0 || codes.min().item<int>() >= -127, "pack_int8_weight: codes must be >= -127");
  const int64_t N = codes.size(0), K = codes.size(1), P = cdiv(N, kNP), K4 = cdiv(K, kQ);
  auto padded = at::zeros({P * kNP, K4 * kQ}, codes.options());
  padded.narrow(0, 0, N).narrow(1, 0, K).copy_(codes);
  auto panels = padded.view({P, kNP, K4, kQ}).permute({0, 2, 1, 3}).contiguous();
  auto colsum = padded.sum(1, /*keepdim=*/false, at::kInt);
  return {panels, colsum};
}

// The inverse of pack_int8_weight: panels -> codes [n, k].
at::Tensor unpack_int8_weight(at::Tensor panels, int64_t n, int64_t k) {
  TORCH_CHECK(panels.dim() == 4 && panels.size(2) == kNP && panels.size(3) == kQ, "unpack_int8_weight: panels");
  const int64_t P = panels.size(0), K4 = panels.size(1);
  return panels.permute({0, 2, 1, 3}).reshape({P * kNP, K4 * kQ}).narrow(0, 0, n).narrow(1, 0, k).contiguous();
}

// x [M, K] (fp32 or bf16, unit column stride) -> y [M, n] in out_dtype (fp32 or bf16): the int8 linear above.
// panels/colsum from pack_int8_weight; scale [P * kNP] fp32 (zero-padded); signs [64] fp32 to rotate x per
// 64-block (K a multiple of 64; the codes must be of the rotated weight), or None; bias [n] or None.
at::Tensor int8_linear(at::Tensor x, at::Tensor panels, at::Tensor scale, at::Tensor colsum, int64_t n,
                       c10::optional<at::Tensor> signs, c10::optional<at::Tensor> bias, at::ScalarType out_dtype) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "int8_linear: x [M, K] rows");
  TORCH_CHECK(panels.dim() == 4 && panels.size(2) == kNP && panels.size(3) == kQ && panels.is_contiguous() &&
                  panels.scalar_type() == at::kChar,
              "int8_linear: panels from pack_int8_weight");
  const int64_t M = x.size(0), K = x.size(1), P = panels.size(0), K4 = panels.size(1);
  TORCH_CHECK(cdiv(K, kQ) == K4, "int8_linear: x has ", K, " features, the weight ", K4 * kQ);
  TORCH_CHECK(n > (P - 1) * kNP && n <= P * kNP, "int8_linear: n does not match the panels");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() && scale.numel() == P * kNP,
              "int8_linear: scale [panels * width] fp32");
  TORCH_CHECK(colsum.scalar_type() == at::kInt && colsum.is_contiguous() && colsum.numel() == P * kNP,
              "int8_linear: colsum [panels * width] int32");
  TORCH_CHECK(out_dtype == at::kFloat || out_dtype == at::kBFloat16, "int8_linear: fp32 or bf16 output");
  const bool rotate = signs.has_value() && signs->defined();
  at::Tensor bias_padded;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == n, "int8_linear: bias [n]");
    bias_padded = at::zeros({P * kNP}, x.options().dtype(at::kFloat));
    bias_padded.narrow(0, 0, n).copy_(bias->reshape({n}));
  }
  // Zero codes past K (stored flipped, 0x80, when the kernel takes q + 128: their products then cancel against
  // the padded weights' zero codes either way).
  auto xq = at::full({M, K4 * kQ}, kOffset != 0 ? -128 : 0, x.options().dtype(at::kChar));
  auto row_scale = at::empty({M}, x.options().dtype(at::kFloat));
  auto y = at::empty({M, n}, x.options().dtype(out_dtype));
  if (M == 0) return y;
  quantize_rows_int8(x, rotate ? signs->data_ptr<float>() : nullptr, xq.data_ptr<int8_t>(), K4 * kQ,
                     row_scale.data_ptr<float>(), /*flip=*/kOffset != 0);
  const PanelEpilogue e{scale.data_ptr<float>(), colsum.data_ptr<int32_t>(),
                        bias_padded.defined() ? bias_padded.data_ptr<float>() : nullptr};
  if (out_dtype == at::kFloat) {
    gemm_int8<float>(xq.data_ptr<int8_t>(), row_scale.data_ptr<float>(), panels.data_ptr<int8_t>(), e,
                     y.data_ptr<float>(), M, n, K4);
  } else {
    gemm_int8<at::BFloat16>(xq.data_ptr<int8_t>(), row_scale.data_ptr<float>(), panels.data_ptr<int8_t>(), e,
                            y.data_ptr<at::BFloat16>(), M, n, K4);
  }
  return y;
}

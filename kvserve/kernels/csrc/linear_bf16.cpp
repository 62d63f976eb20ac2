// Linear layers for bf16 weights on CPUs with AVX512-BF16: y [M, N] = x [M, K] @ w [N, K]^T (+ bias [N]), the
// weight held once in a pair-panel layout that `vdpbf16ps` reads at every batch size.
//
// Pair panels: linear.cpp's panels (kNP weight rows per panel, k-major) with two consecutive k per row,
// [num_panels, K / 2, kNP, 2] bf16. One 64-byte load is 16 weight rows x (k, k + 1); `vdpbf16ps` multiplies it by
// a broadcast pair (x[k], x[k + 1]) and adds both products to 16 fp32 accumulators: twice the multiply-adds of an
// fp32 FMA per instruction, and half the bytes of an fp32 weight.
// - Batch 1 streams each panel front to back, several panels at once (independent accumulator chains), as
//   linear.cpp does for fp32. oneDNN's packed bf16 GEMV reads its own layout at about a third of the machine's
//   bandwidth (docs/benchmarks.md), which is why this layout exists.
// - Batches run a register-tiled GEMM: kMR input rows x one panel of accumulators; each pair step loads kNV
//   weight vectors and broadcasts kMR input pairs.
// - Where the CPU has AMX-BF16 (Intel Sapphire Rapids on), every batch size runs on the tile unit instead: a pair
//   panel is already AMX's B-tile format (a 64-byte tile row holds 16 columns x one k pair), so tiles load straight
//   from the panels and the input rows, up to 16 rows x 32 columns x 16 pairs per two `tdpbf16ps`. On the Intel
//   machine of docs/benchmarks.md a model step's linears take 0.73x the time of the vdpbf16ps kernels at batch 1 and
//   0.18x at 64 rows.
// Every output sums its pairs in order from k = 0 (a k block resumes from the fp32 partial sums it stored), so a
// row's result does not depend on the batch it is in. `tdpbf16ps` rounds its sums differently from `vdpbf16ps`
// (results differ in the last bits), which is why the tile path takes batch 1 as well: on one machine every row
// count runs the same arithmetic. The input is bf16 (a bf16 model's activations already are).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>

#include "panel_loops.h"

#include "amx.h"

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace {

using namespace kvserve;

constexpr int kPW = 16;        // weight rows per vector
constexpr int kNV = 2;         // vectors per panel row
constexpr int kNP = kNV * kPW;  // panel width: weight rows per panel

#if defined(__AVX512BF16__)

constexpr int kMR = 12;  // row tile: kMR x kNV accumulators + kNV weight vectors + one broadcast <= 32 registers
static_assert(kMR * kNV + kNV + 1 <= 32, "row tile does not fit in the vector registers");
// A row tile asks for the weight pairs this far ahead: the tile's arithmetic keeps pace with memory from about 7 rows
// on, and without the hint the two stall each other (without it 12 rows took 1.25x the time, 24 rows 1.4x; the
// hardware prefetcher alone does not run far enough ahead). Batch 1 streams 4 panels at once and gains nothing.
constexpr int64_t kPrefetchPairs = 64;

inline __m512bh wload(const uint16_t* p) { return (__m512bh)_mm512_loadu_si512(p); }

// (x[k], x[k + 1]) in every 32-bit lane.
inline __m512bh xpair(const uint16_t* x) {
  int32_t v;
  std::memcpy(&v, x, sizeof(v));
  return (__m512bh)_mm512_set1_epi32(v);
}

// Where a tile's sums go: fp32 partial sums while k blocks remain, then the output: sums + bias (fp32), rounded
// to bf16 (nearest even, as c10::BFloat16) or kept fp32. Writing bf16 directly spares a full fp32 output and a
// conversion pass, which for an LM head at batch 128 (25 MB of fp32 logits) cost more than the GEMM's own gap.
struct Out {
  float* partial;     // [M, N] fp32, used only between k blocks
  uint16_t* out_bf16;  // [M, N] bf16 bits, or null
  float* out_f32;      // [M, N] fp32 when out_bf16 is null
  const float* bias;   // [N] or null
  int64_t ldy;         // N
  bool stream = false;  // bf16 output rows of whole panels bypass the caches (aligned, and too large to stay there)
};

// The first n lanes of a vector (all 16 from n = 16 on, none below 1).
inline __mmask16 lanes(int n) { return static_cast<__mmask16>(n >= kPW ? 0xFFFF : (1u << std::max(0, n)) - 1); }

inline void store_row(const __m512* acc, const Out& o, int64_t row, int64_t col, int ncols, bool last) {
  alignas(64) float tmp[kNP];
  const int64_t at = row * o.ldy + col;
  if (ncols == kNP) {
    // A whole panel: straight into the output (no staging copy; an LM head at 256 rows writes 25 MB of this).
    for (int v = 0; v < kNV; ++v) {
      __m512 a = acc[v];
      if (last && o.bias) a = _mm512_add_ps(a, _mm512_loadu_ps(o.bias + col + v * kPW));
      if (!last) _mm512_storeu_ps(o.partial + at + v * kPW, a);
      else if (o.out_bf16 && o.stream)
        _mm256_stream_si256(reinterpret_cast<__m256i*>(o.out_bf16 + at + v * kPW), (__m256i)_mm512_cvtneps_pbh(a));
      else if (o.out_bf16)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(o.out_bf16 + at + v * kPW), (__m256i)_mm512_cvtneps_pbh(a));
      else _mm512_storeu_ps(o.out_f32 + at + v * kPW, a);
    }
    return;
  }
  if (!last || !o.out_bf16) {
    float* dst = last ? o.out_f32 + at : o.partial + at;
    for (int v = 0; v < kNV; ++v) {
      __m512 a = acc[v];
      if (last && o.bias) a = _mm512_add_ps(a, _mm512_maskz_loadu_ps(lanes(ncols - v * kPW), o.bias + col + v * kPW));
      _mm512_storeu_ps(tmp + v * kPW, a);
    }
    std::copy(tmp, tmp + ncols, dst);
    return;
  }
  alignas(64) uint16_t bits[kNP];
  for (int v = 0; v < kNV; ++v) {
    __m512 a = acc[v];
    if (o.bias) a = _mm512_add_ps(a, _mm512_maskz_loadu_ps(lanes(ncols - v * kPW), o.bias + col + v * kPW));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(bits + v * kPW), (__m256i)_mm512_cvtneps_pbh(a));
  }
  std::copy(bits, bits + ncols, o.out_bf16 + at);
}

// Rows row0.. (MR of them) x one panel's pairs [k0, k0 + kp), columns col0.. (ncols): resumes from the partial
// sums unless this is the first k block, and writes partial sums or, in the last block, the output.
template <int MR>
inline void row_tile(const uint16_t* x, int64_t ldx, const uint16_t* panel, int64_t kp, const Out& o, int64_t row0,
                     int64_t col0, int ncols, bool first, bool last) {
  __m512 acc[MR][kNV];
  alignas(64) float tmp[kNP];
  for (int i = 0; i < MR; ++i) {
    if (first) {
      for (int v = 0; v < kNV; ++v) acc[i][v] = _mm512_setzero_ps();
      continue;
    }
    const float* src = o.partial + (row0 + i) * o.ldy + col0;
    if (ncols < kNP) {
      std::copy(src, src + ncols, tmp);
      src = tmp;
    }
    for (int v = 0; v < kNV; ++v) acc[i][v] = _mm512_loadu_ps(src + v * kPW);
  }
  for (int64_t k = 0; k < kp; ++k) {
    __m512bh w[kNV];
    for (int v = 0; v < kNV; ++v) {
      w[v] = wload(panel + (k * kNP + v * kPW) * 2);
      prefetch_l1(panel + ((k + kPrefetchPairs) * kNP + v * kPW) * 2);
    }
    for (int i = 0; i < MR; ++i) {
      const __m512bh b = xpair(x + i * ldx + 2 * k);
      for (int v = 0; v < kNV; ++v) acc[i][v] = _mm512_dpbf16_ps(acc[i][v], w[v], b);
    }
  }
  for (int i = 0; i < MR; ++i) store_row(acc[i], o, row0 + i, col0, ncols, last);
}

template <int MR>
inline void tail_tile(int rows, const uint16_t* x, int64_t ldx, const uint16_t* panel, int64_t kp, const Out& o,
                      int64_t row0, int64_t col0, int ncols, bool first, bool last) {
  if constexpr (MR > 0) {
    if (rows == MR) return row_tile<MR>(x, ldx, panel, kp, o, row0, col0, ncols, first, last);
    tail_tile<MR - 1>(rows, x, ldx, panel, kp, o, row0, col0, ncols, first, last);
  }
}

// One input row against NP consecutive panels (from column col0, ncols of them): NP x kNV independent
// accumulator chains, NP streams.
template <int NP>
inline void gemv_panels(const uint16_t* x, const uint16_t* panels, int64_t kp, const Out& o, int64_t col0,
                        int ncols) {
  __m512 acc[NP][kNV];
  for (int p = 0; p < NP; ++p)
    for (int v = 0; v < kNV; ++v) acc[p][v] = _mm512_setzero_ps();
  for (int64_t k = 0; k < kp; ++k) {
    const __m512bh b = xpair(x + 2 * k);
    for (int p = 0; p < NP; ++p)
      for (int v = 0; v < kNV; ++v)
        acc[p][v] = _mm512_dpbf16_ps(acc[p][v], wload(panels + ((p * kp + k) * kNP + v * kPW) * 2), b);
  }
  for (int p = 0; p < NP && p * kNP < ncols; ++p)
    store_row(acc[p], o, 0, col0 + p * kNP, std::min(kNP, ncols - p * kNP), true);
}

// ------------------------------------------------------------------ AMX-BF16 tiles

constexpr int kTilePairs = amx::kTileK / 4;  // k pairs per tile step

// A tile pair's sums ([rows, kNP] fp32, as the tiles stored them) -> output rows row0.. (the vectors' epilogue).
inline void store_sums(const float* sums, int rows, const Out& o, int64_t row0, int64_t col0, int ncols) {
  for (int i = 0; i < rows; ++i) {
    const __m512 acc[kNV] = {_mm512_load_ps(sums + i * kNP), _mm512_load_ps(sums + i * kNP + kPW)};
    store_row(acc, o, row0 + i, col0, ncols, true);
  }
}

// Rows m0.. (mcur of them) x one whole panel (all kp pairs; columns col0.., ncols of them), on the tile unit. A
// tile of fewer than 16 rows (batch 1, a batch's last rows) is configured with fewer rows, not padded.
// `configured`: the calling thread's tile configuration (0 none, -1 the 2 x 2 layout, else tile_config's rows),
// loaded again only where it changes: at batch 1 an LM head is 1,536 calls of a few hundred cycles each, and
// configuring the tiles per call (and releasing them) cost a fifth of that.
__attribute__((target("amx-tile,amx-bf16"))) void amx_block(const uint16_t* x, int64_t K, const uint16_t* panel,
                                                             int64_t kp, const Out& o, int64_t m0, int64_t mcur,
                                                             int64_t col0, int ncols, int& configured) {
  const int64_t full = kp / kTilePairs;
  const int tail = static_cast<int>(kp % kTilePairs);
  constexpr int64_t ldw = kNP * 2 * sizeof(uint16_t);  // bytes per panel pair-row
  const int64_t ldx = K * static_cast<int64_t>(sizeof(uint16_t));
  alignas(64) float sums[amx::kTileRows * kNP];
  int64_t r = 0;
  if (!tail && mcur >= 2 * amx::kTileRows) {
    // Pairs of 16-row groups: each weight tile serves both (the same products per row as below, so the same bits).
    if (configured != -1) {
      const amx::TileConfig cfg = amx::tile_config_2x2();
      _tile_loadconfig(&cfg);
      configured = -1;
    }
    for (; r + 2 * amx::kTileRows <= mcur; r += 2 * amx::kTileRows) {
      const uint16_t* xa = x + (m0 + r) * K;
      const uint16_t* xb = xa + amx::kTileRows * K;
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      for (int64_t kb = 0; kb < full; ++kb) {
        const uint16_t* w = panel + kb * kTilePairs * kNP * 2;
        _tile_loadd(4, xa + kb * kTilePairs * 2, ldx);
        _tile_loadd(6, w, ldw);
        _tile_dpbf16ps(0, 4, 6);
        _tile_loadd(7, w + kPW * 2, ldw);
        _tile_dpbf16ps(1, 4, 7);
        _tile_loadd(5, xb + kb * kTilePairs * 2, ldx);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
      }
      // Tile ids are immediates: each group's pair of sum tiles is named.
      _tile_stored(0, sums, kNP * sizeof(float));
      _tile_stored(1, sums + kPW, kNP * sizeof(float));
      store_sums(sums, amx::kTileRows, o, m0 + r, col0, ncols);
      _tile_stored(2, sums, kNP * sizeof(float));
      _tile_stored(3, sums + kPW, kNP * sizeof(float));
      store_sums(sums, amx::kTileRows, o, m0 + r + amx::kTileRows, col0, ncols);
    }
  }
  for (; r < mcur; r += amx::kTileRows) {
    const int rows = static_cast<int>(std::min<int64_t>(amx::kTileRows, mcur - r));
    if (rows != configured) {
      const amx::TileConfig cfg = amx::tile_config(rows, tail);
      _tile_loadconfig(&cfg);
      configured = rows;
    }
    const uint16_t* xa = x + (m0 + r) * K;
    _tile_zero(0);
    _tile_zero(1);
    for (int64_t kb = 0; kb < full; ++kb) {
      const uint16_t* w = panel + kb * kTilePairs * kNP * 2;
      _tile_loadd(2, xa + kb * kTilePairs * 2, ldx);
      _tile_loadd(3, w, ldw);
      _tile_loadd(4, w + kPW * 2, ldw);
      _tile_dpbf16ps(0, 2, 3);
      _tile_dpbf16ps(1, 2, 4);
    }
    if (tail) {
      const uint16_t* w = panel + full * kTilePairs * kNP * 2;
      _tile_loadd(5, xa + full * kTilePairs * 2, ldx);
      _tile_loadd(6, w, ldw);
      _tile_loadd(7, w + kPW * 2, ldw);
      _tile_dpbf16ps(0, 5, 6);
      _tile_dpbf16ps(1, 5, 7);
    }
    _tile_stored(0, sums, kNP * sizeof(float));
    _tile_stored(1, sums + kPW, kNP * sizeof(float));
    store_sums(sums, rows, o, m0 + r, col0, ncols);
  }
}

__attribute__((target("amx-tile"))) void tile_release() { _tile_release(); }

void gemm_pairs(const uint16_t* x, const uint16_t* wp, const Out& o, int64_t M, int64_t N, int64_t K) {
  const int64_t num_panels = cdiv(N, kNP);
  const int64_t kp_total = K / 2;
  if (amx::active(amx::kBf16)) {
    // Whole panels (no k blocks: the sums stay in the tiles), input rows in L2-sized blocks of whole tiles.
    const int64_t row_bytes = K * static_cast<int64_t>(sizeof(uint16_t));
    const int64_t mc = row_block_rows(M, row_bytes, amx::kTileRows, amx::kRowBlockBytes);
    // for_each_gemm_block's loops, with the tiles configured once per thread's share and released at its end.
    at::parallel_for(0, num_panels, 1, [&](int64_t p_begin, int64_t p_end) {
      int configured = 0;
      for (int64_t m0 = 0; m0 < M; m0 += mc) {
        const int64_t mcur = std::min(mc, M - m0);
        for (int64_t p = p_begin; p < p_end; ++p) {
          const int ncols = static_cast<int>(std::min<int64_t>(kNP, N - p * kNP));
          amx_block(x, K, wp + p * kp_total * kNP * 2, kp_total, o, m0, mcur, p * kNP, ncols, configured);
        }
      }
      if (configured) tile_release();
      if (o.stream) _mm_sfence();  // streamed rows are visible before the threads join
    });
    return;
  }
  if (M == 1) {
    constexpr int kGP = 4;  // panels per gemv call
    for_each_panel_group<kGP>(num_panels, N, kNP, [&](int64_t p, bool whole, int ncols) {
      const uint16_t* panels = wp + p * K * kNP;
      if (whole) gemv_panels<kGP>(x, panels, kp_total, o, p * kNP, ncols);
      else gemv_panels<1>(x, panels, kp_total, o, p * kNP, ncols);
    });
    return;
  }
  // Blocks as in linear.cpp: input rows in blocks of ~256 KiB (L2); k in blocks of up to 288 pairs (an 18 KiB
  // weight sub-panel stays in L1 across the block's row tiles) except for a few rows.
  const int64_t kpc = M <= kMR ? kp_total : cdiv(kp_total, cdiv(kp_total, 288));
  const int64_t mc = row_block_rows(M, K * static_cast<int64_t>(sizeof(uint16_t)), kMR);
  const auto block = [&](int64_t m0, int64_t mcur, int64_t p, int ncols, int64_t k0, int64_t kcur) {
    const bool first = k0 == 0, last = k0 + kcur == kp_total;
    const uint16_t* panel = wp + (p * kp_total + k0) * kNP * 2;
    const uint16_t* xp = x + m0 * K + 2 * k0;
    for_each_even_tile(mcur, kMR, [&](int64_t i, int rows) {
      tail_tile<kMR>(rows, xp + i * K, K, panel, kcur, o, m0 + i, p * kNP, ncols, first, last);
    });
    if (o.stream && last) _mm_sfence();  // streamed rows are visible before the threads join
  };
  for_each_gemm_block(M, N, kNP, kp_total, kpc, mc, block);
}

#endif

}  // namespace

// Whether this build has the pair-panel kernels (AVX512-BF16).
bool linear_bf16_pairs_supported() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

// Whether the pair panels run on AMX tiles here (the CPU has AMX-BF16 and the tile path is not turned off).
bool linear_bf16_amx_active() {
#if defined(__AVX512BF16__)
  return amx::active(amx::kBf16);
#else
  return false;
#endif
}

// Turn the AMX tile paths (bf16 and int8) on or off (tests and benchmarks compare them with the vector kernels);
// returns the old state.
bool linear_amx_set_enabled(bool on) { return amx::wanted().exchange(on); }

// w [N, K] bf16, K even -> pair panels [ceil(N / kNP), K / 2, kNP, 2] bf16, zero rows past N.
at::Tensor pack_linear_weight_bf16_pairs(at::Tensor w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16, "pack_linear_weight_bf16_pairs: w [N, K] bf16");
  const int64_t N = w.size(0), K = w.size(1), P = cdiv(N, kNP);
  TORCH_CHECK(K % 2 == 0, "pack_linear_weight_bf16_pairs: K must be even");
  auto padded = at::zeros({P * kNP, K}, w.options());
  padded.narrow(0, 0, N).copy_(w);
  return padded.view({P, kNP, K / 2, 2}).permute({0, 2, 1, 3}).contiguous();
}

// x [M, K] (bf16, or converted to it); wp from pack_linear_weight_bf16_pairs; bias [N] or undefined. Returns [M, N]
// in x's dtype.
at::Tensor linear_bf16_pairs(at::Tensor x, at::Tensor wp, int64_t n, c10::optional<at::Tensor> bias) {
  TORCH_CHECK(linear_bf16_pairs_supported(), "linear_bf16_pairs: this build has no AVX512-BF16 kernels");
  TORCH_CHECK(x.dim() == 2 && wp.dim() == 4 && wp.size(2) == kNP && wp.size(3) == 2 && x.size(1) == 2 * wp.size(1),
              "linear_bf16_pairs: x [M, K], wp [P, K / 2, ", kNP, ", 2]");
  TORCH_CHECK(wp.is_contiguous() && wp.scalar_type() == at::kBFloat16, "linear_bf16_pairs: contiguous bf16 wp");
  TORCH_CHECK(n > (wp.size(0) - 1) * kNP && n <= wp.size(0) * kNP, "linear_bf16_pairs: n does not match the panels");
  const int64_t M = x.size(0), K = x.size(1);
  auto xb = x.to(at::kBFloat16).contiguous();
  const bool out_bf16 = x.scalar_type() == at::kBFloat16;
  auto y = at::empty({M, n}, x.options().dtype(out_bf16 ? at::kBFloat16 : at::kFloat));
  at::Tensor bias_f32;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == n, "linear_bf16_pairs: bias [N]");
    bias_f32 = bias->to(at::kFloat).contiguous();
  }
#if defined(__AVX512BF16__)
  if (M > 0) {
    // fp32 partial sums only where k is split in blocks (batched rows and K over 576).
    at::Tensor partial;
    if (!amx::active(amx::kBf16) && M > kMR && K / 2 > 288) partial = at::empty({M, n}, x.options().dtype(at::kFloat));
    Out o{partial.defined() ? partial.data_ptr<float>() : nullptr,
          out_bf16 ? reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>()) : nullptr,
          out_bf16 ? nullptr : y.data_ptr<float>(), bias_f32.defined() ? bias_f32.data_ptr<float>() : nullptr, n};
    // An LM head's logits (tens of MB) are read once, by the sampler, after every row is written: writing them
    // past the caches spares reading each line in first.
    o.stream = out_bf16 && n % kNP == 0 && reinterpret_cast<uintptr_t>(o.out_bf16) % 64 == 0 &&
               M * n * static_cast<int64_t>(sizeof(uint16_t)) >= (16 << 20);
    gemm_pairs(reinterpret_cast<const uint16_t*>(xb.data_ptr<at::BFloat16>()),
               reinterpret_cast<const uint16_t*>(wp.data_ptr<at::BFloat16>()), o, M, n, K);
  }
#endif
  return y.scalar_type() == x.scalar_type() ? y : y.to(x.scalar_type());
}

// Linear layers on the CPU for every batch size: y [M, N] = x [M, K] @ w [N, K]^T (+ bias [N]), with the weight
// held once, in kvserve's own panel layout (pack_linear_weight), for fp32 (and bf16) weights.
//
// Panel layout: the weight rows are grouped in panels of kNP (two vectors' width); a panel is stored k-major,
// [num_panels, K, kNP], zero-padded past N. Both ends of the batch range read it well:
// - batch-1 decode is a matrix-vector product bound by streaming the weights: each thread reads its panels
//   front to back, one sequential stream the hardware prefetcher follows;
// - bigger batches run a register-tiled GEMM: kMR input rows x one panel of accumulators, or kMR2 rows x two
//   adjacent panels (AVX-512; AVX2 for 2-3 rows); each k step loads the panels' weight vectors for this k and
//   broadcasts one input value a row, with no horizontal sums. The input block stays in L2 and the weight
//   sub-panels in L1 across the row tiles (blocks of mc rows and kc).
// BLAS GEMMs on plain weights copy ("pack") the weight panel on every call, which at decode batch sizes costs
// about as much as the arithmetic; oneDNN avoids it with its own prepacked copy, but that layout is opaque and its
// batch-1 GEMV reads it slower than a plain stream (docs/benchmarks.md), so keeping both would double the model's
// memory. Products and sums are fp32.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <limits>

#include "panel_loops.h"
#include "simd.h"

namespace {

using namespace kvserve;

constexpr int kNV = 2;         // vectors per panel row
constexpr int kNP = kNV * kW;  // panel width: weight rows per panel
// Row tile: kMR x kNV accumulators, kNV weight vectors and one broadcast must fit in the vector registers.
constexpr int kMR = kNumVecRegs >= 32 ? 12 : 6;
static_assert(kMR * kNV + kNV + 1 <= kNumVecRegs, "row tile does not fit in the vector registers");
// Pair tiles: kMR2 input rows x two adjacent panels. On AVX-512, for every batch: a k step loads 4 weight vectors
// and broadcasts 6 inputs for the same 24 FMAs (kMR x one panel: 2 and 12), the x rows a tile re-reads from L2
// halve, and below kMR rows a tile has twice the independent FMA chains and two weight streams. Against kMR x one
// panel, the 30 layers' four shapes alternated layer by layer (kind C, 2 threads): 1.02-1.04x at 2,048 rows,
// 1.01-1.05x at 8-512, 1.21-1.27x at 2-6 rows. AVX2 (16 registers: 12 accumulators, 3 broadcasts and one weight
// vector at a time) takes them for 2-3 rows only, where one chain per accumulator left the FMAs waiting on their
// latency: 1.25x / 1.20x there, 0.96-1.05x from 6 rows up (forced AVX2 on kind C; docs/benchmarks.md).
constexpr int kMR2 = kNumVecRegs >= 32 ? 6 : 3;
constexpr int64_t kPairMaxRows = kNumVecRegs >= 32 ? std::numeric_limits<int64_t>::max() : kMR2;
static_assert(kMR2 * 2 * kNV + 2 <= kNumVecRegs, "pair tile accumulators do not fit in the vector registers");
// Cache lines in one k row of a panel (kNP weights of type T), and in kc of them.
template <typename T>
constexpr int kRowLines = static_cast<int>(kNP * sizeof(T) + 63) / 64;
static_assert(kNP * sizeof(float) <= 128, "a tile's share of the next weights is fetched one line a k step");
template <typename T>
int64_t panel_lines(int64_t kc) {
  return (kc * kNP * static_cast<int64_t>(sizeof(T)) + 63) / 64;
}

// Weights a tile fetches while it runs (panel_loops.h, prefetch_l1): `lines` cache lines from `at`, kRate of them
// a k step: some of the weights this thread reads after the tile's own.
struct Fetch {
  const char* at = nullptr;
  int64_t lines = 0;
};

// Tile t of n's even share of f's lines (nothing where f is empty).
inline Fetch share_of(const Fetch& f, int64_t t, int64_t n) {
  if (f.at == nullptr) return {};
  const int64_t share = cdiv(f.lines, n), from = std::min(f.lines, t * share);
  return {f.at + from * 64, std::min(share, f.lines - from)};
}

// y[0..MR)[0..ncols) (+)= x[0..MR)[0..kc) @ the NP adjacent panels from `panel` (pstride elements apart), rows
// [0, kc) of each; x rows have stride ldx, y rows stride ldy. kRate: cache lines of `f` (and, in a pair tile, of `g`)
// fetched a k step (a template value, so that the tiles without it keep the loop they had).
template <int MR, int NP = 1, int kRate = 0, typename T>
inline void row_tile(const float* x, int64_t ldx, const T* panel, int64_t pstride, int64_t kc, float* y, int64_t ldy,
                     int ncols, bool accumulate, Fetch f = {}, Fetch g = {}) {
  constexpr int NV = NP * kNV;
  vf acc[MR][NV];
  alignas(64) float tmp[NP * kNP];
  for (int i = 0; i < MR; ++i)
    for (int v = 0; v < NV; ++v) acc[i][v] = vzero();
  if (accumulate) {
    for (int i = 0; i < MR; ++i) {
      const float* src = y + i * ldy;
      if (ncols < NP * kNP) {
        std::copy(src, src + ncols, tmp);
        src = tmp;
      }
      for (int v = 0; v < NV; ++v) acc[i][v] = vload(src + v * kW);
    }
  }
  for (int64_t k = 0; k < kc; ++k) {
    vf w[NV];
    for (int q = 0; q < NP; ++q)
      for (int v = 0; v < kNV; ++v) w[q * kNV + v] = vload(panel + q * pstride + k * kNP + v * kW);
    if constexpr (kRate > 0) {
      if (k * kRate < f.lines)
        for (int b = 0; b < kRate; ++b) prefetch_l1(f.at + (k * kRate + b) * 64);
      if constexpr (NP > 1) {
        if (k * kRate < g.lines)
          for (int b = 0; b < kRate; ++b) prefetch_l1(g.at + (k * kRate + b) * 64);
      }
    }
    for (int i = 0; i < MR; ++i) {
      const vf b = vset(x[i * ldx + k]);
      for (int v = 0; v < NV; ++v) acc[i][v] = vfma(b, w[v], acc[i][v]);
    }
  }
  for (int i = 0; i < MR; ++i) {
    if (ncols == NP * kNP) {
      for (int v = 0; v < NV; ++v) vstore(y + i * ldy + v * kW, acc[i][v]);
    } else {
      for (int v = 0; v < NV; ++v) vstore(tmp + v * kW, acc[i][v]);
      std::copy(tmp, tmp + ncols, y + i * ldy);
    }
  }
}

// One input row (batch-1 decode) against NP consecutive panels: y[0..ncols) = x[0..K) @ panels. row_tile<1>
// on one panel chains every k step's FMAs through the same kNV accumulators, so the FMA latency, not memory,
// would set the pace; NP panels at once give NP x kNV independent chains (NP streams for the prefetcher). Each
// output still sums over k in order from zero, exactly as row_tile does, so a row's result does not depend on
// the batch it is in.
template <int NP, typename T>
inline void gemv_panels(const float* x, const T* panels, int64_t K, float* y, int ncols) {
  vf acc[NP][kNV];
  for (int p = 0; p < NP; ++p)
    for (int v = 0; v < kNV; ++v) acc[p][v] = vzero();
  for (int64_t k = 0; k < K; ++k) {
    const vf b = vset(x[k]);
    for (int p = 0; p < NP; ++p)
      for (int v = 0; v < kNV; ++v) acc[p][v] = vfma(b, vload(panels + (p * K + k) * kNP + v * kW), acc[p][v]);
  }
  alignas(64) float tmp[NP * kNP];
  for (int p = 0; p < NP; ++p)
    for (int v = 0; v < kNV; ++v) vstore(tmp + p * kNP + v * kW, acc[p][v]);
  std::copy(tmp, tmp + ncols, y);
}

// The last rows of a block (fewer than a full tile): the same tile with MR = rows, fetching f (and, in a pair, g)
// kRate lines a k step (-1: kRowLines, a lone tail's rate, which fetches all of the next weights).
template <int MR, int NP, int kRate = -1, typename T>
inline void tail_tile(int rows, const float* x, int64_t ldx, const T* panel, int64_t pstride, int64_t kc, float* y,
                      int64_t ldy, int ncols, bool accumulate, Fetch f, Fetch g = {}) {
  if constexpr (MR > 0) {
    if (rows == MR) {
      if (f.at != nullptr || g.at != nullptr)
        return row_tile<MR, NP, kRate < 0 ? kRowLines<T> : kRate>(x, ldx, panel, pstride, kc, y, ldy, ncols,
                                                                    accumulate, f, g);
      return row_tile<MR, NP>(x, ldx, panel, pstride, kc, y, ldy, ncols, accumulate);
    }
    tail_tile<MR - 1, NP, kRate>(rows, x, ldx, panel, pstride, kc, y, ldy, ncols, accumulate, f, g);
  }
}

template <typename T>
void gemm_panels(const float* x, const T* wp, float* y, int64_t M, int64_t N, int64_t K) {
  const int64_t num_panels = cdiv(N, kNP);
  if (M == 1) {
    constexpr int kGP = 4;  // panels per gemv call
    for_each_panel_group<kGP>(num_panels, N, kNP, [&](int64_t p, bool whole, int ncols) {
      const T* panels = wp + p * K * kNP;
      if (whole) gemv_panels<kGP>(x, panels, K, y + p * kNP, ncols);
      else gemv_panels<1>(x, panels, K, y + p * kNP, ncols);
    });
    return;
  }
  // Blocks: input rows in blocks of at most ~256 KiB (they stay in L2 while every panel of the thread passes);
  // k in blocks of ~300 (a ~36 KiB fp32 weight sub-panel stays in L1 across the block's row tiles), except for a
  // few input rows, where each panel then streams front to back. Pair tiles (AVX-512) take k blocks of up to 576,
  // two ~72 KiB sub-panels read from L2: against pairs of ~150 (in L1), the 30 layers sustained at 2 threads ran
  // 1.08x at 2,048 rows (490 vs 455 GFLOP/s, oneDNN's prepacked linear 495) and 1.05x at 64; 112 and 192 gained
  // nothing or less, the whole of K (1,536) less than 576 (kind A, Zen 5; kind C not re-measured). Sums are in
  // the same k order either way.
  const bool pairs = M <= kPairMaxRows;
  const int64_t kc = M <= kMR ? K : cdiv(K, cdiv(K, pairs ? 576 : 320));
  const int64_t mc = row_block_rows(M, K * static_cast<int64_t>(sizeof(float)), kMR);
  const auto single = [&](int64_t m0, int64_t mcur, int64_t p, int ncols, int64_t k0, int64_t kcur) {
    float* yp = y + m0 * N + p * kNP;
    const T* panel = wp + (p * K + k0) * kNP;
    const float* xp = x + m0 * K + k0;
    // The next kc rows of the weight stream ([P, K, kNP]) are fetched while this block's tiles run, each full tile
    // a share, one cache line a k step. Fetched all in the first tile (as a lone tile still does), that tile took
    // ~2.3x the time of the others (perf, kind C); spread, the 30 layers' GEMMs ran 1.06-1.08x faster at 64 rows
    // and 1.01-1.02x at 2,048 (1.03x / 1.035x forced to AVX2; docs/benchmarks.md).
    const T* next = p * K + k0 + 2 * kcur <= num_panels * K ? panel + kcur * kNP : nullptr;
    const int64_t tiles = mcur / kMR, lines = panel_lines<T>(kcur);
    const Fetch all = next != nullptr ? Fetch{reinterpret_cast<const char*>(next), lines} : Fetch{};
    int64_t i = 0;
    if (next != nullptr && tiles == 1) {
      row_tile<kMR, 1, kRowLines<T>>(xp, K, panel, 0, kcur, yp, N, ncols, k0 > 0, all);
      i = kMR;
    } else if (next != nullptr && tiles > 1) {
      // A share is <= kcur lines (lines <= 2 kcur): one line a k step suffices.
      for (int64_t t = 0; t < tiles; ++t, i += kMR)
        row_tile<kMR, 1, 1>(xp + i * K, K, panel, 0, kcur, yp + i * N, N, ncols, k0 > 0, share_of(all, t, tiles));
    }
    for (; i + kMR <= mcur; i += kMR) row_tile<kMR>(xp + i * K, K, panel, 0, kcur, yp + i * N, N, ncols, k0 > 0);
    if (i < mcur)
      tail_tile<kMR - 1, 1>(static_cast<int>(mcur - i), xp + i * K, K, panel, 0, kcur, yp + i * N, N, ncols, k0 > 0,
                            i == 0 ? all : Fetch{});
  };
  if (!pairs) {
    for_each_gemm_block(M, N, kNP, K, kc, mc, single);
  } else {
    // Two adjacent panels at a time (a thread's odd last panel alone). Each tile fetches a share of what the thread
    // reads after this block: both panels' next kc rows, or after their last k block the next two panels' first.
    for_each_gemm_block<2>(M, N, kNP, K, kc, mc, [&](int64_t m0, int64_t mcur, int64_t p, int ncols, int64_t k0,
                                                   int64_t kcur) {
      if (ncols <= kNP) return single(m0, mcur, p, ncols, k0, kcur);
      float* yp = y + m0 * N + p * kNP;
      const T* panel = wp + (p * K + k0) * kNP;
      const float* xp = x + m0 * K + k0;
      const int64_t pstride = K * kNP, lines = panel_lines<T>(kcur);
      const bool last = k0 + kcur >= K;
      const auto next = [&](int64_t q) {
        if (!last) return Fetch{reinterpret_cast<const char*>(panel + q * pstride + kcur * kNP), lines};
        if (p + 2 + q >= num_panels) return Fetch{};
        return Fetch{reinterpret_cast<const char*>(wp + (p + 2 + q) * pstride), lines};
      };
      const Fetch fa = next(0), fb = next(1);
      const int64_t tiles = mcur / kMR2;
      const bool tail = mcur % kMR2 != 0;
      int64_t i = 0;
      if (tiles >= 4) {  // half the tiles fetch the first panel's share, half the second's: <= kcur lines a tile
        const int64_t ta = tiles / 2;
        for (int64_t t = 0; t < tiles; ++t, i += kMR2) {
          const Fetch mine = t < ta ? share_of(fa, t, ta) : share_of(fb, t - ta, tiles - ta);
          row_tile<kMR2, 2, 1>(xp + i * K, K, panel, pstride, kcur, yp + i * N, N, ncols, k0 > 0, mine);
        }
      } else if (tiles > 0 && tiles + tail >= 2) {
        // 2-3 tiles, the tail counted: each fetches its share of both panels (<= kcur lines each), so that the
        // weight stream keeps going through every tile instead of only the first.
        const int64_t n = tiles + tail;
        for (int64_t t = 0; t < tiles; ++t, i += kMR2)
          row_tile<kMR2, 2, 1>(xp + i * K, K, panel, pstride, kcur, yp + i * N, N, ncols, k0 > 0,
                               share_of(fa, t, n), share_of(fb, t, n));
        if (tail)
          tail_tile<kMR2 - 1, 2, 1>(static_cast<int>(mcur - i), xp + i * K, K, panel, pstride, kcur, yp + i * N, N,
                                    ncols, k0 > 0, share_of(fa, tiles, n), share_of(fb, tiles, n));
        return;
      } else if (tiles > 0) {
        row_tile<kMR2, 2, kRowLines<T>>(xp, K, panel, pstride, kcur, yp, N, ncols, k0 > 0, fa, fb);
        i = kMR2;
      }
      for (; i + kMR2 <= mcur; i += kMR2)
        row_tile<kMR2, 2>(xp + i * K, K, panel, pstride, kcur, yp + i * N, N, ncols, k0 > 0);
      if (i < mcur)
        tail_tile<kMR2 - 1, 2>(static_cast<int>(mcur - i), xp + i * K, K, panel, pstride, kcur, yp + i * N, N, ncols,
                               k0 > 0, i == 0 ? fa : Fetch{}, i == 0 ? fb : Fetch{});
    });
  }
}

}  // namespace

int64_t linear_panel_width() { return kNP; }

// w [N, K] (fp32 or bf16) -> the panel layout [ceil(N / kNP), K, kNP], same dtype, zero rows past N.
// Written in one pass, panel by panel: a fresh page costs more to fault in than the copy itself in the VMs kvserve
// is measured on, so padding into one new buffer and transposing into another paid for the model's weights twice
// (the embedded model's fp32 linears: 0.52 s that way, 0.33 s this way, kind C).
at::Tensor pack_linear_weight(at::Tensor w) {
  TORCH_CHECK(w.dim() == 2, "pack_linear_weight: w [N, K]");
  const int64_t N = w.size(0), K = w.size(1), P = cdiv(N, kNP);
  auto src = w.contiguous();
  auto out = at::empty({P, K, kNP}, w.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, w.scalar_type(), "pack_linear_weight", [&] {
    const scalar_t* s = src.data_ptr<scalar_t>();
    scalar_t* d = out.data_ptr<scalar_t>();
    at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
      for (int64_t p = p0; p < p1; ++p) {
        const int64_t rows = std::min<int64_t>(kNP, N - p * kNP);
        scalar_t* panel = d + p * K * kNP;
        for (int64_t k = 0; k < K; ++k) {
          scalar_t* dst = panel + k * kNP;
          for (int64_t r = 0; r < rows; ++r) dst[r] = s[(p * kNP + r) * K + k];
          for (int64_t r = rows; r < kNP; ++r) dst[r] = scalar_t(0);
        }
      }
    });
  });
  return out;
}

// x [M, K]; wp from pack_linear_weight(w [N, K]) in x's dtype; bias [N] or undefined. Returns [M, N] in x's dtype.
at::Tensor linear_packed(at::Tensor x, at::Tensor wp, int64_t n, c10::optional<at::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2 && wp.dim() == 3 && wp.size(2) == kNP && x.size(1) == wp.size(1),
              "linear_packed: x [M, K], wp [P, K, ", kNP, "]");
  TORCH_CHECK(wp.is_contiguous() && x.scalar_type() == wp.scalar_type(), "linear_packed: contiguous wp, same dtype");
  TORCH_CHECK(n > (wp.size(0) - 1) * kNP && n <= wp.size(0) * kNP, "linear_packed: n does not match the panels");
  const int64_t M = x.size(0), K = x.size(1);
  auto xf = x.to(at::kFloat).contiguous();
  auto y = at::empty({M, n}, x.options().dtype(at::kFloat));
  if (M > 0) {
    dispatch_float(wp, [&](auto tag) {
      using T = decltype(tag);
      gemm_panels<T>(xf.data_ptr<float>(), wp.data_ptr<T>(), y.data_ptr<float>(), M, n, K);
    });
  }
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == n, "linear_packed: bias [N]");
    y.add_(bias->to(at::kFloat));
  }
  return y.scalar_type() == x.scalar_type() ? y : y.to(x.scalar_type());
}

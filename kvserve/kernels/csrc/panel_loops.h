// The loops the panel-layout linears share (linear.cpp: fp32/bf16 weights; linear_bf16.cpp: bf16 pairs;
// int8_linear.cpp: int8 codes): how the output panels are split over threads, how a GEMM walks its blocks, and how
// many input rows a GEMM block takes. The tiles themselves differ
// per weight type and stay in their files.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>

namespace kvserve {

inline int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// A GEMM block's first row tile fetches the weights the thread reads next (the panels lie in memory in the order a
// thread reads them): the hardware prefetcher restarts at every 4 KiB page of the weight stream, so without it the
// first tile of every (sub-)panel waits on memory (a decode step's weights come from DRAM, a prefill block's from
// L3). prefetch_l1 is an asm prefetch gcc does not count as a memory access ("r" operand, no clobber): with
// __builtin_prefetch in the k loop, gcc 12 stored the tile's accumulators to the stack on every k step (~2x slower).
inline void prefetch_l1(const void* p) {
#if defined(__x86_64__)
  asm volatile("prefetcht0 (%0)" : : "r"(p));
#else
  __builtin_prefetch(p, 0, 3);
#endif
}

// Batch-1 decode (GEMV): threads take groups of kGroup panels (each thread then streams whole groups, and a call
// covers kGroup panels of one pass over x); a thread's last panels, fewer than a group, go one per call.
// fn(p, whole_group, ncols): panels p.. (kGroup of them, or one), ncols output columns from p's first.
// for_each_panel_group_in: one thread's panels [p_begin, p_end) the same way (a caller's own parallel region).
template <int kGroup, typename F>
void for_each_panel_group_in(int64_t p_begin, int64_t p_end, int64_t n, int panel_width, const F& fn) {
  for (int64_t p = p_begin; p < p_end;) {
    const bool whole = p_end - p >= kGroup;
    const int width = (whole ? kGroup : 1) * panel_width;
    fn(p, whole, static_cast<int>(std::min<int64_t>(width, n - p * panel_width)));
    p += whole ? kGroup : 1;
  }
}

template <int kGroup, typename F>
void for_each_panel_group(int64_t num_panels, int64_t n, int panel_width, const F& fn) {
  at::parallel_for(0, num_panels, kGroup, [&](int64_t p_begin, int64_t p_end) {
    for_each_panel_group_in<kGroup>(p_begin, p_end, n, panel_width, fn);
  });
}

// Batched rows (GEMM): threads take whole panels; a thread walks input rows in blocks of `mc`, then its panels
// kGroup at a time (adjacent panels of its share; its last group may hold fewer), then k from 0 in blocks of `kc`
// (a tile resumes from its partial sums after the first k block, so every output still sums k in order).
// fn(m0, mcur, p, ncols, k0, kcur): rows [m0, m0 + mcur) x the group from panel p (ncols output columns from p's
// first; more than panel_width only where the group holds more than one panel) x k [k0, k0 + kcur), in whatever
// unit of k the caller's panels use. Threads split panels, not groups, so that their shares stay even.
template <int kGroup = 1, typename F>
void for_each_gemm_block(int64_t m, int64_t n, int panel_width, int64_t k, int64_t kc, int64_t mc, const F& fn) {
  at::parallel_for(0, cdiv(n, panel_width), 1, [&](int64_t p_begin, int64_t p_end) {
    for (int64_t m0 = 0; m0 < m; m0 += mc) {
      const int64_t mcur = std::min(mc, m - m0);
      for (int64_t p = p_begin; p < p_end; p += kGroup) {
        const int64_t panels = std::min<int64_t>(kGroup, p_end - p);
        const int ncols = static_cast<int>(std::min<int64_t>(panels * panel_width, n - p * panel_width));
        for (int64_t k0 = 0; k0 < k; k0 += kc) fn(m0, mcur, p, ncols, k0, std::min(kc, k - k0));
      }
    }
  });
}

// A block's mcur rows as near-equal row tiles of at most mr rows: fn(first row, rows). 13 rows in tiles of 12 go
// 7 + 6, not 12 + 1: a 1-row tile has too few independent accumulator chains to hide its dot product's latency
// and cost about half a full tile (bf16 and int8 kernels, kind A Zen 5). A row's sums do not depend on its tile.
template <typename F>
inline void for_each_even_tile(int64_t mcur, int mr, const F& fn) {
  const int64_t tiles = cdiv(mcur, mr);
  for (int64_t t = 0, i = 0; t < tiles; ++t) {
    const int rows = static_cast<int>(cdiv(mcur - i, tiles - t));
    fn(i, rows);
    i += rows;
  }
}

// Input rows per GEMM block: at most `budget` bytes of input (the block stays in L2 while a thread's panels pass
// over it), a multiple of the row tile `mr`, and blocks of near-equal size (no short last block when avoidable).
// Every block streams all the weights once more, so the budget is as large as L2 allows.
inline int64_t row_block_rows(int64_t m, int64_t row_bytes, int mr, int64_t budget = 256 << 10) {
  const int64_t most = std::max<int64_t>(mr, budget / row_bytes / mr * mr);
  return std::min(m, cdiv(cdiv(m, cdiv(m, most)), mr) * mr);
}

}  // namespace kvserve

// The loops the panel-layout linears share (linear.cpp: fp32/bf16 weights; int8_linear.cpp: int8 codes): how the
// output panels are split over threads, and how many input rows a GEMM block takes. The tiles themselves differ
// per weight type and stay in their files.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>

namespace kvserve {

inline int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Batch-1 decode (GEMV): threads take groups of kGroup panels (each thread then streams whole groups, and a call
// covers kGroup panels of one pass over x); a thread's last panels, fewer than a group, go one per call.
// fn(p, whole_group, ncols): panels p.. (kGroup of them, or one), ncols output columns from p's first.
template <int kGroup, typename F>
void for_each_panel_group(int64_t num_panels, int64_t n, int panel_width, const F& fn) {
  at::parallel_for(0, num_panels, kGroup, [&](int64_t p_begin, int64_t p_end) {
    for (int64_t p = p_begin; p < p_end;) {
      const bool whole = p_end - p >= kGroup;
      const int width = (whole ? kGroup : 1) * panel_width;
      fn(p, whole, static_cast<int>(std::min<int64_t>(width, n - p * panel_width)));
      p += whole ? kGroup : 1;
    }
  });
}

// Input rows per GEMM block: at most ~256 KiB of input (the block stays in L2 while a thread's panels pass over
// it), a multiple of the row tile `mr`, and blocks of near-equal size (no short last block when avoidable).
inline int64_t row_block_rows(int64_t m, int64_t row_bytes, int mr) {
  const int64_t most = std::max<int64_t>(mr, (256 << 10) / row_bytes / mr * mr);
  return std::min(m, cdiv(cdiv(m, cdiv(m, most)), mr) * mr);
}

}  // namespace kvserve

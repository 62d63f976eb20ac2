// Work sharing inside one OpenMP parallel region that a caller opens for several kernels in a row
// (decoder_layer_row.cpp: a whole batch-1 decoder layer), instead of one region (fork and join) per kernel.
#pragma once

#include <omp.h>

#include <algorithm>
#include <cstdint>

namespace kvserve {

struct RegionShare {
  int64_t begin, end;
};

// This thread's part of [0, n) in units of `unit` (the last part takes the remainder): contiguous parts in thread
// order, as at::parallel_for splits a range, so that a kernel's work items fall to the threads in the same order.
inline RegionShare region_share(int64_t n, int64_t unit = 1) {
  const int64_t threads = omp_get_num_threads(), t = omp_get_thread_num();
  const int64_t units = (n + unit - 1) / unit, per = (units + threads - 1) / threads;
  return {std::min(n, t * per * unit), std::min(n, (t + 1) * per * unit)};
}

}  // namespace kvserve

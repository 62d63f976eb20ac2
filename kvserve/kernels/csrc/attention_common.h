// Shared by the two paged-attention kernels (paged_attention.cpp, paged_attention_packed.cpp): the task order and
// the (head_dim, GQA group) shapes that have compiled fast paths.
#pragma once

#include <cstdint>
#include <type_traits>

namespace kvserve {

// Task order: 0, n-1, 1, n-2, ... at::parallel_for hands each thread a contiguous range of indices; with this
// order every range mixes early and late tasks, so the threads stay balanced when the work per task grows along
// the batch (the query tokens of one prompt chunk, each seeing one more key than the last).
inline int64_t interleaved(int64_t i, int64_t n) { return (i % 2 == 0) ? i / 2 : n - 1 - i / 2; }

// Calls f(std::integral_constant<int, HD>, std::integral_constant<int, G>) if (head_dim, group) is one of the
// instantiated shapes and returns true; returns false otherwise. One list for every fast path.
template <typename F>
bool with_head_shape(int64_t head_dim, int64_t group, F&& f) {
#define KVSERVE_SHAPE(HD_, G_)                                                 \
  if (head_dim == HD_ && group == G_) {                                        \
    f(std::integral_constant<int, HD_>{}, std::integral_constant<int, G_>{}); \
    return true;                                                               \
  }
  KVSERVE_SHAPE(64, 1) KVSERVE_SHAPE(64, 2) KVSERVE_SHAPE(64, 3) KVSERVE_SHAPE(64, 4) KVSERVE_SHAPE(64, 6)
  KVSERVE_SHAPE(64, 8) KVSERVE_SHAPE(128, 1) KVSERVE_SHAPE(128, 2) KVSERVE_SHAPE(128, 3) KVSERVE_SHAPE(128, 4)
  KVSERVE_SHAPE(128, 6) KVSERVE_SHAPE(128, 8)
#undef KVSERVE_SHAPE
  return false;
}

}  // namespace kvserve

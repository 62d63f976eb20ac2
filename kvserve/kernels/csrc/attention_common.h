// Shared by the two paged-attention kernels (paged_attention.cpp, paged_attention_packed.cpp): input checks, the
// task split and order, the online-softmax rescale, and the (head_dim, GQA group) shapes with compiled fast paths.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>

#include "region.h"

namespace kvserve {

struct PagedShape {
  int64_t num_seqs, num_heads, head_dim, block_size, num_kv_heads, table_stride;
  // The rows the tasks take when not every row of q (paged_attention.cpp: the rows outside the tile path's
  // chunks): task row i is rows[i], for i < num_seqs. nullptr: rows 0 .. num_seqs - 1.
  const int64_t* rows = nullptr;
  int64_t group() const { return num_heads / num_kv_heads; }
};

// q [S, H, D]; k_cache, v_cache [num_blocks, block_size, Hkv, D] (any order inside a block) of q's dtype or
// fp8 (the standard layout; paged_attention.cpp); block_table
// [S, max_blocks] int32; seq_lens [S] int64 (each >= 1).
inline PagedShape check_paged_inputs(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                     const at::Tensor& block_table, const at::Tensor& seq_lens) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(), "bad shapes");
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(), "inputs must be contiguous");
  TORCH_CHECK(block_table.scalar_type() == at::kInt && block_table.is_contiguous(), "block_table: int32");
  TORCH_CHECK(seq_lens.scalar_type() == at::kLong && seq_lens.is_contiguous(), "seq_lens: int64");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() || k_cache.scalar_type() == at::kFloat8_e4m3fn ||
                  k_cache.scalar_type() == at::kFloat8_e5m2,
              "the cache holds q's dtype or fp8");
  TORCH_CHECK(v_cache.scalar_type() == k_cache.scalar_type(), "k and v cache dtypes differ");
  PagedShape p{q.size(0), q.size(1), q.size(2), k_cache.size(1), k_cache.size(2), block_table.size(1)};
  TORCH_CHECK(k_cache.size(3) == p.head_dim && p.num_heads % p.num_kv_heads == 0, "head layout mismatch");
  return p;
}

// Task order: 0, n-1, 1, n-2, ... at::parallel_for hands each thread a contiguous range of indices; with this
// order every range mixes early and late tasks, so the threads stay balanced when the work per task grows along
// the batch (the query tokens of one prompt chunk, each seeing one more key than the last).
inline int64_t interleaved(int64_t i, int64_t n) { return (i % 2 == 0) ? i / 2 : n - 1 - i / 2; }

// A task is one sequence and a run of kv heads: all of them when there are enough sequences to keep every thread
// busy (a task then streams whole blocks front to back), otherwise one, so that a single long sequence still
// spreads over the threads.
inline int64_t heads_per_task(const PagedShape& p) {
  return p.num_seqs >= 2 * at::get_num_threads() ? p.num_kv_heads : 1;
}

// Runs every task over the threads in interleaved order. make_worker() is called once per thread's range and
// returns the callable worker(seq, first_kv_head), which owns that range's scratch buffers.
// Called inside a caller's own OpenMP region (decoder_layer_row.cpp runs a whole batch-1 layer in one), each of
// that region's threads runs its share of the tasks instead: the same tasks, so the same results bit for bit.
template <typename MakeWorker>
void parallel_over_tasks(const PagedShape& p, int64_t heads_per_task, MakeWorker&& make_worker) {
  const int64_t tasks_per_seq = p.num_kv_heads / heads_per_task, n = p.num_seqs * tasks_per_seq;
  const auto run = [&](int64_t begin, int64_t end) {
    if (begin >= end) return;
    auto worker = make_worker();
    for (int64_t i = begin; i < end; ++i) {
      const int64_t task = interleaved(i, n), seq = task / tasks_per_seq;
      worker(p.rows != nullptr ? p.rows[seq] : seq, (task % tasks_per_seq) * heads_per_task);
    }
  };
  if (omp_in_parallel()) {
    const RegionShare share = region_share(n);
    run(share.begin, share.end);
  } else {
    at::parallel_for(0, n, 1, run);
  }
}

// The first key position a query row of context length len sees: with a sliding window (window > 0), its last
// `window` keys, itself included (HF's `sliding_window`); otherwise 0. Kernels start at this position's block and
// never read the blocks before it, which the scheduler may already have given to other requests.
inline int64_t window_start(int64_t len, int64_t window) { return window > 0 && len > window ? len - window : 0; }

// Scores of the keys before the window start (the first `skip` of a block) get -inf, hence probability 0; rows of
// nq query heads, `stride` apart.
inline void mask_before_window(float* scores, int nq, int64_t stride, int64_t skip) {
  if (skip <= 0) return;
  for (int j = 0; j < nq; ++j)
    std::fill(scores + j * stride, scores + j * stride + skip, -std::numeric_limits<float>::infinity());
}

// Tree attention (speculative draft trees): per query row, an optional bit set of the keys it may not see among
// its own last 64 (bit b hides the key at position len - 1 - b; 0 for an ordinary causal row). Only a draft tree's
// query tokens are ever hidden, and a tree has at most 64 of them; the context before it is always visible.
// Returns the first row's bits, or nullptr for none ([S] int64 contiguous).
inline const int64_t* hidden_keys_ptr(const c10::optional<at::Tensor>& hidden, int64_t num_seqs) {
  if (!hidden.has_value() || !hidden->defined()) return nullptr;
  TORCH_CHECK(hidden->scalar_type() == at::kLong && hidden->is_contiguous() && hidden->dim() == 1 &&
                  hidden->size(0) == num_seqs,
              "hidden_keys: int64 [num_seqs] contiguous");
  return hidden->data_ptr<int64_t>();
}

// The row's hidden bits (hidden_keys_ptr), 0 without a tree.
inline uint64_t row_hidden_keys(const int64_t* hidden, int64_t s) {
  return hidden == nullptr ? 0 : static_cast<uint64_t>(hidden[s]);
}

// Scores of the keys of a block [start, start + n) that the row's tree mask hides get -inf, for nq query heads
// whose rows are `stride` apart. Loops over the set bits only: a no-op for an ordinary row (hidden = 0).
inline void mask_hidden_keys(float* scores, int nq, int64_t stride, uint64_t hidden, int64_t len, int64_t start,
                             int n) {
  if (start + n <= len - 64) return;  // the block lies wholly before the keys a word can name
  for (uint64_t h = hidden; h != 0; h &= h - 1) {
    const int64_t t = len - 1 - __builtin_ctzll(h) - start;
    if (t < 0 || t >= n) continue;
    for (int j = 0; j < nq; ++j) scores[j * stride + t] = -std::numeric_limits<float>::infinity();
  }
}

// The lanes of a 16-key sub-tile, whose lane 0 is the key at len - 1 - top, that the row's tree mask hides.
inline uint32_t hidden_lanes16(uint64_t hidden, int64_t top) {
  uint32_t lanes = 0;
  for (int t = 0; t < 16; ++t) {
    const int64_t b = top - t;
    if (b >= 0 && b < 64 && ((hidden >> b) & 1)) lanes |= 1u << t;
  }
  return lanes;
}

// ALiBi slopes as the kernels take them: none, or one fp32 slope per query head ([H] contiguous). Returns the
// first slope, or nullptr for none.
inline const float* alibi_slopes_ptr(const c10::optional<at::Tensor>& slopes, int64_t num_heads) {
  if (!slopes.has_value() || !slopes->defined()) return nullptr;
  TORCH_CHECK(slopes->scalar_type() == at::kFloat && slopes->is_contiguous() && slopes->dim() == 1 &&
                  slopes->size(0) == num_heads,
              "alibi_slopes: fp32 [num_heads] contiguous");
  return slopes->data_ptr<float>();
}

// ALiBi: adds slope_j * (key position - query position) to the scores of the n keys of a block, for nq query heads
// whose rows are `stride` apart; `rel0` is the block's first key position minus the query's. HF's BLOOM adds
// slope * key position instead, which differs by a constant along each row: the same softmax. Called once per
// block, outside the loops over tokens and dims; a no-op without slopes (nullptr).
inline void add_alibi(float* scores, int nq, int64_t stride, int n, const float* slopes, int64_t rel0) {
  if (slopes == nullptr) return;
  for (int j = 0; j < nq; ++j) {
    float* row = scores + j * stride;
    const float slope = slopes[j];
    for (int t = 0; t < n; ++t) row[t] += slope * static_cast<float>(rel0 + t);
  }
}

// Online softmax: moves the running max m to new_max and returns the factor by which sums and accumulators taken
// under the old max must be scaled (0 on the first update, when m is -inf).
inline float move_max(float& m, float new_max) {
  const float r = std::exp(m - new_max);
  m = new_max;
  return r;
}

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

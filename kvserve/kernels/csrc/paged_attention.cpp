// Paged attention for single-token queries (decodes) on the CPU.
//
// Reads keys and values straight through each sequence's block table, with no gathered copy of the context:
// in pure torch, the gather and relayout cost ~10x the attention math at batch 128 on this CPU.
// Work is split over (sequence, kv head) pairs; each pair keeps an online softmax over its context, one block at
// a time, for the G query heads that share the kv head (GQA). Math is fp32; inputs are fp32 or bf16.
// With AVX-512 the per-token work is vectorised over head_dim (a multiple of 16); otherwise plain loops run.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "attention_common.h"
#include "simd.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

using namespace kvserve;

constexpr int kMaxHeadDim = 256;
constexpr int kMaxGroup = 64;
constexpr int kMaxBlockSize = 1024;

// ---------------------------------------------------------------- the kernel

inline void prefetch_range(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(c + off, 0, 1);
}

// One task = one sequence and a run of `heads_per_task` kv heads. Whole token rows of a block are contiguous
// ([block_size, Hkv, D]), so a task that takes every kv head streams each block front to back, which the
// hardware prefetcher follows; a task per (sequence, kv head) would read 1/Hkv of every row with a stride and
// stall on memory latency (measured: ~75% of cycles waiting on loads).
template <typename T>
void decode_kernel(const T* q, const T* k_cache, const T* v_cache, const int32_t* block_table,
                   const int64_t* seq_lens, T* out, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
                   int64_t head_dim, int64_t block_size, int64_t table_stride, float scale,
                   int64_t heads_per_task) {
  const int group = static_cast<int>(num_heads / num_kv_heads);
  const int hd = static_cast<int>(head_dim);
  const int64_t tasks_per_seq = num_kv_heads / heads_per_task;
  const int64_t token_stride = num_kv_heads * head_dim;
  const int nq = static_cast<int>(heads_per_task) * group;  // query heads per task
  at::parallel_for(0, num_seqs * tasks_per_seq, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(nq * hd), acc(nq * hd), scores(nq * block_size), row(token_stride);
    std::vector<float> m(nq), l(nq);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t task = interleaved(i, num_seqs * tasks_per_seq);
      const int64_t s = task / tasks_per_seq;
      const int64_t h0 = (task % tasks_per_seq) * heads_per_task;  // first kv head of the task
      const int64_t len = seq_lens[s];
      const int64_t q0 = s * num_heads + h0 * group;  // first query head of the task
      for (int j = 0; j < nq; ++j) {
        load_row(q + (q0 + j) * head_dim, &qf[j * hd], hd);
        scale_row(&qf[j * hd], scale, hd);
        std::fill(&acc[j * hd], &acc[j * hd] + hd, 0.f);
        m[j] = -std::numeric_limits<float>::infinity();
        l[j] = 0.f;
      }
      const int32_t* table = block_table + s * table_stride;
      const int64_t row_len = heads_per_task * head_dim;
      for (int64_t start = 0; start < len; start += block_size) {
        const int64_t block = table[start / block_size];
        const int n = static_cast<int>(std::min(block_size, len - start));
        const int64_t base = block * block_size * token_stride + h0 * head_dim;
        // Blocks sit anywhere in the pool: while reading token t of this block, prefetch token t of the next,
        // which keeps loads in flight without flooding the fill buffers.
        const bool has_next = start + block_size < len;
        const int64_t next = has_next ? table[start / block_size + 1] * block_size * token_stride + h0 * head_dim : 0;
        const int64_t row_bytes = row_len * static_cast<int64_t>(sizeof(T));
        for (int t = 0; t < n; ++t) {
          if (has_next) prefetch_range(k_cache + next + t * token_stride, row_bytes);
          const float* k = row_as_float(k_cache + base + t * token_stride, row.data(), row_len);
          for (int j = 0; j < nq; ++j) scores[j * block_size + t] = dot(&qf[j * hd], k + (j / group) * hd, hd);
        }
        for (int j = 0; j < nq; ++j) {
          float* sc = &scores[j * block_size];
          float block_max = sc[0];
          for (int t = 1; t < n; ++t) block_max = std::max(block_max, sc[t]);
          const float new_max = std::max(m[j], block_max);
          const float rescale = std::exp(m[j] - new_max);  // 0 on the first block (m = -inf)
          l[j] = l[j] * rescale + exp_shift_sum(sc, new_max, n);
          m[j] = new_max;
          if (rescale != 1.f) scale_row(&acc[j * hd], rescale, hd);
        }
        for (int t = 0; t < n; ++t) {
          if (has_next) prefetch_range(v_cache + next + t * token_stride, row_bytes);
          const float* v = row_as_float(v_cache + base + t * token_stride, row.data(), row_len);
          for (int j = 0; j < nq; ++j) axpy(&acc[j * hd], scores[j * block_size + t], v + (j / group) * hd, hd);
        }
      }
      for (int j = 0; j < nq; ++j) {
        scale_row(&acc[j * hd], 1.f / l[j], hd);
        store_row(&acc[j * hd], out + (q0 + j) * head_dim, hd);
      }
    }
  });
}


#if defined(__AVX512F__)
// ---------------------------------------------------------------- fast path (head_dim 64/128, small GQA groups)
//
// Same task split and online softmax as decode_kernel, restructured so that the hot loops are short:
// - q.k: per query head, 16 tokens' dot products are accumulated as 16 vectors and reduced together by hsum16;
//   with a bf16 cache and AVX512-BF16, `dpbf16ps` multiplies raw bf16 q and k pairs (exact products, fp32 sums);
// - p.v: the G accumulators of a kv head stay in registers while a block's tokens stream through.
template <int HD, int G, typename T>
struct FastDecode {
  static constexpr int NV = HD / 16;  // zmm per head row

  // Partial (16-lane) products of query head row q with key row k; summed across lanes later by hsum16.
  static inline __m512 dot_partial(const __m512* qf, const uint16_t* qb, const T* k) {
#if defined(__AVX512BF16__)
    if constexpr (std::is_same_v<T, at::BFloat16>) {
      const uint16_t* kb = reinterpret_cast<const uint16_t*>(k);
      __m512 acc = _mm512_setzero_ps();
      for (int c = 0; c < HD; c += 32)
        acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(qb + c), (__m512bh)_mm512_loadu_si512(kb + c));
      return acc;
    }
#endif
    (void)qb;
    __m512 acc = _mm512_mul_ps(qf[0], load16(k));
    for (int c = 1; c < NV; ++c) acc = _mm512_fmadd_ps(qf[c], load16(k + 16 * c), acc);
    return acc;
  }

  static void run(const T* q, const T* k_cache, const T* v_cache, const int32_t* block_table, const int64_t* seq_lens,
                  T* out, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t block_size,
                  int64_t table_stride, float scale, int64_t heads_per_task) {
    const int64_t tasks_per_seq = num_kv_heads / heads_per_task;
    const int64_t token_stride = num_kv_heads * HD;
    const int nq = static_cast<int>(heads_per_task) * G;
    at::parallel_for(0, num_seqs * tasks_per_seq, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> qf_all(nq * HD), acc(nq * HD), scores(nq * block_size), m(nq), l(nq);
      std::vector<uint16_t> qb_all(nq * HD);
      for (int64_t i = begin; i < end; ++i) {
        const int64_t task = interleaved(i, num_seqs * tasks_per_seq);
        const int64_t s = task / tasks_per_seq;
        const int64_t h0 = (task % tasks_per_seq) * heads_per_task;
        const int64_t len = seq_lens[s];
        const int64_t q0 = s * num_heads + h0 * G;
        for (int j = 0; j < nq; ++j) {
          load_row(q + (q0 + j) * HD, &qf_all[j * HD], HD);
          std::memcpy(&qb_all[j * HD], q + (q0 + j) * HD, sizeof(uint16_t) * (sizeof(T) == 2 ? HD : 0));
          std::fill(&acc[j * HD], &acc[j * HD] + HD, 0.f);
          m[j] = -std::numeric_limits<float>::infinity();
          l[j] = 0.f;
        }
        const int32_t* table = block_table + s * table_stride;
        for (int64_t start = 0; start < len; start += block_size) {
          const int64_t block = table[start / block_size];
          const int n = static_cast<int>(std::min(block_size, len - start));
          const bool has_next = start + block_size < len;
          const int64_t next_base = has_next ? table[start / block_size + 1] * block_size * token_stride : 0;
          const int64_t row_bytes = heads_per_task * HD * static_cast<int64_t>(sizeof(T));
          for (int hh = 0; hh < heads_per_task; ++hh) {
            const int64_t base = block * block_size * token_stride + (h0 + hh) * HD;
            // q.k for the G query heads of this kv head, 16 tokens at a time.
            for (int g = 0; g < G; ++g) {
              const int j = hh * G + g;
              __m512 qf[NV];
              for (int c = 0; c < NV; ++c) qf[c] = _mm512_loadu_ps(&qf_all[j * HD + 16 * c]);
              const uint16_t* qb = &qb_all[j * HD];
              for (int t0 = 0; t0 < n; t0 += 16) {
                const int cnt = std::min(16, n - t0);
                __m512 part[16];
                for (int tt = 0; tt < 16; ++tt)
                  part[tt] = tt < cnt ? dot_partial(qf, qb, k_cache + base + (t0 + tt) * token_stride)
                                      : _mm512_setzero_ps();
                const __m512 sc = _mm512_mul_ps(hsum16(part), _mm512_set1_ps(scale));
                _mm512_mask_storeu_ps(&scores[j * block_size + t0], static_cast<__mmask16>((1u << cnt) - 1), sc);
              }
            }
          }
          if (has_next)
            for (int t = 0; t < n; ++t) prefetch_range(k_cache + next_base + h0 * HD + t * token_stride, row_bytes);
          for (int j = 0; j < nq; ++j) {
            float* sc = &scores[j * block_size];
            const float new_max = std::max(m[j], max_of(sc, n));
            const float rescale = std::exp(m[j] - new_max);  // 0 on the first block (m = -inf)
            l[j] = l[j] * rescale + exp_shift_sum(sc, new_max, n);
            m[j] = new_max;
            if (rescale != 1.f) scale_row(&acc[j * HD], rescale, HD);
          }
          for (int hh = 0; hh < heads_per_task; ++hh) {
            const int64_t base = block * block_size * token_stride + (h0 + hh) * HD;
            __m512 a[G][NV];
            for (int g = 0; g < G; ++g)
              for (int c = 0; c < NV; ++c) a[g][c] = _mm512_loadu_ps(&acc[(hh * G + g) * HD + 16 * c]);
            for (int t = 0; t < n; ++t) {
              const T* vrow = v_cache + base + t * token_stride;
              __m512 v[NV];
              for (int c = 0; c < NV; ++c) v[c] = load16(vrow + 16 * c);
              for (int g = 0; g < G; ++g) {
                const __m512 p = _mm512_set1_ps(scores[(hh * G + g) * block_size + t]);
                for (int c = 0; c < NV; ++c) a[g][c] = _mm512_fmadd_ps(p, v[c], a[g][c]);
              }
            }
            for (int g = 0; g < G; ++g)
              for (int c = 0; c < NV; ++c) _mm512_storeu_ps(&acc[(hh * G + g) * HD + 16 * c], a[g][c]);
          }
          if (has_next)
            for (int t = 0; t < n; ++t) prefetch_range(v_cache + next_base + h0 * HD + t * token_stride, row_bytes);
        }
        for (int j = 0; j < nq; ++j) {
          scale_row(&acc[j * HD], 1.f / l[j], HD);
          store_row(&acc[j * HD], out + (q0 + j) * HD, HD);
        }
      }
    });
  }
};

// Runs the fast path if (head_dim, group) has an instantiation; returns false otherwise.
template <typename T>
bool decode_fast(const T* q, const T* kc, const T* vc, const int32_t* table, const int64_t* lens, T* out,
                 int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                 int64_t table_stride, float scale, int64_t heads_per_task) {
  return with_head_shape(head_dim, num_heads / num_kv_heads, [&](auto hd, auto g) {
    FastDecode<decltype(hd)::value, decltype(g)::value, T>::run(q, kc, vc, table, lens, out, num_seqs, num_heads,
                                                               num_kv_heads, block_size, table_stride, scale,
                                                               heads_per_task);
  });
}
#endif

}  // namespace

// q [S, H, D]; k_cache, v_cache [num_blocks, block_size, Hkv, D]; block_table [S, max_blocks] int32;
// seq_lens [S] int64 (each >= 1). Returns [S, H, D] in q's dtype.
at::Tensor paged_attention_decode(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache, at::Tensor block_table,
                                  at::Tensor seq_lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(), "bad shapes");
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(), "inputs must be contiguous");
  TORCH_CHECK(block_table.scalar_type() == at::kInt && block_table.is_contiguous(), "block_table: int32");
  TORCH_CHECK(seq_lens.scalar_type() == at::kLong && seq_lens.is_contiguous(), "seq_lens: int64");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type(), "q and cache dtypes differ");
  const int64_t num_seqs = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t block_size = k_cache.size(1), num_kv_heads = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == head_dim && num_heads % num_kv_heads == 0, "head layout mismatch");
  TORCH_CHECK(head_dim <= kMaxHeadDim && num_heads / num_kv_heads <= kMaxGroup && block_size <= kMaxBlockSize,
              "head_dim, GQA group or block size too large for the CPU decode kernel");
  auto out = at::empty_like(q);
  const float sc = static_cast<float>(scale);
  // Whole token rows per task when there are enough sequences to keep every thread busy; otherwise one task per
  // kv head, so that a single long sequence still spreads over the threads.
  const int64_t heads_per_task = num_seqs >= 2 * at::get_num_threads() ? num_kv_heads : 1;
#if defined(__AVX512F__)
  if (q.scalar_type() == at::kFloat &&
      decode_fast<float>(q.data_ptr<float>(), k_cache.data_ptr<float>(), v_cache.data_ptr<float>(),
                         block_table.data_ptr<int32_t>(), seq_lens.data_ptr<int64_t>(), out.data_ptr<float>(),
                         num_seqs, num_heads, num_kv_heads, head_dim, block_size, block_table.size(1), sc,
                         heads_per_task))
    return out;
  if (q.scalar_type() == at::kBFloat16 &&
      decode_fast<at::BFloat16>(q.data_ptr<at::BFloat16>(), k_cache.data_ptr<at::BFloat16>(),
                                v_cache.data_ptr<at::BFloat16>(), block_table.data_ptr<int32_t>(),
                                seq_lens.data_ptr<int64_t>(), out.data_ptr<at::BFloat16>(), num_seqs, num_heads,
                                num_kv_heads, head_dim, block_size, block_table.size(1), sc, heads_per_task))
    return out;
#endif
  if (q.scalar_type() == at::kFloat) {
    decode_kernel<float>(q.data_ptr<float>(), k_cache.data_ptr<float>(), v_cache.data_ptr<float>(),
                         block_table.data_ptr<int32_t>(), seq_lens.data_ptr<int64_t>(), out.data_ptr<float>(),
                         num_seqs, num_heads, num_kv_heads, head_dim, block_size, block_table.size(1), sc,
                         heads_per_task);
  } else if (q.scalar_type() == at::kBFloat16) {
    decode_kernel<at::BFloat16>(q.data_ptr<at::BFloat16>(), k_cache.data_ptr<at::BFloat16>(),
                                v_cache.data_ptr<at::BFloat16>(), block_table.data_ptr<int32_t>(),
                                seq_lens.data_ptr<int64_t>(), out.data_ptr<at::BFloat16>(), num_seqs, num_heads,
                                num_kv_heads, head_dim, block_size, block_table.size(1), sc, heads_per_task);
  } else {
    TORCH_CHECK(false, "unsupported dtype for the CPU decode kernel: ", q.scalar_type());
  }
  return out;
}

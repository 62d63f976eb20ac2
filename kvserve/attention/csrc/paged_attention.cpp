// Paged attention for single-token queries (decodes) on the CPU.
//
// Reads keys and values straight through each sequence's block table, with no gathered copy of the context:
// in pure torch, the gather and relayout cost ~10x the attention math at batch 128 on this CPU.
// Work is split over (sequence, kv head) pairs; each pair keeps an online softmax over its context, one block at
// a time, for the G query heads that share the kv head (GQA). Math is fp32; inputs are fp32 or bf16.
// With AVX-512 the per-token work is vectorised over head_dim (a multiple of 16); otherwise plain loops run.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

constexpr int kMaxHeadDim = 256;
constexpr int kMaxGroup = 64;
constexpr int kMaxBlockSize = 1024;

// ---------------------------------------------------------------- row conversion (fp32 / bf16 -> fp32)

inline void load_row(const float* src, float* dst, int n) {
  for (int i = 0; i < n; ++i) dst[i] = src[i];
}


inline void load_row(const at::BFloat16* src, float* dst, int n) {
#if defined(__AVX512F__)
  if (n % 16 == 0) {
    const uint16_t* bits = reinterpret_cast<const uint16_t*>(src);
    for (int i = 0; i < n; i += 16) {
      __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bits + i));
      __m512i w = _mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16);  // bf16 is the top half of an fp32
      _mm512_storeu_ps(dst + i, _mm512_castsi512_ps(w));
    }
    return;
  }
#endif
  for (int i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

// A cache row as fp32: fp32 rows are used in place, bf16 rows are converted into `buf`.
inline const float* row_as_float(const float* src, float* /*buf*/, int /*n*/) { return src; }
inline const float* row_as_float(const at::BFloat16* src, float* buf, int n) {
  load_row(src, buf, n);
  return buf;
}

inline void store_row(const float* src, float* dst, int n) { std::memcpy(dst, src, sizeof(float) * n); }

inline void store_row(const float* src, at::BFloat16* dst, int n) {
  for (int i = 0; i < n; ++i) dst[i] = at::BFloat16(src[i]);  // round to nearest even, as torch does
}

// ---------------------------------------------------------------- per-token primitives

inline float dot(const float* a, const float* b, int n) {
#if defined(__AVX512F__)
  if (n % 16 == 0) {
    __m512 acc = _mm512_setzero_ps();
    for (int i = 0; i < n; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
    return _mm512_reduce_add_ps(acc);
  }
#endif
  float s = 0.f;
  for (int i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

// acc = acc * scale_acc + p * row
inline void axpy(float* acc, float p, const float* row, int n) {
#if defined(__AVX512F__)
  if (n % 16 == 0) {
    const __m512 vp = _mm512_set1_ps(p);
    for (int i = 0; i < n; i += 16)
      _mm512_storeu_ps(acc + i, _mm512_fmadd_ps(vp, _mm512_loadu_ps(row + i), _mm512_loadu_ps(acc + i)));
    return;
  }
#endif
  for (int i = 0; i < n; ++i) acc[i] += p * row[i];
}

inline void scale_row(float* acc, float s, int n) {
  for (int i = 0; i < n; ++i) acc[i] *= s;
}

#if defined(__AVX512F__)
// exp(x) for x <= 0: 2^(x log2 e) split into an integer part (applied with scalef) and a fraction in
// [-0.5, 0.5] whose power of two comes from a degree-6 Taylor polynomial (relative error ~1e-7).
inline __m512 exp_ps(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.4426950408889634f));
  const __m512 k = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 y = _mm512_mul_ps(_mm512_sub_ps(t, k), _mm512_set1_ps(0.6931471805599453f));
  __m512 p = _mm512_set1_ps(1.0f / 720);
  p = _mm512_fmadd_ps(p, y, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, y, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, y, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, y, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, y, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, y, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, k);
}
#endif

// scores[t] <- exp(scores[t] - max), t < n; returns the sum.
inline float exp_shift_sum(float* scores, float max, int n) {
  int t = 0;
  float sum = 0.f;
#if defined(__AVX512F__)
  const __m512 vmax = _mm512_set1_ps(max);
  __m512 vsum = _mm512_setzero_ps();
  for (; t + 16 <= n; t += 16) {
    __m512 e = exp_ps(_mm512_sub_ps(_mm512_loadu_ps(scores + t), vmax));
    _mm512_storeu_ps(scores + t, e);
    vsum = _mm512_add_ps(vsum, e);
  }
  sum = _mm512_reduce_add_ps(vsum);
#endif
  for (; t < n; ++t) {
    scores[t] = std::exp(scores[t] - max);
    sum += scores[t];
  }
  return sum;
}

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
    for (int64_t task = begin; task < end; ++task) {
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

}  // namespace

// q [S, H, D]; k_cache, v_cache [num_blocks, block_size, Hkv, D]; block_table [S, max_blocks] int32;
// seq_lens [S] int64 (each >= 1). Returns [S, H, D] in q's dtype.
torch::Tensor paged_attention_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_table, torch::Tensor seq_lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(), "bad shapes");
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(), "inputs must be contiguous");
  TORCH_CHECK(block_table.scalar_type() == torch::kInt32 && block_table.is_contiguous(), "block_table: int32");
  TORCH_CHECK(seq_lens.scalar_type() == torch::kInt64 && seq_lens.is_contiguous(), "seq_lens: int64");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type(), "q and cache dtypes differ");
  const int64_t num_seqs = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t block_size = k_cache.size(1), num_kv_heads = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == head_dim && num_heads % num_kv_heads == 0, "head layout mismatch");
  TORCH_CHECK(head_dim <= kMaxHeadDim && num_heads / num_kv_heads <= kMaxGroup && block_size <= kMaxBlockSize,
              "head_dim, GQA group or block size too large for the CPU decode kernel");
  auto out = torch::empty_like(q);
  const float sc = static_cast<float>(scale);
  // Whole token rows per task when there are enough sequences to keep every thread busy; otherwise one task per
  // kv head, so that a single long sequence still spreads over the threads.
  const int64_t heads_per_task = num_seqs >= 2 * at::get_num_threads() ? num_kv_heads : 1;
  if (q.scalar_type() == torch::kFloat32) {
    decode_kernel<float>(q.data_ptr<float>(), k_cache.data_ptr<float>(), v_cache.data_ptr<float>(),
                         block_table.data_ptr<int32_t>(), seq_lens.data_ptr<int64_t>(), out.data_ptr<float>(),
                         num_seqs, num_heads, num_kv_heads, head_dim, block_size, block_table.size(1), sc,
                         heads_per_task);
  } else if (q.scalar_type() == torch::kBFloat16) {
    decode_kernel<at::BFloat16>(q.data_ptr<at::BFloat16>(), k_cache.data_ptr<at::BFloat16>(),
                                v_cache.data_ptr<at::BFloat16>(), block_table.data_ptr<int32_t>(),
                                seq_lens.data_ptr<int64_t>(), out.data_ptr<at::BFloat16>(), num_seqs, num_heads,
                                num_kv_heads, head_dim, block_size, block_table.size(1), sc, heads_per_task);
  } else {
    TORCH_CHECK(false, "unsupported dtype for the CPU decode kernel: ", q.scalar_type());
  }
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention_decode", &paged_attention_decode, "paged attention for single-token queries (CPU)");
}

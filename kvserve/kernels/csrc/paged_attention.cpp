// Paged attention for single-token query rows (decodes, and each token of a small prefill chunk) on the CPU.
//
// Reads keys and values straight through each sequence's block table, with no gathered copy of the context:
// in pure torch, the gather and relayout cost ~10x the attention math at batch 128.
// Each task (attention_common.h) keeps an online softmax over its context, one block at a time, for the G query
// heads that share a kv head (GQA). Math is fp32; inputs are fp32 or bf16. The fast path (head_dim 64/128, the
// groups of with_head_shape) is written once on vec.h's helpers and compiled for each ISA level; other shapes
// run plain loops. The cache holds q's dtype or fp8 (C below): fp8 rows are widened to fp32 as they are read, by
// the same vload / row_as_float helpers (vec.h, simd.h).

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
constexpr int64_t kSpanKeys = 256;  // keys per online-softmax step of the fast path (FastDecode::run)

inline void prefetch_range(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(c + off, 0, 1);
}

// Prefetches part `i` of `parts` of a row of `bytes`, split at cache lines. The fast kernel spreads a row's
// prefetches over the passes it makes anyway (query heads, vector columns): a burst of them stalls the loads the
// math is waiting on (measured, AVX2 fp32 at batch 64: whole rows at once made attention 1.4x slower, spreading
// each row over the passes 1.1x faster than one head's row per token).
inline void prefetch_part(const void* p, int64_t bytes, int i, int parts) {
  const int64_t lines = (bytes + 63) / 64;
  const char* c = static_cast<const char*>(p);
  for (int64_t l = i * lines / parts; l < (i + 1) * lines / parts; ++l) __builtin_prefetch(c + 64 * l, 0, 1);
}

// ---------------------------------------------------------------- any shape: plain loops over rows

// Whole token rows of a block are contiguous ([block_size, Hkv, D]), so a task that takes every kv head streams
// each block front to back, which the hardware prefetcher follows; a task per (sequence, kv head) would read
// 1/Hkv of every row with a stride and stall on memory latency (measured: ~75% of cycles waiting on loads).
template <typename T, typename C>
void decode_kernel(const T* q, const C* k_cache, const C* v_cache, const int32_t* block_table,
                   const int64_t* seq_lens, T* out, const PagedShape& p, float scale, int64_t hpt,
                   int64_t window, const float* alibi, const int64_t* hidden) {
  const int group = static_cast<int>(p.group());
  const int hd = static_cast<int>(p.head_dim);
  const int64_t block_size = p.block_size, token_stride = p.num_kv_heads * p.head_dim;
  const int nq = static_cast<int>(hpt) * group;  // query heads per task
  const int64_t row_len = hpt * p.head_dim;
  const int64_t row_bytes = row_len * static_cast<int64_t>(sizeof(C));
  parallel_over_tasks(p, hpt, [&] {
    return [&, qf = std::vector<float>(nq * hd), acc = std::vector<float>(nq * hd),
            scores = std::vector<float>(nq * block_size), row = std::vector<float>(token_stride),
            m = std::vector<float>(nq), l = std::vector<float>(nq)](int64_t s, int64_t h0) mutable {
      const int64_t len = seq_lens[s], lo = window_start(len, window);
      const uint64_t hid = row_hidden_keys(hidden, s);
      const int64_t q0 = s * p.num_heads + h0 * group;  // first query head of the task
      for (int j = 0; j < nq; ++j) {
        load_row(q + (q0 + j) * hd, &qf[j * hd], hd);
        scale_row(&qf[j * hd], scale, hd);
        std::fill(&acc[j * hd], &acc[j * hd] + hd, 0.f);
        m[j] = -std::numeric_limits<float>::infinity();
        l[j] = 0.f;
      }
      const int32_t* table = block_table + s * p.table_stride;
      for (int64_t start = lo / block_size * block_size; start < len; start += block_size) {
        const int64_t block = table[start / block_size];
        const int n = static_cast<int>(std::min(block_size, len - start));
        const int64_t base = block * block_size * token_stride + h0 * hd;
        // Blocks sit anywhere in the pool: while reading token t of this block, prefetch token t of the next,
        // which keeps loads in flight without flooding the fill buffers.
        const bool has_next = start + block_size < len;
        const int64_t next = has_next ? table[start / block_size + 1] * block_size * token_stride + h0 * hd : 0;
        for (int t = 0; t < n; ++t) {
          if (has_next) prefetch_range(k_cache + next + t * token_stride, row_bytes);
          const float* k = row_as_float(k_cache + base + t * token_stride, row.data(), row_len);
          for (int j = 0; j < nq; ++j) scores[j * block_size + t] = dot(&qf[j * hd], k + (j / group) * hd, hd);
        }
        mask_before_window(scores.data(), nq, block_size, lo - start);
        mask_hidden_keys(scores.data(), nq, block_size, hid, len, start, n);
        add_alibi(scores.data(), nq, block_size, n, alibi == nullptr ? nullptr : alibi + q0 % p.num_heads,
                  start - (len - 1));
        for (int j = 0; j < nq; ++j) {
          float* sc = &scores[j * block_size];
          const float new_max = std::max(m[j], max_of(sc, n));
          // A block wholly hidden by the tree before any visible key: probabilities 0, nothing to rescale.
          if (hid != 0 && new_max == -std::numeric_limits<float>::infinity()) {
            std::fill(sc, sc + n, 0.f);
            continue;
          }
          const float r = move_max(m[j], new_max);
          l[j] = l[j] * r + exp_shift_sum(sc, m[j], n);
          if (r != 1.f) scale_row(&acc[j * hd], r, hd);
        }
        for (int t = 0; t < n; ++t) {
          if (has_next) prefetch_range(v_cache + next + t * token_stride, row_bytes);
          const float* v = row_as_float(v_cache + base + t * token_stride, row.data(), row_len);
          for (int j = 0; j < nq; ++j) axpy(&acc[j * hd], scores[j * block_size + t], v + (j / group) * hd, hd);
        }
      }
      for (int j = 0; j < nq; ++j) {
        scale_row(&acc[j * hd], 1.f / l[j], hd);
        store_row(&acc[j * hd], out + (q0 + j) * hd, hd);
      }
    };
  });
}

// Block `start / block_size` of a row's context, as both passes over a softmax span (q.k, then p.v) walk it: its pool
// index, its keys (n), its offset in the span's scores, and the element offset of the next block (prefetched
// alongside) if the context goes on.
struct SpanBlock {
  int64_t block, next_base;
  int n, off;
  bool has_next;
};

inline SpanBlock span_block(const int32_t* table, int64_t start, int64_t span0, int64_t len, int64_t block_size,
                            int64_t token_stride) {
  const bool has_next = start + block_size < len;
  return {table[start / block_size], has_next ? table[start / block_size + 1] * block_size * token_stride : 0,
          static_cast<int>(std::min(block_size, len - start)), static_cast<int>(start - span0), has_next};
}

// ---------------------------------------------------------------- fast path (head_dim 64/128, small GQA groups)
//
// Same tasks and online softmax as decode_kernel, with short hot loops:
// - q.k: per query head, kW tokens' dot products are accumulated as kW vectors and reduced together by vhsum;
//   with a bf16 cache and AVX512-BF16, `dpbf16ps` multiplies raw bf16 q and k pairs (exact products, fp32 sums);
// - p.v: the accumulators stay in registers while a block's tokens stream through: all G x NV of them where they
//   fit (AVX-512's 32 registers), otherwise kPvCols kW-wide columns of the G heads a pass (AVX2's 16), re-reading
//   the block's V rows from L1 for each pass;
// - the running max and rescales step once per span of ~kSpanKeys keys, not per block.
//
// C: the cache's element type, T's or an fp8. An fp8 block's K rows of one kv head are widened to fp32 once
// (k_rows), not once per query head of the group, and the q.k loop reads them there; V rows are widened as
// the p.v loop loads them, once per element already.
template <int HD, int G, typename T, typename C = T>
struct FastDecode {
  static constexpr int NV = HD / kW;  // vectors per head row
  static constexpr bool kRowsInRegisters = (G + 1) * NV + 2 <= kNumVecRegs;
  // Columns per pass of accumulate_pv's column path: the most that divides NV with G * cols accumulators, G
  // broadcast probabilities and a V vector in registers.
  static constexpr int pv_cols() {
    int best = 1;
    for (int c = 1; c <= NV; ++c)
      if (NV % c == 0 && G * c + G + 1 <= kNumVecRegs) best = c;
    return best;
  }
  static constexpr int kPvCols = pv_cols();
  using KRow = std::conditional_t<kIsFp8<C>, float, C>;  // what the q.k loop reads K rows as

  // part[t]: the partial (kW-lane) products of query row q with key row k + t * stride, for t < cnt (zero
  // beyond); summed across lanes later by vhsum. The dims are the outer loop, so the kW tokens' FMAs form kW
  // independent chains that overlap in the pipeline: a loop per token is one chain of NV dependent FMAs, which
  // left q.k waiting on FMA latency (`perf annotate`, AVX2). Each lane still sums dims in order 0..NV-1, so the
  // result is the same as the loop per token's, bit for bit.
  static inline void dot_partials(const float* q, const uint16_t* qb, const KRow* k, int64_t stride, int cnt,
                                  vf* part) {
#if defined(__AVX512BF16__)
    if constexpr (std::is_same_v<KRow, at::BFloat16>) {
      for (int t = 0; t < kW; ++t) {
        if (t >= cnt) {
          part[t] = vzero();
          continue;
        }
        const uint16_t* kb = reinterpret_cast<const uint16_t*>(k + t * stride);
        __m512 acc = _mm512_setzero_ps();
        for (int c = 0; c < HD; c += 32)
          acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(qb + c), (__m512bh)_mm512_loadu_si512(kb + c));
        part[t] = acc;
      }
      return;
    }
#endif
    (void)qb;
    if (cnt == kW) {  // a whole run of tokens: fixed trip counts, every accumulator in a register
      vf a[kW];
      const vf q0 = vload(q);
#pragma GCC unroll 16
      for (int t = 0; t < kW; ++t) a[t] = vmul(q0, vload(k + t * stride));
#pragma GCC unroll 16
      for (int c = 1; c < NV; ++c) {
        const vf qc = vload(q + kW * c);
#pragma GCC unroll 16
        for (int t = 0; t < kW; ++t) a[t] = vfma(qc, vload(k + t * stride + kW * c), a[t]);
      }
#pragma GCC unroll 16
      for (int t = 0; t < kW; ++t) part[t] = a[t];
      return;
    }
    // The block's last, partial run: never read rows past the block's tokens (stale or unwritten).
    for (int t = 0; t < kW; ++t) {
      if (t >= cnt) {
        part[t] = vzero();
        continue;
      }
      vf acc = vmul(vload(q), vload(k + t * stride));
      for (int c = 1; c < NV; ++c) acc = vfma(vload(q + kW * c), vload(k + t * stride + kW * c), acc);
      part[t] = acc;
    }
  }

  // The n K rows (of one kv head, token_stride apart) as the q.k loop reads them: in place, or for an fp8 cache
  // widened into `buf` ([n, HD]). Sets `stride` to the distance between the returned rows.
  static inline const KRow* k_rows(const C* k, int64_t token_stride, int n, float* buf, int64_t& stride) {
    if constexpr (kIsFp8<C>) {
      for (int t = 0; t < n; ++t)
        for (int c = 0; c < NV; ++c) vstore(buf + t * HD + kW * c, vload(k + t * token_stride + kW * c));
      stride = HD;
      return buf;
    } else {
      (void)buf;
      stride = token_stride;
      return k;
    }
  }

  static void run(const T* q, const C* k_cache, const C* v_cache, const int32_t* block_table, const int64_t* seq_lens,
                  T* out, const PagedShape& p, float scale, int64_t hpt, int64_t window, const float* alibi,
                  const int64_t* hidden) {
    const int64_t block_size = p.block_size, token_stride = p.num_kv_heads * HD;
    // Keys per softmax step: as many whole blocks as fit in kSpanKeys (at least one), so that the running max, its
    // scalar exp and the rescales of every row come once per ~256 keys rather than per 16-key block. Alone, this
    // measured within the VM's noise (AVX2, fp32, G = 3: 1.25-1.84 ms a call in L2 against 1.17-2.09 per block).
    const int64_t span = std::max<int64_t>(1, kSpanKeys / block_size) * block_size;
    const int nq = static_cast<int>(hpt) * G;
    parallel_over_tasks(p, hpt, [&] {
      return [&, qf_all = std::vector<float>(nq * HD), qb_all = std::vector<uint16_t>(nq * HD),
              acc = std::vector<float>(nq * HD), scores = std::vector<float>(nq * span),
              kbuf = std::vector<float>(kIsFp8<C> ? block_size * HD : 0), m = std::vector<float>(nq),
              l = std::vector<float>(nq)](int64_t s, int64_t h0) mutable {
        const int64_t len = seq_lens[s], lo = window_start(len, window);
        const uint64_t hid = row_hidden_keys(hidden, s);
        const int64_t q0 = s * p.num_heads + h0 * G;
        for (int j = 0; j < nq; ++j) {
          load_row(q + (q0 + j) * HD, &qf_all[j * HD], HD);
          if constexpr (sizeof(T) == 2) std::memcpy(&qb_all[j * HD], q + (q0 + j) * HD, sizeof(uint16_t) * HD);
          std::fill(&acc[j * HD], &acc[j * HD] + HD, 0.f);
          m[j] = -std::numeric_limits<float>::infinity();
          l[j] = 0.f;
        }
        const int32_t* table = block_table + s * p.table_stride;
        for (int64_t span0 = lo / block_size * block_size; span0 < len; span0 += span) {
          const int span_n = static_cast<int>(std::min(span, len - span0));
          // q.k of the span's blocks into scores[j][0, span_n).
          for (int64_t start = span0; start < span0 + span_n; start += block_size) {
            const SpanBlock sb = span_block(table, start, span0, len, block_size, token_stride);
            const int64_t block = sb.block, next_base = sb.next_base;
            const int n = sb.n, off = sb.off;
            const bool has_next = sb.has_next;
            for (int hh = 0; hh < hpt; ++hh) {
              const int64_t base = block * block_size * token_stride + (h0 + hh) * HD;
              const C* next_k = has_next ? k_cache + next_base + (h0 + hh) * HD : nullptr;
              int64_t kstride;
              const KRow* krows = k_rows(k_cache + base, token_stride, n, kbuf.data(), kstride);
              // q.k for the G query heads of this kv head, kW tokens at a time.
              for (int g = 0; g < G; ++g) {
                const int j = hh * G + g;
                const float* qrow = &qf_all[j * HD];
                const uint16_t* qb = &qb_all[j * HD];
                float* srow = &scores[j * span + off];
                for (int t0 = 0; t0 < n; t0 += kW) {
                  const int cnt = std::min(kW, n - t0);
                  // While reading this head's rows of these tokens, fetch a G-th of the same rows of the next
                  // block (blocks sit anywhere in the pool, so the hardware prefetcher cannot guess where they are).
                  if (next_k != nullptr)
                    for (int tt = 0; tt < cnt; ++tt)
                      prefetch_part(next_k + (t0 + tt) * token_stride, HD * static_cast<int64_t>(sizeof(C)), g, G);
                  vf part[kW];
                  dot_partials(qrow, qb, krows + t0 * kstride, kstride, cnt, part);
                  const vf sc = vmul(vhsum(part), vset(scale));
                  vstore_n(srow + t0, sc, cnt);
                }
              }
            }
          }
          mask_before_window(scores.data(), nq, span, lo - span0);
          mask_hidden_keys(scores.data(), nq, span, hid, len, span0, span_n);
          add_alibi(scores.data(), nq, span, span_n, alibi == nullptr ? nullptr : alibi + q0 % p.num_heads,
                    span0 - (len - 1));
          for (int j = 0; j < nq; ++j) {
            float* sc = &scores[j * span];
            const float new_max = std::max(m[j], max_of(sc, span_n));
            // A span wholly hidden by the tree before any visible key: probabilities 0, nothing to rescale.
            if (hid != 0 && new_max == -std::numeric_limits<float>::infinity()) {
              std::fill(sc, sc + span_n, 0.f);
              continue;
            }
            const float r = move_max(m[j], new_max);
            l[j] = l[j] * r + exp_shift_sum(sc, m[j], span_n);
            if (r != 1.f) scale_row(&acc[j * HD], r, HD);
          }
          // p.v of the span's blocks.
          for (int64_t start = span0; start < span0 + span_n; start += block_size) {
            const SpanBlock sb = span_block(table, start, span0, len, block_size, token_stride);
            const int64_t block = sb.block, next_base = sb.next_base;
            const int n = sb.n, off = sb.off;
            const bool has_next = sb.has_next;
            for (int hh = 0; hh < hpt; ++hh)
              accumulate_pv(v_cache + block * block_size * token_stride + (h0 + hh) * HD,
                            has_next ? v_cache + next_base + (h0 + hh) * HD : nullptr, token_stride,
                            &scores[hh * G * span + off], span, n, &acc[hh * G * HD]);
          }
        }
        for (int j = 0; j < nq; ++j) {
          scale_row(&acc[j * HD], 1.f / l[j], HD);
          store_row(&acc[j * HD], out + (q0 + j) * HD, HD);
        }
      };
    });
  }

  // acc[g] += sum_t probs[g][t] * v[t] for the G query heads of one kv head, over n tokens of one block.
  // next_v: the same head's rows in the next block (prefetched alongside), or nullptr.
  static inline void accumulate_pv(const C* v, const C* next_v, int64_t token_stride, const float* probs,
                                   int64_t probs_stride, int n, float* acc) {
    constexpr int64_t kRowBytes = HD * static_cast<int64_t>(sizeof(C));
    if constexpr (kRowsInRegisters) {
      vf a[G][NV];
      for (int g = 0; g < G; ++g)
        for (int c = 0; c < NV; ++c) a[g][c] = vload(acc + g * HD + kW * c);
      for (int t = 0; t < n; ++t) {
        if (next_v != nullptr) prefetch_range(next_v + t * token_stride, kRowBytes);
        const C* vrow = v + t * token_stride;
        vf vv[NV];
        for (int c = 0; c < NV; ++c) vv[c] = vload(vrow + kW * c);
        for (int g = 0; g < G; ++g) {
          const vf pb = vset(probs[g * probs_stride + t]);
          for (int c = 0; c < NV; ++c) a[g][c] = vfma(pb, vv[c], a[g][c]);
        }
      }
      for (int g = 0; g < G; ++g)
        for (int c = 0; c < NV; ++c) vstore(acc + g * HD + kW * c, a[g][c]);
    } else {
      // kPvCols columns of the G heads at a time: G * kPvCols independent accumulator chains. One column at a
      // time (G chains, as few as 1-3) left the FMAs waiting on their own latency. With the q.k change: the kernel
      // in L2 ~536 -> ~374 cycles a key (AVX2, fp32, G = 3, 1 thread).
      for (int c0 = 0; c0 < NV; c0 += kPvCols) {
        vf a[G][kPvCols];
        for (int g = 0; g < G; ++g)
          for (int c = 0; c < kPvCols; ++c) a[g][c] = vload(acc + g * HD + kW * (c0 + c));
        for (int t = 0; t < n; ++t) {
          if (next_v != nullptr) prefetch_part(next_v + t * token_stride, kRowBytes, c0 / kPvCols, NV / kPvCols);
          const C* vrow = v + t * token_stride + kW * c0;
          vf pb[G];
          for (int g = 0; g < G; ++g) pb[g] = vset(probs[g * probs_stride + t]);
          for (int c = 0; c < kPvCols; ++c) {
            const vf vv = vload(vrow + kW * c);
            for (int g = 0; g < G; ++g) a[g][c] = vfma(pb[g], vv, a[g][c]);
          }
        }
        for (int g = 0; g < G; ++g)
          for (int c = 0; c < kPvCols; ++c) vstore(acc + g * HD + kW * (c0 + c), a[g][c]);
      }
    }
  }
};

}  // namespace

namespace kvserve {

// q [S, H, D]; k_cache, v_cache [num_blocks, block_size, Hkv, D] of q's dtype or fp8 (e4m3fn, e5m2: unscaled
// values, widened exactly); block_table [S, max_blocks] int32; seq_lens [S] int64 (each >= 1). Throws on bad inputs.
PagedShape paged_attention_decode_check(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                        const at::Tensor& block_table, const at::Tensor& seq_lens) {
  const PagedShape p = check_paged_inputs(q, k_cache, v_cache, block_table, seq_lens);
  TORCH_CHECK(p.head_dim <= kMaxHeadDim && p.group() <= kMaxGroup && p.block_size <= kMaxBlockSize,
              "head_dim, GQA group or block size too large for the CPU decode kernel");
  return p;
}

// The kernel on checked inputs, into out [S, H, D] (q's dtype): no allocation, nothing that throws, so that
// decoder_layer_row.cpp can call it inside its parallel region (each thread then runs its share of the tasks).
void paged_attention_decode_run(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                const at::Tensor& block_table, const at::Tensor& seq_lens, at::Tensor& out,
                                const PagedShape& p, float scale, int64_t window, const float* alibi,
                                const int64_t* hidden) {
  const int64_t hpt = heads_per_task(p);
  dispatch_float(q, [&](auto tag) {
    using T = decltype(tag);
    dispatch_kv_cache(k_cache, tag, [&](auto cache_tag) {
      using C = decltype(cache_tag);
      const T* qp = q.data_ptr<T>();
      const C* kc = static_cast<const C*>(k_cache.data_ptr());
      const C* vc = static_cast<const C*>(v_cache.data_ptr());
      const int32_t* table = block_table.data_ptr<int32_t>();
      const int64_t* lens = seq_lens.data_ptr<int64_t>();
      T* o = out.data_ptr<T>();
      const bool fast = with_head_shape(p.head_dim, p.group(), [&](auto hd, auto g) {
        FastDecode<decltype(hd)::value, decltype(g)::value, T, C>::run(qp, kc, vc, table, lens, o, p, scale, hpt,
                                                                        window, alibi, hidden);
      });
      if (!fast) decode_kernel<T, C>(qp, kc, vc, table, lens, o, p, scale, hpt, window, alibi, hidden);
    });
  });
}

// The tile path's declarations (paged_attention_chunk.cpp).
bool chunk_tiles_supported(const at::Tensor& q, const PagedShape& p);
void paged_attention_chunks_run(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                const at::Tensor& block_table, const at::Tensor& seq_lens, const int64_t* chunks,
                                int64_t num_chunks, at::Tensor& out, const PagedShape& p, float scale);

// chunks [C, 2] int64 (first row, rows), ascending and disjoint: each a run of one request's consecutive query
// tokens (seq_lens one more each row) with one block table. Returns the rows outside them, in order.
std::vector<int64_t> rows_outside_chunks(const at::Tensor& chunks, const at::Tensor& block_table,
                                         const at::Tensor& seq_lens, const PagedShape& p) {
  TORCH_CHECK(chunks.scalar_type() == at::kLong && chunks.dim() == 2 && chunks.size(1) == 2 && chunks.is_contiguous(),
              "chunks: int64 [C, 2]");
  const int64_t* c = chunks.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  const int32_t* table = block_table.data_ptr<int32_t>();
  std::vector<int64_t> rows;
  int64_t next = 0;
  for (int64_t i = 0; i < chunks.size(0); ++i) {
    const int64_t first = c[2 * i], n = c[2 * i + 1];
    TORCH_CHECK(first >= next && n >= 1 && first + n <= p.num_seqs, "chunks: ascending, disjoint runs of rows");
    const int64_t blocks = (lens[first + n - 1] + p.block_size - 1) / p.block_size;
    TORCH_CHECK(blocks <= p.table_stride, "chunks: a row sees more keys than its block table holds");
    for (int64_t r = first + 1; r < first + n; ++r)
      TORCH_CHECK(lens[r] == lens[first] + (r - first) &&
                      std::equal(table + first * p.table_stride, table + first * p.table_stride + blocks,
                                 table + r * p.table_stride),
                  "chunks: a chunk's rows are one request's consecutive query tokens");
    for (; next < first; ++next) rows.push_back(next);
    next = first + n;
  }
  for (; next < p.num_seqs; ++next) rows.push_back(next);
  return rows;
}

}  // namespace kvserve

// window: each row sees only its last `window` keys (0: all of them); alibi_slopes: none, or [H] fp32 ALiBi slopes
// (add_alibi); hidden_keys: none, or [S] int64 tree-attention bits (hidden_keys_ptr, attention_common.h); chunks:
// none, or runs of rows (rows_outside_chunks) that may take the tile path (paged_attention_chunk.cpp), where a
// token's result depends on its chunk (used where the inputs allow it: fp32, no window, ALiBi or tree). Returns
// [S, H, D] in q's dtype. Other arguments as paged_attention_decode_check takes them.
at::Tensor paged_attention_decode(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache, at::Tensor block_table,
                                  at::Tensor seq_lens, double scale, int64_t window,
                                  c10::optional<at::Tensor> alibi_slopes, c10::optional<at::Tensor> hidden_keys,
                                  c10::optional<at::Tensor> chunks) {
  const kvserve::PagedShape p = kvserve::paged_attention_decode_check(q, k_cache, v_cache, block_table, seq_lens);
  const float* alibi = kvserve::alibi_slopes_ptr(alibi_slopes, p.num_heads);
  const int64_t* hidden = kvserve::hidden_keys_ptr(hidden_keys, p.num_seqs);
  auto out = at::empty_like(q);
  const bool tiles = chunks.has_value() && chunks->defined() && chunks->numel() > 0 && window == 0 &&
                     alibi == nullptr && hidden == nullptr && kvserve::chunk_tiles_supported(q, p);
  if (!tiles) {
    kvserve::paged_attention_decode_run(q, k_cache, v_cache, block_table, seq_lens, out, p, static_cast<float>(scale),
                                        window, alibi, hidden);
    return out;
  }
  const std::vector<int64_t> rows = kvserve::rows_outside_chunks(*chunks, block_table, seq_lens, p);
  kvserve::paged_attention_chunks_run(q, k_cache, v_cache, block_table, seq_lens, chunks->data_ptr<int64_t>(),
                                      chunks->size(0), out, p, static_cast<float>(scale));
  if (!rows.empty()) {
    kvserve::PagedShape rest = p;
    rest.num_seqs = static_cast<int64_t>(rows.size());
    rest.rows = rows.data();
    kvserve::paged_attention_decode_run(q, k_cache, v_cache, block_table, seq_lens, out, rest,
                                        static_cast<float>(scale), window, alibi, hidden);
  }
  return out;
}

// Paged decode attention over the pair-packed bf16 cache (kv_layout.h), for CPUs with AVX512-BF16.
//
// Same tasks, online softmax and block-table reads as paged_attention.cpp (attention_common.h), but about half the instructions
// per cached token: q.k and p.v are both `vdpbf16ps` against broadcast pairs, with no horizontal sums and no
// bf16 -> fp32 widening of K/V. With the standard layout the kernel was compute-bound (~26 GB/s from L3, ~16 from
// memory, where a plain read gets ~50 GB/s); this one reads 27-44 GB/s from memory (batch 128, contexts of
// 100-640 tokens; scattered to adjacent blocks).
// Probabilities are rounded to bf16 for p.v, as flash-attention kernels do; scores, softmax and sums are fp32.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "attention_common.h"
#include "kv_layout.h"
#include "simd.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

using namespace kvserve;

#if defined(__AVX512BF16__)

inline __m512bh pair_bcast(const uint32_t* p) { return (__m512bh)_mm512_set1_epi32(static_cast<int>(*p)); }

// ALIBI: add each query head's slope times (key position - query position) to its scores (add_alibi in
// attention_common.h); a template flag, so the models without ALiBi run the sub-tile loop unchanged.
template <int HD, int G, bool ALIBI>
void packed_decode(const uint16_t* q, const uint16_t* k_cache, const uint16_t* v_cache, const int32_t* block_table,
                   const int64_t* seq_lens, at::BFloat16* out, const PagedShape& shape, float scale, int64_t hpt,
                   int64_t window, const float* alibi) {
  static_assert(kW == 16, "the packed layout's 16-token tiles are one AVX-512 vector");
  constexpr int NV = HD / 16;  // zmm per fp32 head row
  constexpr int NP = HD / 2;   // dim pairs per head
  const int64_t block_size = shape.block_size, table_stride = shape.table_stride;
  const int64_t tile = HD * block_size;  // one kv head's K (or V) within a block
  const int64_t block_elems = shape.num_kv_heads * tile;
  const int nq = static_cast<int>(hpt) * G;
  const __m512 vscale = _mm512_set1_ps(scale);
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const __m512 lane_index = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  parallel_over_tasks(shape, hpt, [&] {
    return [&, acc = std::vector<float>(nq * HD), m = std::vector<float>(nq),
            lsum = std::vector<float>(nq * 16)](int64_t s, int64_t h0) mutable {
      alignas(64) uint16_t p[G][16];  // one sub-tile's probabilities per query head, bf16
      const int64_t len = seq_lens[s], lo = window_start(len, window);
      const int64_t q0 = s * shape.num_heads + h0 * G;  // first query head of the task
      const uint32_t* qp = reinterpret_cast<const uint32_t*>(q + q0 * HD);  // its rows as bf16 pairs
      std::fill(acc.begin(), acc.end(), 0.f);
      std::fill(m.begin(), m.end(), -std::numeric_limits<float>::infinity());
      std::fill(lsum.begin(), lsum.end(), 0.f);
      const int32_t* table = block_table + s * table_stride;
      for (int64_t start = lo / block_size * block_size; start < len; start += block_size) {
        const int64_t block = table[start / block_size];
        const int n = static_cast<int>(std::min(block_size, len - start));
        const bool has_next = start + block_size < len;
        const int64_t next = has_next ? table[start / block_size + 1] : 0;
        // Keys of this block before the window: whole sub-tiles of them are skipped, the rest masked. The first
        // sub-tile taken holds the window's first key, so the running max is finite after it.
        const int skip = static_cast<int>(std::max<int64_t>(0, lo - start));
        for (int64_t hh = 0; hh < hpt; ++hh) {
          const int64_t head_off = (h0 + hh) * tile;
          const uint16_t* kt = k_cache + block * block_elems + head_off;
          const uint16_t* vt = v_cache + block * block_elems + head_off;
          // Blocks sit anywhere in the pool: fetch the next block's tiles of this head while this one computes,
          // a line or two per instruction group rather than in one burst that would fill the load queues.
          // (Measured: ~1.6x over no prefetch for scattered blocks, on par for adjacent ones; a burst
          // per block, or fetching two blocks ahead, did worse.)
          const bool fetch = has_next;
          const char* pf_k = reinterpret_cast<const char*>(k_cache + next * block_elems + head_off);
          const char* pf_v = reinterpret_cast<const char*>(v_cache + next * block_elems + head_off);
          const uint32_t* qh = qp + hh * G * NP;
          float* a_mem = &acc[hh * G * HD];
          for (int t0 = skip / 16 * 16; t0 < n; t0 += 16) {
            const int cnt = std::min(16, n - t0);
            // q.k for 16 tokens: lane t of s[g] is the score of token t0 + t. Two chains per head hide latency.
            __m512 s0[G], s1[G];
            for (int g = 0; g < G; ++g) s0[g] = s1[g] = _mm512_setzero_ps();
            for (int dp = 0; dp < NP; dp += 2) {
              if (fetch) {  // the K tile has two lines per iteration of this loop over the whole block
                const char* line = pf_k + ((t0 / 16) * (NP / 2) + dp / 2) * 128;
                __builtin_prefetch(line, 0, 1);
                __builtin_prefetch(line + 64, 0, 1);
              }
              const __m512bh k0 = (__m512bh)_mm512_loadu_si512(kt + (dp * block_size + t0) * 2);
              const __m512bh k1 = (__m512bh)_mm512_loadu_si512(kt + ((dp + 1) * block_size + t0) * 2);
              for (int g = 0; g < G; ++g) {
                s0[g] = _mm512_dpbf16_ps(s0[g], k0, pair_bcast(qh + g * NP + dp));
                s1[g] = _mm512_dpbf16_ps(s1[g], k1, pair_bcast(qh + g * NP + dp + 1));
              }
            }
            const __mmask16 valid =
                static_cast<__mmask16>(((1u << cnt) - 1) & ~((1u << std::max(0, skip - t0)) - 1));
            for (int g = 0; g < G; ++g) {
              const int j = static_cast<int>(hh) * G + g;
              // Lanes past the context get -inf, hence probability 0 (their cache slots hold stale finite values).
              __m512 sc = _mm512_mask_mul_ps(neg_inf, valid, _mm512_add_ps(s0[g], s1[g]), vscale);
              if constexpr (ALIBI) {  // -inf lanes stay -inf
                const float rel0 = static_cast<float>(start + t0 - (len - 1));
                const __m512 rel = _mm512_add_ps(lane_index, _mm512_set1_ps(rel0));
                sc = _mm512_fmadd_ps(_mm512_set1_ps(alibi[(q0 + j) % shape.num_heads]), rel, sc);
              }
              __m512 l = _mm512_loadu_ps(&lsum[j * 16]);
              // The running max rarely moves after the first tiles: test every lane before reducing any.
              if (_mm512_cmp_ps_mask(sc, _mm512_set1_ps(m[j]), _CMP_GT_OQ)) {
                const float r = move_max(m[j], _mm512_reduce_max_ps(sc));
                scale_row(a_mem + g * HD, r, HD);
                l = _mm512_mul_ps(l, _mm512_set1_ps(r));
              }
              const __m512 e = vexp(_mm512_sub_ps(sc, _mm512_set1_ps(m[j])));
              _mm512_storeu_ps(&lsum[j * 16], _mm512_add_ps(l, e));
              _mm256_store_si256(reinterpret_cast<__m256i*>(p[g]), (__m256i)_mm512_cvtneps_pbh(e));
            }
            // p.v, two tokens per instruction; the accumulators stay in registers across the sub-tile.
            __m512 a[G][NV];
            for (int g = 0; g < G; ++g)
              for (int c = 0; c < NV; ++c) a[g][c] = _mm512_loadu_ps(a_mem + g * HD + 16 * c);
            for (int tp = 0; tp < cnt; tp += 2) {
              const uint16_t* vrow = vt + (t0 + tp) * HD;  // the (t0 + tp, t0 + tp + 1) pair rows
              for (int c = 0; c < NV; ++c) {
                if (fetch) __builtin_prefetch(pf_v + (((t0 + tp) / 2) * NV + c) * 64, 0, 1);  // one line each
                const __m512bh vz = (__m512bh)_mm512_loadu_si512(vrow + 32 * c);
                for (int g = 0; g < G; ++g)
                  a[g][c] = _mm512_dpbf16_ps(a[g][c], vz, pair_bcast(reinterpret_cast<const uint32_t*>(p[g]) + tp / 2));
              }
            }
            for (int g = 0; g < G; ++g)
              for (int c = 0; c < NV; ++c) _mm512_storeu_ps(a_mem + g * HD + 16 * c, a[g][c]);
          }
        }
      }
      for (int j = 0; j < nq; ++j) {
        const float l = _mm512_reduce_add_ps(_mm512_loadu_ps(&lsum[j * 16]));
        scale_row(&acc[j * HD], 1.f / l, HD);
        store_row(&acc[j * HD], out + (q0 + j) * HD, HD);
      }
    };
  });
}

#endif

}  // namespace

// Whether this build runs the packed kernel for these shapes (bf16 caches only; blocks of whole 16-token tiles).
bool packed_kv_supported(int64_t head_dim, int64_t group, int64_t block_size) {
#if defined(__AVX512BF16__)
  return block_size % 16 == 0 && with_head_shape(head_dim, group, [](auto, auto) {});
#else
  (void)head_dim, (void)group, (void)block_size;
  return false;
#endif
}

// q [S, H, D] bf16; k_cache, v_cache [num_blocks, block_size, Hkv, D] bf16 holding the packed layout;
// block_table [S, max_blocks] int32; seq_lens [S] int64 (each >= 1); window: each row sees only its last `window`
// keys (0: all of them); alibi_slopes: none, or [H] fp32 ALiBi slopes. Returns [S, H, D] bf16.
at::Tensor paged_attention_packed(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache, at::Tensor block_table,
                                  at::Tensor seq_lens, double scale, int64_t window,
                                  c10::optional<at::Tensor> alibi_slopes) {
  const PagedShape p = check_paged_inputs(q, k_cache, v_cache, block_table, seq_lens);
  const float* alibi = alibi_slopes_ptr(alibi_slopes, p.num_heads);
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && k_cache.scalar_type() == at::kBFloat16, "packed cache: bf16 only");
  TORCH_CHECK(packed_kv_supported(p.head_dim, p.group(), p.block_size),
              "no packed decode kernel for this shape on this CPU");
  auto out = at::empty_like(q);
#if defined(__AVX512BF16__)
  with_head_shape(p.head_dim, p.group(), [&](auto hd, auto g) {
    constexpr int HD = decltype(hd)::value, G = decltype(g)::value;
    auto* run = alibi != nullptr ? &packed_decode<HD, G, true> : &packed_decode<HD, G, false>;
    run(reinterpret_cast<const uint16_t*>(q.data_ptr<at::BFloat16>()),
        reinterpret_cast<const uint16_t*>(k_cache.data_ptr<at::BFloat16>()),
        reinterpret_cast<const uint16_t*>(v_cache.data_ptr<at::BFloat16>()), block_table.data_ptr<int32_t>(),
        seq_lens.data_ptr<int64_t>(), out.data_ptr<at::BFloat16>(), p, static_cast<float>(scale), heads_per_task(p),
        window, alibi);
  });
#endif
  return out;
}

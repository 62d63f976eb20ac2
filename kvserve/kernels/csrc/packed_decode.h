// The pair-packed decode kernel (kv_layout.h), for CPUs with AVX512-BF16, templated on the cache's element type:
// bf16 (paged_attention_packed.cpp) or one-byte fp8 (paged_attention_packed_fp8.cpp, which compiles this header with
// AVX512-VBMI enabled for the fp8 widening). Both run the same `vdpbf16ps` loops; fp8 chunks are widened to bf16
// vectors as they are read, exactly (every fp8 value is a bf16 value), so the fp8 cache reads half the bytes for
// about two more instructions per 32 elements.
//
// Everything here has internal linkage: each file that includes it compiles its own copy under its own target
// options, so the linker can never pick a VBMI-compiled copy for the bf16 path.
#pragma once

#include <ATen/ATen.h>

#include "attention_common.h"
#include "kv_layout.h"
#include "simd.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

using namespace kvserve;

#if defined(__AVX512BF16__)

inline __m512bh pair_bcast(const uint32_t* p) { return (__m512bh)_mm512_set1_epi32(static_cast<int>(*p)); }

// acc + x . (the bf16 pair at p, broadcast): `vdpbf16ps` with an embedded-broadcast memory operand, one instruction
// where the intrinsics give two (compilers do not fold the broadcast into it).
inline __m512 dp_pair(__m512 acc, __m512bh x, const uint32_t* p) {
  asm("vdpbf16ps %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(x), "m"(*p));
  return acc;
}

// The bf16 bit pattern of each fp8 magnitude code (sign cleared), split into its high and low bytes: tables for
// `vpermt2b`, which looks a 64-byte register's bytes up in 128 entries by their low 7 bits.
template <typename F8>
struct Fp8Bf16Tables {
  alignas(64) uint8_t hi[128];
  alignas(64) uint8_t lo[128];
  Fp8Bf16Tables() {
    for (int m = 0; m < 128; ++m) {
      const float f = static_cast<float>(F8(static_cast<uint8_t>(m), F8::from_bits()));
      // The format's NaN code (e4m3fn: 0x7f) is never stored (write_kv stores NaN as 0): any pattern will do.
      const uint16_t b = std::isnan(f) ? 0 : c10::BFloat16(f).x;  // exact: bf16 holds every fp8 value
      hi[m] = static_cast<uint8_t>(b >> 8);
      lo[m] = static_cast<uint8_t>(b & 0xff);
    }
  }
};

// Widens one 64-byte chunk of an fp8 tile (kv_layout.h) to the two bf16 vectors it holds, in the order the bf16
// layout has them.
template <typename F8>
struct Fp8Widen {
  __m512i hi0, hi1, lo0, lo1;
  Fp8Widen() {
    static const Fp8Bf16Tables<F8> t;
    hi0 = _mm512_load_si512(t.hi);
    hi1 = _mm512_load_si512(t.hi + 64);
    lo0 = _mm512_load_si512(t.lo);
    lo1 = _mm512_load_si512(t.lo + 64);
  }
  void operator()(const uint8_t* chunk, __m512bh& first, __m512bh& second) const {
    const __m512i b = _mm512_loadu_si512(chunk);
    // hi | (b & 0x80): the magnitude's high byte with the code's sign bit.
    const __m512i hi =
        _mm512_ternarylogic_epi32(_mm512_permutex2var_epi8(hi0, b, hi1), b, _mm512_set1_epi8(char(0x80)), 0xF8);
    const __m512i lo = _mm512_permutex2var_epi8(lo0, b, lo1);
    first = (__m512bh)_mm512_unpacklo_epi8(lo, hi);
    second = (__m512bh)_mm512_unpackhi_epi8(lo, hi);
  }
};

// C: the cache's element type, uint16_t (bf16 bits) or Fp8E4M3 / Fp8E5M2.
// ALIBI: add each query head's slope times (key position - query position) to its scores (add_alibi in
// attention_common.h); a template flag, so the models without ALiBi run the sub-tile loop unchanged.
template <int HD, int G, bool ALIBI, typename C>
void packed_decode(const uint16_t* q, const C* k_cache, const C* v_cache, const int32_t* block_table,
                   const int64_t* seq_lens, at::BFloat16* out, const PagedShape& shape, float scale, int64_t hpt,
                   int64_t window, const float* alibi, const int64_t* hidden) {
  static_assert(kW == 16, "the packed layout's 16-token tiles are one AVX-512 vector");
  constexpr bool kFp8 = kIsFp8<C>;
  static_assert(kFp8 || std::is_same_v<C, uint16_t>, "bf16 bits or fp8");
  static_assert(!kFp8 || HD % 32 == 0, "fp8 V chunks hold 32 dims");
  constexpr int NV = HD / 16;  // zmm per fp32 head row
  constexpr int NP = HD / 2;   // dim pairs per head
  const int64_t block_size = shape.block_size, table_stride = shape.table_stride;
  const int64_t tile = HD * block_size;  // one kv head's K (or V) within a block, in elements
  const int64_t block_elems = shape.num_kv_heads * tile;
  const int nq = static_cast<int>(hpt) * G;
  const __m512 vscale = _mm512_set1_ps(scale);
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const __m512 lane_index = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  // Bytes of one K tile per (16-token sub-tile, two dim pairs), and of one V tile per (token pair, 32 dims): the
  // prefetch spreads the next block's tile over the loop iterations, a line or two at a time.
  constexpr int kLineK = kFp8 ? 64 : 128;
  parallel_over_tasks(shape, hpt, [&] {
    return [&, acc = std::vector<float>(nq * HD), m = std::vector<float>(nq),
            lsum = std::vector<float>(nq * 16)](int64_t s, int64_t h0) mutable {
      alignas(64) uint16_t p[G][16];  // one sub-tile's probabilities per query head, bf16
      [[maybe_unused]] const std::conditional_t<kFp8, Fp8Widen<C>, char> widen{};
      const int64_t len = seq_lens[s], lo = window_start(len, window);
      const uint64_t hid = row_hidden_keys(hidden, s);
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
          const C* kt = k_cache + block * block_elems + head_off;
          const C* vt = v_cache + block * block_elems + head_off;
          // Blocks sit anywhere in the pool: fetch the next block's tiles of this head while this one computes,
          // a line or two per instruction group rather than in one burst that would fill the load queues.
          // (Measured on bf16: ~1.6x over no prefetch for scattered blocks, on par for adjacent ones; a burst
          // per block, or fetching two blocks ahead, did worse.)
          const bool fetch = has_next;
          const char* pf_k = reinterpret_cast<const char*>(k_cache + next * block_elems + head_off);
          const char* pf_v = reinterpret_cast<const char*>(v_cache + next * block_elems + head_off);
          const uint32_t* qh = qp + hh * G * NP;
          float* a_mem = &acc[hh * G * HD];
          for (int t0 = skip / 16 * 16; t0 < n; t0 += 16) {
            const int cnt = std::min(16, n - t0);
            __mmask16 valid = static_cast<__mmask16>(((1u << cnt) - 1) & ~((1u << std::max(0, skip - t0)) - 1));
            const int64_t back = len - 1 - (start + t0);  // how far lane 0's key lies behind the row's own
            if (hid != 0 && back < 64 + 15) {  // tree attention: the keys the row may not see (its last 64) too
              valid &= static_cast<__mmask16>(~hidden_lanes16(hid, back));
              if (valid == 0) continue;  // nothing visible: the sub-tile adds nothing (and m may still be -inf)
            }
            // q.k for 16 tokens: lane t of s[g] is the score of token t0 + t. Two chains per head hide latency.
            __m512 s0[G], s1[G];
            for (int g = 0; g < G; ++g) s0[g] = s1[g] = _mm512_setzero_ps();
            for (int dp = 0; dp < NP; dp += 2) {
              if (fetch) {  // the K tile has kLineK bytes per iteration of this loop over the whole block
                const char* line = pf_k + ((t0 / 16) * (NP / 2) + dp / 2) * kLineK;
                __builtin_prefetch(line, 0, 1);
                if constexpr (!kFp8) __builtin_prefetch(line + 64, 0, 1);
              }
              __m512bh k0, k1;
              if constexpr (kFp8) {  // one chunk holds pairs dp and dp + 1 of the sub-tile's 16 tokens
                widen(reinterpret_cast<const uint8_t*>(kt) + ((dp / 2) * (block_size / 16) + t0 / 16) * 64, k0, k1);
              } else {
                k0 = (__m512bh)_mm512_loadu_si512(kt + (dp * block_size + t0) * 2);
                k1 = (__m512bh)_mm512_loadu_si512(kt + ((dp + 1) * block_size + t0) * 2);
              }
              for (int g = 0; g < G; ++g) {
                s0[g] = dp_pair(s0[g], k0, qh + g * NP + dp);
                s1[g] = dp_pair(s1[g], k1, qh + g * NP + dp + 1);
              }
            }
            for (int g = 0; g < G; ++g) {
              const int j = static_cast<int>(hh) * G + g;
              // Lanes past the context or hidden by a tree get -inf, hence probability 0 (their cache slots hold
              // stale finite values).
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
              const C* vrow = vt + (t0 + tp) * HD;  // the (t0 + tp, t0 + tp + 1) pair rows
              const int64_t pair = (t0 + tp) / 2;
              for (int c = 0; c < NV; c += 2) {
                __m512bh v0, v1;
                if constexpr (kFp8) {  // one chunk (one line) holds dims 16c .. 16c + 31 of the pair
                  if (fetch) __builtin_prefetch(pf_v + (pair * (NV / 2) + c / 2) * 64, 0, 1);
                  widen(reinterpret_cast<const uint8_t*>(vrow) + 32 * c, v0, v1);
                } else {
                  if (fetch) {  // one line each
                    __builtin_prefetch(pf_v + (pair * NV + c) * 64, 0, 1);
                    __builtin_prefetch(pf_v + (pair * NV + c + 1) * 64, 0, 1);
                  }
                  v0 = (__m512bh)_mm512_loadu_si512(vrow + 32 * c);
                  v1 = (__m512bh)_mm512_loadu_si512(vrow + 32 * (c + 1));
                }
                for (int g = 0; g < G; ++g) {
                  const __m512bh pp = pair_bcast(reinterpret_cast<const uint32_t*>(p[g]) + tp / 2);
                  a[g][c] = _mm512_dpbf16_ps(a[g][c], v0, pp);
                  a[g][c + 1] = _mm512_dpbf16_ps(a[g][c + 1], v1, pp);
                }
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

// Runs packed_decode for q's shape (bf16 q; C as above).
template <typename C>
void run_packed_decode(const at::Tensor& q, const C* k_cache, const C* v_cache, const at::Tensor& block_table,
                       const at::Tensor& seq_lens, at::Tensor& out, const PagedShape& p, float scale, int64_t window,
                       const float* alibi, const int64_t* hidden) {
  with_head_shape(p.head_dim, p.group(), [&](auto hd, auto g) {
    constexpr int HD = decltype(hd)::value, G = decltype(g)::value;
    if constexpr (!kIsFp8<C> || HD % 32 == 0) {
      auto* run = alibi != nullptr ? &packed_decode<HD, G, true, C> : &packed_decode<HD, G, false, C>;
      run(reinterpret_cast<const uint16_t*>(q.data_ptr<at::BFloat16>()), k_cache, v_cache,
          block_table.data_ptr<int32_t>(), seq_lens.data_ptr<int64_t>(), out.data_ptr<at::BFloat16>(), p, scale,
          heads_per_task(p), window, alibi, hidden);
    }
  });
}

#endif

}  // namespace

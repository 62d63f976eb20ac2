// Paged attention for the query tokens of a prompt chunk, in tiles (fp32 queries, the standard cache layout).
//
// The row kernel (paged_attention.cpp) walks a token's whole context once per query token, so a 384-token chunk
// reads each of its K/V rows up to 384 times and does one dot product per read: ~58 GFLOP/s on kind C in fp32,
// where the linears run at ~220. Here a task takes a tile of query vectors (consecutive tokens of one chunk x the
// G query heads of one kv head, one per vector lane) and every K or V element it reads serves all of them:
//   q.k:     s[t][lane]   += qt[d][lane] * k[t][d]   (the k element broadcast: no horizontal sums)
//   softmax: per lane, along the keys, so the running max, the exps and the sums are plain vector ops
//   p.v:     out[d][lane] += p[t][lane] * v[t][d]
// A lane's token sees the keys up to its own position; keys past it are -inf in that lane (causality).
//
// The sums run in another order than the row kernel's, so a token's output depends on how its prompt was cut:
// only the non-deterministic backend sends chunks here (attention/cpu_kernels.py), as it sends big ones to SDPA.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "attention_common.h"
#include "simd.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

using namespace kvserve;

// Vectors of query lanes in a tile: AVX-512's 2 x 16 lanes hold 10 tokens of a GQA-3 model, AVX2's 3 x 8 exactly
// 8, and its 16 registers still hold the 3 x 4 accumulators of a register block (AVX2, 1 thread, the same prompts:
// 1.35x the row walk with 3 vectors, 1.09x with 2).
constexpr int kNq = kNumVecRegs >= 32 ? 2 : 3;
constexpr int kLanes = kNq * kW;                     // query vectors in a tile
constexpr int kSpanKeys = 64;                        // keys per online-softmax step
constexpr int kKeysPerBlock = kNumVecRegs >= 32 ? 8 : 4;  // keys per q.k register block (kNq accumulators each)
constexpr int kDimsPerBlock = kNumVecRegs >= 32 ? 8 : 4;  // dims per p.v register block

template <int HD, typename C>
struct ChunkTiles {
  static_assert(HD % kDimsPerBlock == 0, "p.v blocks must tile the head");

  // s[t * kLanes + lane] = qt[.][lane] . k[t] for NK keys (k rows `stride` apart, fp32).
  template <int NK>
  static inline void qk_keys(const float* qt, const float* k, int64_t stride, float* s) {
    vf a[NK][kNq];
    for (int j = 0; j < NK; ++j)
      for (int c = 0; c < kNq; ++c) a[j][c] = vzero();
    for (int d = 0; d < HD; ++d) {
      vf q[kNq];
      for (int c = 0; c < kNq; ++c) q[c] = vload(qt + d * kLanes + c * kW);
      for (int j = 0; j < NK; ++j) {
        const vf kb = vset(k[j * stride + d]);
        for (int c = 0; c < kNq; ++c) a[j][c] = vfma(q[c], kb, a[j][c]);
      }
    }
    for (int j = 0; j < NK; ++j)
      for (int c = 0; c < kNq; ++c) vstore(s + j * kLanes + c * kW, a[j][c]);
  }

  static inline void qk(const float* qt, const float* k, int64_t stride, int n, float* s) {
    int t = 0;
    for (; t + kKeysPerBlock <= n; t += kKeysPerBlock) qk_keys<kKeysPerBlock>(qt, k + t * stride, stride, s + t * kLanes);
    for (; t + 2 <= n; t += 2) qk_keys<2>(qt, k + t * stride, stride, s + t * kLanes);
    for (; t < n; ++t) qk_keys<1>(qt, k + t * stride, stride, s + t * kLanes);
  }

  // out[d][lane] = out[d][lane] * r[lane] + sum_t p[t][lane] * v[t][d] for the span's n keys (vrows[t]: key t's V
  // row as fp32). One pass per group of dims over the whole span keeps the accumulators in registers for n keys.
  static inline void pv(const float* p, const float* const* vrows, int n, const vf* r, float* out) {
    for (int d0 = 0; d0 < HD; d0 += kDimsPerBlock) {
      vf a[kDimsPerBlock][kNq];
      for (int j = 0; j < kDimsPerBlock; ++j)
        for (int c = 0; c < kNq; ++c) a[j][c] = vmul(vload(out + (d0 + j) * kLanes + c * kW), r[c]);
      for (int t = 0; t < n; ++t) {
        vf pt[kNq];
        for (int c = 0; c < kNq; ++c) pt[c] = vload(p + t * kLanes + c * kW);
        const float* v = vrows[t] + d0;
        for (int j = 0; j < kDimsPerBlock; ++j) {
          const vf vb = vset(v[j]);
          for (int c = 0; c < kNq; ++c) a[j][c] = vfma(pt[c], vb, a[j][c]);
        }
      }
      for (int j = 0; j < kDimsPerBlock; ++j)
        for (int c = 0; c < kNq; ++c) vstore(out + (d0 + j) * kLanes + c * kW, a[j][c]);
    }
  }

  // n rows of one kv head (token_stride apart) as fp32: in place, or an fp8 cache's widened into buf [n, HD].
  static inline const float* rows(const C* x, int64_t token_stride, int n, float* buf, int64_t& stride) {
    if constexpr (std::is_same_v<C, float>) {
      (void)buf;
      stride = token_stride;
      return x;
    } else {
      for (int t = 0; t < n; ++t) load_row(x + t * token_stride, buf + t * HD, HD);
      stride = HD;
      return buf;
    }
  }

  // One tile: tokens [i0, i0 + nt) of the chunk whose first row is `row0` (that row sees len0 keys, each next row
  // one more), query heads h * G .. h * G + G - 1.
  struct Scratch {
    std::vector<float> qt, s, out, kbuf, vbuf;
    std::vector<const float*> vrows;  // the span's V rows as fp32
    explicit Scratch(int64_t span, int64_t block_size)
        : qt(HD * kLanes), s(span * kLanes), out(HD * kLanes), kbuf(kIsFp8<C> ? block_size * HD : 0),
          vbuf(kIsFp8<C> ? span * HD : 0), vrows(span) {}
  };

  static void tile(const float* q, const C* k_cache, const C* v_cache, const int32_t* table, int64_t row0,
                   int64_t len0, int64_t i0, int nt, int64_t h, float* o, const PagedShape& p, float scale,
                   int64_t span, Scratch& w) {
    const int G = static_cast<int>(p.group());
    const int64_t block_size = p.block_size, token_stride = p.num_kv_heads * HD;
    // Lane -> (token, head); lanes past the tile's tokens repeat its last token (computed, never stored), so
    // every lane sees key 0 and its running max is finite from the first span on.
    alignas(64) float pos[kLanes];
    for (int lane = 0; lane < kLanes; ++lane) {
      const int i = std::min(lane / G, nt - 1), g = lane % G;
      const float* qrow = q + ((row0 + i0 + i) * p.num_heads + h * G + g) * HD;
      for (int d = 0; d < HD; ++d) w.qt[d * kLanes + lane] = qrow[d] * scale;
      pos[lane] = static_cast<float>(len0 - 1 + i0 + i);  // the last key this lane sees
    }
    std::fill(w.out.begin(), w.out.end(), 0.f);
    vf m[kNq], l[kNq], posv[kNq];
    for (int c = 0; c < kNq; ++c) {
      m[c] = vset(-std::numeric_limits<float>::infinity());
      l[c] = vzero();
      posv[c] = vload(pos + c * kW);
    }
    const int64_t first_masked = len0 + i0;  // the first key some lane of the tile may not see
    const int64_t len = len0 + i0 + nt;      // keys the tile's last token sees
    float* s = w.s.data();
    for (int64_t span0 = 0; span0 < len; span0 += span) {
      const int span_n = static_cast<int>(std::min(span, len - span0));
      for (int64_t start = span0; start < span0 + span_n; start += block_size) {
        const int n = static_cast<int>(std::min(block_size, span0 + span_n - start));
        const int64_t base = table[start / block_size] * block_size * token_stride + h * HD;
        int64_t stride;
        const float* k = rows(k_cache + base, token_stride, n, w.kbuf.data(), stride);
        qk(w.qt.data(), k, stride, n, s + (start - span0) * kLanes);
      }
      vf mx[kNq];
      for (int c = 0; c < kNq; ++c) mx[c] = m[c];
      const vf neg_inf = vset(-std::numeric_limits<float>::infinity());
      for (int t = 0; t < span_n; ++t) {
        const int64_t key = span0 + t;
        for (int c = 0; c < kNq; ++c) {
          vf sc = vload(s + t * kLanes + c * kW);
          if (key >= first_masked) {
            sc = vselect(vgt(vset(static_cast<float>(key)), posv[c]), sc, neg_inf);
            vstore(s + t * kLanes + c * kW, sc);
          }
          mx[c] = vmax(mx[c], sc);
        }
      }
      vf r[kNq];
      for (int c = 0; c < kNq; ++c) {
        r[c] = vexp(vsub(m[c], mx[c]));  // 0 on the first span (m = -inf)
        vf sum = vzero();
        for (int t = 0; t < span_n; ++t) {
          const vf e = vexp(vsub(vload(s + t * kLanes + c * kW), mx[c]));
          vstore(s + t * kLanes + c * kW, e);
          sum = vadd(sum, e);
        }
        l[c] = vfma(l[c], r[c], sum);
        m[c] = mx[c];
      }
      for (int64_t start = span0; start < span0 + span_n; start += block_size) {
        const int n = static_cast<int>(std::min(block_size, span0 + span_n - start));
        const int64_t base = table[start / block_size] * block_size * token_stride + h * HD;
        int64_t stride;
        const float* v = rows(v_cache + base, token_stride, n, w.vbuf.data() + (start - span0) * HD, stride);
        for (int t = 0; t < n; ++t) w.vrows[start - span0 + t] = v + t * stride;
      }
      pv(s, w.vrows.data(), span_n, r, w.out.data());
    }
    alignas(64) float inv[kLanes];
    for (int c = 0; c < kNq; ++c) vstore(inv + c * kW, vdiv(vset(1.f), l[c]));
    for (int lane = 0; lane < nt * G; ++lane) {
      float* orow = o + ((row0 + i0 + lane / G) * p.num_heads + h * G + lane % G) * HD;
      for (int d = 0; d < HD; ++d) orow[d] = w.out[d * kLanes + lane] * inv[lane];
    }
  }

  static void run(const float* q, const C* k_cache, const C* v_cache, const int32_t* block_table,
                  const int64_t* seq_lens, const int64_t* chunks, int64_t num_chunks, float* o, const PagedShape& p,
                  float scale) {
    const int G = static_cast<int>(p.group());
    const int tokens_per_tile = kLanes / G;
    // Tasks (chunk, kv head, tile) with each (chunk, kv head)'s tiles together, so that a thread's consecutive tiles
    // read the same K/V rows from L2 (an order that mixed chunks re-read them from memory: 1.5x slower), and in
    // the interleaved order inside the group (later tiles see more keys), so that any split of the list is balanced.
    struct Task {
      int64_t chunk, head, tile;
    };
    std::vector<Task> tasks;
    for (int64_t c = 0; c < num_chunks; ++c) {
      const int64_t tiles = (chunks[2 * c + 1] + tokens_per_tile - 1) / tokens_per_tile;
      for (int64_t h = 0; h < p.num_kv_heads; ++h)
        for (int64_t t = 0; t < tiles; ++t) tasks.push_back({c, h, interleaved(t, tiles)});
    }
    const int64_t n = static_cast<int64_t>(tasks.size());
    const int64_t span = std::max<int64_t>(1, kSpanKeys / p.block_size) * p.block_size;
    at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
      Scratch w(span, p.block_size);
      for (int64_t i = begin; i < end; ++i) {
        const Task& task = tasks[i];
        const int64_t row0 = chunks[2 * task.chunk], rows = chunks[2 * task.chunk + 1];
        const int64_t i0 = task.tile * tokens_per_tile;
        const int nt = static_cast<int>(std::min<int64_t>(tokens_per_tile, rows - i0));
        tile(q, k_cache, v_cache, block_table + row0 * p.table_stride, row0, seq_lens[row0], i0, nt, task.head, o, p,
             scale, span, w);
      }
    });
  }
};

}  // namespace

namespace kvserve {

// Whether the tile path runs these inputs: fp32 queries, head_dim 64 or 128, a GQA group that fits a tile's lanes,
// on AVX2 or AVX-512 (the generic level's vector extensions turn the broadcast FMAs into scalar code: 10x slower
// than its own row kernel, measured).
bool chunk_tiles_supported(const at::Tensor& q, const PagedShape& p) {
#if defined(__AVX512F__) || defined(__AVX2__)
  return q.scalar_type() == at::kFloat && (p.head_dim == 64 || p.head_dim == 128) && p.group() <= kLanes;
#else
  (void)q;
  (void)p;
  return false;
#endif
}

// chunks [C, 2] int64: (first row, rows) of each chunk. A chunk's rows are one request's consecutive query tokens
// (row first + i sees seq_lens[first] + i keys) and share the first row's block table. Writes those rows of out
// [S, H, D]; the other rows are the caller's. Inputs as paged_attention_decode_check takes them, checked.
void paged_attention_chunks_run(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                const at::Tensor& block_table, const at::Tensor& seq_lens, const int64_t* chunks,
                                int64_t num_chunks, at::Tensor& out, const PagedShape& p, float scale) {
  dispatch_kv_cache(k_cache, float{}, [&](auto cache_tag) {
    using C = decltype(cache_tag);
    const C* kc = static_cast<const C*>(k_cache.data_ptr());
    const C* vc = static_cast<const C*>(v_cache.data_ptr());
    const auto go = [&](auto hd) {
      ChunkTiles<decltype(hd)::value, C>::run(q.data_ptr<float>(), kc, vc, block_table.data_ptr<int32_t>(),
                                               seq_lens.data_ptr<int64_t>(), chunks, num_chunks,
                                               out.data_ptr<float>(), p, scale);
    };
    if (p.head_dim == 64) {
      go(std::integral_constant<int, 64>{});
    } else {
      go(std::integral_constant<int, 128>{});
    }
  });
}

}  // namespace kvserve

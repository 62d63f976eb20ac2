// Paged attention over the pair-packed bf16 cache (kv_layout.h) on AMX tiles, for CPUs with AMX-BF16.
//
// The packed layout already is AMX's B-tile format for both products: 8 dim pairs of a K tile's 16 tokens are
// 8 rows of 64 bytes, `block_size * 4` bytes apart, and 8 token pairs of a V tile's 16 dims are 8 rows of 64 bytes,
// `head_dim * 4` bytes apart; so tiles load straight from the cache, as the linears' tiles load straight from
// their panels (linear_bf16.cpp). What the vectors cannot do is share a K/V read between query rows of different
// tokens: each prefill token was its own row that streamed its whole context. Here the rows of one request at
// consecutive positions over the same block table (the tokens of a prefill chunk, a draft chain or tree) form a
// group of up to 16 tokens, and its rows (token x query head of the kv head) fill the A tiles, so each 16-key
// sub-tile is read once per 16 rows instead of once per G.
//
// Bits: a row's scores, softmax and sums follow the same steps whatever its group (every row of every batch takes
// this path while it is on, batch 1 included, as the linears do): the tiles compute each row from its own A row,
// a row skips exactly the sub-tiles where it sees no key (as it would alone), and its accumulator tile row is only
// ever added to, or stored, scaled and reloaded for its own max. So the kernel is batch-invariant. The bits are not
// the vector kernel's (tdpbf16ps rounds its sums its own way), so the switch is per process, never per call.
// Accumulators stay in tiles across the keys; the online softmax stores and rescales them only when some row's
// running max moves, which after a row's first keys is rare.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "amx.h"
#include "attention_common.h"
#include "simd.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <memory>
#include <vector>

#if defined(__AVX512BF16__)

namespace {

using namespace kvserve;

constexpr int kMaxHD = 128;         // head sizes of the tile path: 64 and 128
constexpr int kSlice = 64;          // output dims per pass over the keys: 4 accumulator tiles of 16
constexpr int kMaxGroup = 16;       // query tokens per group
constexpr int kRows = amx::kTileRows;
static_assert(kSlice / 16 == 4, "store_acc, load_acc and the p.v products name four accumulator tiles");
constexpr int kPrefetchKeys = 32;   // how far ahead the cache is fetched

// Tiles: 0 scores [rows][16 keys] fp32; 1 A operand [rows][32 B] (q's 16 dims of a step, or the rows' 16
// probabilities); 2, 3 B operands [8][64 B] (8 dim pairs of K, or 8 token pairs of V; two, so a load can go
// ahead of the product before it); 4-7 the accumulators [rows][16 dims] fp32.
amx::TileConfig attention_tile_config(int rows) {
  amx::TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    const bool b = t == 2 || t == 3;
    cfg.rows[t] = static_cast<uint8_t>(b ? 8 : rows);
    cfg.colsb[t] = static_cast<uint16_t>(t == 1 ? 32 : 64);
  }
  return cfg;
}

// The keys [key0, key0 + 16) a row of context length len sees: after its window start lo, before len, and not
// hidden by its tree word (attention_common.h); 0 where it sees none (the row then skips the sub-tile).
inline __mmask16 visible_lanes(int64_t key0, int64_t lo, int64_t len, uint64_t hid) {
  const int64_t a = std::max<int64_t>(lo - key0, 0), b = std::min<int64_t>(len - key0, 16);
  if (a >= b) return 0;
  uint32_t v = ((1u << b) - 1) & ~((1u << a) - 1);
  const int64_t back = len - 1 - key0;
  if (hid != 0 && back < 64 + 15) v &= ~hidden_lanes16(hid, back);
  return static_cast<__mmask16>(v);
}

// A group: rows [first, first + n) of the call, one request's consecutive positions over the same blocks.
struct Group {
  int64_t first;
  int n;
};

std::vector<Group> group_rows(const int64_t* seq_lens, const int32_t* table, int64_t num_seqs, int64_t stride,
                              int64_t block_size) {
  std::vector<Group> groups;
  for (int64_t s = 0; s < num_seqs;) {
    int n = 1;
    while (n < kMaxGroup && s + n < num_seqs && seq_lens[s + n] == seq_lens[s] + n &&
           std::memcmp(table + s * stride, table + (s + n) * stride,
                       sizeof(int32_t) * ((seq_lens[s + n] + block_size - 1) / block_size)) == 0)
      ++n;
    groups.push_back({s, n});
    s += n;
  }
  return groups;
}

// Per thread: the group's q rows as tile rows, and one row tile's softmax state.
struct Scratch {
  alignas(64) uint16_t q[kMaxGroup * 8 * kMaxHD];  // [token][query head of the kv head][dim] bf16; G <= 8
  alignas(64) float scores[kRows * 16];
  alignas(64) uint16_t p[kRows * 16];  // probabilities, bf16
  alignas(64) float acc[kRows * kSlice];
  alignas(64) float lsum[kRows * 16];  // lane-wise sums, reduced at the end
  float m[kRows];
  float rescale[kRows];
};

// Blocks sit anywhere in the pool: a later sub-tile's K and V (32 lines each) are fetched while this one computes,
// 8 lines at a time between the tile steps (a burst of 64 did no better than none). nullptr: nothing to fetch.
struct Prefetch {
  const char* k = nullptr;
  const char* v = nullptr;
  int64_t k_row = 0;  // bytes between K's dim-pair rows
  void k_lines(int first) const {
    if (k != nullptr)
      for (int dp = first; dp < first + 8; ++dp) __builtin_prefetch(k + dp * k_row, 0, 1);
  }
  void v_lines(int first) const {
    if (v != nullptr)
      for (int line = first; line < first + 8; ++line) __builtin_prefetch(v + line * 64, 0, 1);
  }
};

template <int HD>
inline Prefetch prefetch_for(const uint16_t* k_cache, const uint16_t* v_cache, const int32_t* table, int64_t key0,
                             int64_t len_max, int64_t block_size, int64_t block_elems, int64_t head_off) {
  if (key0 >= len_max) return {};
  const int64_t block = table[key0 / block_size], t0 = key0 % block_size;
  return {reinterpret_cast<const char*>(k_cache + block * block_elems + head_off + t0 * 2),
          reinterpret_cast<const char*>(v_cache + block * block_elems + head_off + (t0 / 2) * HD * 2),
          block_size * 4};
}

__attribute__((target("amx-tile"))) inline void store_acc(float* acc) {
  _tile_stored(4, acc, kSlice * 4);
  _tile_stored(5, acc + 16, kSlice * 4);
  _tile_stored(6, acc + 32, kSlice * 4);
  _tile_stored(7, acc + 48, kSlice * 4);
}

__attribute__((target("amx-tile"))) inline void load_acc(const float* acc) {
  _tile_loadd(4, acc, kSlice * 4);
  _tile_loadd(5, acc + 16, kSlice * 4);
  _tile_loadd(6, acc + 32, kSlice * 4);
  _tile_loadd(7, acc + 48, kSlice * 4);
}

// One row tile of a (group, kv head) task, output dims [slice * 64, slice * 64 + 64): rows r0 .. r0 + rows - 1 of
// the group's n * G, row r being token r / G (length len0 + r / G) and query head h * G + r % G. A head of 128 dims
// takes two passes over the keys, one per slice, each computing the same scores and softmax (the same steps give
// the same bits), since the accumulators of 128 dims would need 8 tiles. `configured`: the thread's configured
// row count.
template <int HD, int G, bool ALIBI>
__attribute__((target("amx-tile,amx-bf16"))) void row_tile(Scratch& w, const uint16_t* k_cache,
                                                           const uint16_t* v_cache, const int32_t* table,
                                                           const PagedShape& shape, int64_t h, int64_t len0,
                                                           int r0, int rows, int64_t window, const float* alibi,
                                                           const uint64_t* hid, float scale, at::BFloat16* out,
                                                           int64_t out_row0, int slice, int& configured) {
  if (rows != configured) {
    const amx::TileConfig cfg = attention_tile_config(rows);
    _tile_loadconfig(&cfg);
    configured = rows;
  }
  const int64_t block_size = shape.block_size;
  const int64_t tile = HD * block_size, block_elems = shape.num_kv_heads * tile;
  const int i_first = r0 / G, i_last = (r0 + rows - 1) / G;
  const int64_t lo_min = window_start(len0 + i_first, window), len_max = len0 + i_last;
  const __m512 vscale = _mm512_set1_ps(scale);
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const __m512 lane_index = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  for (int r = 0; r < rows; ++r) {
    w.m[r] = -std::numeric_limits<float>::infinity();
    _mm512_store_ps(w.lsum + r * 16, _mm512_setzero_ps());
  }
  _tile_zero(4);
  _tile_zero(5);
  _tile_zero(6);
  _tile_zero(7);
  const uint16_t* qa = w.q + r0 * HD;
  for (int64_t key0 = lo_min / 16 * 16; key0 < len_max; key0 += 16) {
    __mmask16 valid[kRows];
    bool any = false;
    for (int r = 0; r < rows; ++r) {
      const int i = (r0 + r) / G;
      const int64_t len = len0 + i;
      valid[r] = visible_lanes(key0, window_start(len, window), len, hid[i]);
      any |= valid[r] != 0;
    }
    if (!any) continue;
    const int64_t block = table[key0 / block_size], t0 = key0 % block_size;
    const uint16_t* kt = k_cache + block * block_elems + h * tile;
    const uint16_t* vt = v_cache + block * block_elems + h * tile;
    const Prefetch pf = prefetch_for<HD>(k_cache, v_cache, table, key0 + kPrefetchKeys, len_max, block_size, block_elems,
                                     h * tile);
    // q.k: 8 dim pairs a step; the K tile's rows are dim pairs, block_size * 4 bytes apart.
    _tile_zero(0);
    for (int ks = 0; ks < HD / 16; ks += 2) {
      pf.k_lines(ks * 8);
      pf.k_lines(ks * 8 + 8);
      _tile_loadd(1, qa + ks * 16, HD * 2);
      _tile_loadd(2, kt + (ks * 8 * block_size + t0) * 2, block_size * 4);
      _tile_dpbf16ps(0, 1, 2);
      _tile_loadd(1, qa + (ks + 1) * 16, HD * 2);
      _tile_loadd(3, kt + ((ks + 1) * 8 * block_size + t0) * 2, block_size * 4);
      _tile_dpbf16ps(0, 1, 3);
    }
    _tile_stored(0, w.scores, 64);
    bool moved = false;
    for (int r = 0; r < rows; ++r) {
      w.rescale[r] = 1.f;
      if (valid[r] == 0) {  // sees nothing here: adds 0 to its sums, as if it had skipped the sub-tile
        _mm256_store_si256(reinterpret_cast<__m256i*>(w.p + r * 16), _mm256_setzero_si256());
        continue;
      }
      const int i = (r0 + r) / G;
      __m512 sc = _mm512_mask_mul_ps(neg_inf, valid[r], _mm512_load_ps(w.scores + r * 16), vscale);
      if constexpr (ALIBI) {  // -inf lanes stay -inf
        const float rel0 = static_cast<float>(key0 - (len0 + i - 1));
        const __m512 rel = _mm512_add_ps(lane_index, _mm512_set1_ps(rel0));
        sc = _mm512_fmadd_ps(_mm512_set1_ps(alibi[h * G + (r0 + r) % G]), rel, sc);
      }
      __m512 l = _mm512_load_ps(w.lsum + r * 16);
      if (_mm512_cmp_ps_mask(sc, _mm512_set1_ps(w.m[r]), _CMP_GT_OQ)) {
        const bool first = w.m[r] == -std::numeric_limits<float>::infinity();
        const float f = move_max(w.m[r], _mm512_reduce_max_ps(sc));
        l = _mm512_mul_ps(l, _mm512_set1_ps(f));
        if (!first) w.rescale[r] = f, moved = true;  // a first max scales zeros: nothing to do
      }
      const __m512 e = vexp(_mm512_sub_ps(sc, _mm512_set1_ps(w.m[r])));
      _mm512_store_ps(w.lsum + r * 16, _mm512_add_ps(l, e));
      _mm256_store_si256(reinterpret_cast<__m256i*>(w.p + r * 16), (__m256i)_mm512_cvtneps_pbh(e));
    }
    if (moved) {  // the rows whose max moved scale their sums so far; the others store and reload unchanged
      store_acc(w.acc);
      for (int r = 0; r < rows; ++r)
        if (w.rescale[r] != 1.f) scale_row(w.acc + r * kSlice, w.rescale[r], kSlice);
      load_acc(w.acc);
    }
    // p.v: the rows' 16 probabilities against 8 token pairs of each 16-dim V column group (rows HD * 4 bytes
    // apart). The V rows of the sub-tile are HD / 2 lines.
    _tile_loadd(1, w.p, 32);
    const uint16_t* vrows = vt + (t0 / 2) * HD * 2 + slice * kSlice * 2;
    for (int line = 0; line < HD / 4; line += 8) pf.v_lines(line);
    _tile_loadd(2, vrows, HD * 4);  // tile ids are immediates: the four column groups are named
    _tile_dpbf16ps(4, 1, 2);
    _tile_loadd(3, vrows + 32, HD * 4);
    _tile_dpbf16ps(5, 1, 3);
    for (int line = HD / 4; line < HD / 2; line += 8) pf.v_lines(line);
    _tile_loadd(2, vrows + 64, HD * 4);
    _tile_dpbf16ps(6, 1, 2);
    _tile_loadd(3, vrows + 96, HD * 4);
    _tile_dpbf16ps(7, 1, 3);
  }
  store_acc(w.acc);
  for (int r = 0; r < rows; ++r) {
    const float l = _mm512_reduce_add_ps(_mm512_load_ps(w.lsum + r * 16));
    scale_row(w.acc + r * kSlice, 1.f / l, kSlice);
    const int i = (r0 + r) / G, g = (r0 + r) % G;
    store_row(w.acc + r * kSlice, out + ((out_row0 + i) * shape.num_heads + h * G + g) * HD + slice * kSlice,
              kSlice);
  }
}

__attribute__((target("amx-tile"))) void release_tiles() { _tile_release(); }

template <int HD, int G, bool ALIBI>
void amx_attention(const uint16_t* q, const uint16_t* k_cache, const uint16_t* v_cache, const int32_t* block_table,
                   const int64_t* seq_lens, at::BFloat16* out, const PagedShape& shape, float scale, int64_t window,
                   const float* alibi, const int64_t* hidden) {
  const std::vector<Group> groups =
      group_rows(seq_lens, block_table, shape.num_seqs, shape.table_stride, shape.block_size);
  // A task is a group and a run of kv heads: all of them when there are enough groups to keep every thread busy
  // (each block's heads then come one after another: the pages are at hand), otherwise one.
  const int64_t num_kv = shape.num_kv_heads, n_groups = static_cast<int64_t>(groups.size());
  const int64_t hpt = n_groups >= 2 * at::get_num_threads() ? num_kv : 1, per_group = num_kv / hpt;
  const int64_t n_tasks = n_groups * per_group;
  const auto run = [&](int64_t begin, int64_t end) {
    if (begin >= end) return;
    auto w = std::make_unique<Scratch>();
    int configured = 0;
    for (int64_t it = begin; it < end; ++it) {
      const int64_t task = interleaved(it, n_tasks);
      const Group& grp = groups[task / per_group];
      uint64_t hid[kMaxGroup];
      for (int i = 0; i < grp.n; ++i) hid[i] = row_hidden_keys(hidden, grp.first + i);
      for (int64_t h = (task % per_group) * hpt; h < (task % per_group + 1) * hpt; ++h) {
        for (int i = 0; i < grp.n; ++i)
          std::memcpy(w->q + i * G * HD, q + ((grp.first + i) * shape.num_heads + h * G) * HD,
                      sizeof(uint16_t) * G * HD);
        const int rows_total = grp.n * G;
        for (int r0 = 0; r0 < rows_total; r0 += kRows)
          for (int slice = 0; slice < HD / kSlice; ++slice)
            row_tile<HD, G, ALIBI>(*w, k_cache, v_cache, block_table + grp.first * shape.table_stride, shape, h,
                                   seq_lens[grp.first], r0, std::min(kRows, rows_total - r0), window, alibi, hid,
                                   scale, out, grp.first, slice, configured);
      }
    }
    if (configured) release_tiles();
  };
  // Inside a caller's OpenMP region (decoder_layer_row.cpp), each thread runs its share of the same tasks.
  if (omp_in_parallel()) {
    const RegionShare share = region_share(n_tasks);
    run(share.begin, share.end);
  } else {
    at::parallel_for(0, n_tasks, 1, run);
  }
}

}  // namespace

#endif

// Whether the tile path runs for this shape: AMX-BF16 usable and wanted, head size 64 or 128, whole 16-token tiles
// per block, a GQA group of at most 8.
bool packed_attention_amx_supported(int64_t head_dim, int64_t group, int64_t block_size) {
#if defined(__AVX512BF16__)
  return kvserve::amx::attention_active() && (head_dim == 64 || head_dim == 128) && block_size % 16 == 0 &&
         group <= 8 && kvserve::with_head_shape(head_dim, group, [](auto, auto) {});
#else
  (void)head_dim, (void)group, (void)block_size;
  return false;
#endif
}

// q [S, H, 64 or 128] bf16, caches bf16 in the packed layout; as paged_attention_packed (which checks the inputs).
void paged_attention_packed_amx(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                const at::Tensor& block_table, const at::Tensor& seq_lens, at::Tensor& out,
                                const kvserve::PagedShape& p, float scale, int64_t window, const float* alibi,
                                const int64_t* hidden) {
#if defined(__AVX512BF16__)
  kvserve::with_head_shape(p.head_dim, p.group(), [&](auto hd, auto g) {
    constexpr int HD = decltype(hd)::value, G = decltype(g)::value;
    if constexpr (G <= 8 && (HD == 64 || HD == 128)) {
      auto* run = alibi != nullptr ? &amx_attention<HD, G, true> : &amx_attention<HD, G, false>;
      run(reinterpret_cast<const uint16_t*>(q.data_ptr<at::BFloat16>()),
          reinterpret_cast<const uint16_t*>(k_cache.data_ptr<at::BFloat16>()),
          reinterpret_cast<const uint16_t*>(v_cache.data_ptr<at::BFloat16>()), block_table.data_ptr<int32_t>(),
          seq_lens.data_ptr<int64_t>(), out.data_ptr<at::BFloat16>(), p, scale, window, alibi, hidden);
    }
  });
#else
  (void)q, (void)k_cache, (void)v_cache, (void)block_table, (void)seq_lens, (void)out, (void)p, (void)scale,
      (void)window, (void)alibi, (void)hidden;
#endif
}

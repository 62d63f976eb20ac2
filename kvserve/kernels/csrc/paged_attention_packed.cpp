// Paged decode attention over the pair-packed cache (kv_layout.h), for CPUs with AVX512-BF16: bf16 here, fp8 in
// paged_attention_packed_fp8.cpp (CPUs with AVX512-VBMI too); the kernel itself is packed_decode.h.
//
// Same tasks, online softmax and block-table reads as paged_attention.cpp (attention_common.h), but about half the instructions
// per cached token: q.k and p.v are both `vdpbf16ps` against broadcast pairs, with no horizontal sums and no
// bf16 -> fp32 widening of K/V. With the standard layout the kernel was compute-bound (~26 GB/s from L3, ~16 from
// memory, where a plain read gets ~50 GB/s); this one reads 27-44 GB/s from memory (batch 128, contexts of
// 100-640 tokens; scattered to adjacent blocks).
// Probabilities are rounded to bf16 for p.v, as flash-attention kernels do; scores, softmax and sums are fp32.

#include <ATen/ATen.h>

#include "amx.h"
#include "attention_common.h"
#include "packed_decode.h"

// The fp8 kernel (paged_attention_packed_fp8.cpp): q bf16, caches fp8 in the packed layout; out [S, H, D] bf16.
void paged_attention_packed_fp8(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                const at::Tensor& block_table, const at::Tensor& seq_lens, at::Tensor& out,
                                const kvserve::PagedShape& p, float scale, int64_t window, const float* alibi,
                                const int64_t* hidden);

// The tile path (paged_attention_amx.cpp): bf16 caches of head size 64 or 128 where AMX-BF16 is usable.
bool packed_attention_amx_supported(int64_t head_dim, int64_t group, int64_t block_size);
void paged_attention_packed_amx(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                const at::Tensor& block_table, const at::Tensor& seq_lens, at::Tensor& out,
                                const kvserve::PagedShape& p, float scale, int64_t window, const float* alibi,
                                const int64_t* hidden);

bool attention_amx_active() { return packed_attention_amx_supported(64, 1, 16); }

bool attention_amx_set_enabled(bool on) { return kvserve::amx::attention_wanted().exchange(on); }

// Whether this build runs the packed kernel for these shapes and cache type: blocks of whole 16-token tiles, and for
// fp8 (`fp8`) head sizes of whole 32-dim chunks on a CPU with AVX512-VBMI (the widening's byte tables).
bool packed_kv_supported(int64_t head_dim, int64_t group, int64_t block_size, bool fp8) {
#if defined(__AVX512BF16__)
  if (fp8 && (head_dim % 32 != 0 || !__builtin_cpu_supports("avx512vbmi"))) return false;
  return block_size % 16 == 0 && kvserve::with_head_shape(head_dim, group, [](auto, auto) {});
#else
  (void)head_dim, (void)group, (void)block_size, (void)fp8;
  return false;
#endif
}

// q [S, H, D] bf16; k_cache, v_cache [num_blocks, block_size, Hkv, D] holding the packed layout, bf16 or fp8
// (float8_e4m3fn / float8_e5m2); block_table [S, max_blocks] int32; seq_lens [S] int64 (each >= 1); window: each row
// sees only its last `window` keys (0: all of them); alibi_slopes: none, or [H] fp32 ALiBi slopes; hidden_keys: none,
// or [S] int64 tree-attention bits (hidden_keys_ptr, attention_common.h). Returns [S, H, D] bf16.
// The bf16 call's work into `out` (q, caches and shape checked by the caller): the tile path where AMX-BF16 is
// usable, else packed_decode.h. Callable inside a caller's OpenMP region (decoder_layer_row.cpp): each thread then
// runs its share of the same tasks, so the same bits.
void paged_attention_packed_run(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                const at::Tensor& block_table, const at::Tensor& seq_lens, at::Tensor& out,
                                const kvserve::PagedShape& p, float scale, int64_t window, const float* alibi,
                                const int64_t* hidden) {
  if (packed_attention_amx_supported(p.head_dim, p.group(), p.block_size)) {
    paged_attention_packed_amx(q, k_cache, v_cache, block_table, seq_lens, out, p, scale, window, alibi, hidden);
    return;
  }
#if defined(__AVX512BF16__)
  run_packed_decode(q, reinterpret_cast<const uint16_t*>(k_cache.data_ptr<at::BFloat16>()),
                    reinterpret_cast<const uint16_t*>(v_cache.data_ptr<at::BFloat16>()), block_table, seq_lens, out, p,
                    scale, window, alibi, hidden);
#endif
}

at::Tensor paged_attention_packed(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache, at::Tensor block_table,
                                  at::Tensor seq_lens, double scale, int64_t window,
                                  c10::optional<at::Tensor> alibi_slopes, c10::optional<at::Tensor> hidden_keys) {
  const kvserve::PagedShape p = kvserve::check_paged_inputs(q, k_cache, v_cache, block_table, seq_lens);
  const float* alibi = kvserve::alibi_slopes_ptr(alibi_slopes, p.num_heads);
  const int64_t* hidden = kvserve::hidden_keys_ptr(hidden_keys, p.num_seqs);
  const bool fp8 = kvserve::is_fp8(k_cache.scalar_type());
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && (fp8 || k_cache.scalar_type() == at::kBFloat16),
              "packed cache: bf16 q, bf16 or fp8 cache");
  TORCH_CHECK(packed_kv_supported(p.head_dim, p.group(), p.block_size, fp8),
              "no packed decode kernel for this shape and cache type on this CPU");
  auto out = at::empty_like(q);
  if (fp8) {
    paged_attention_packed_fp8(q, k_cache, v_cache, block_table, seq_lens, out, p, static_cast<float>(scale), window,
                               alibi, hidden);
    return out;
  }
  paged_attention_packed_run(q, k_cache, v_cache, block_table, seq_lens, out, p, static_cast<float>(scale), window,
                             alibi, hidden);
  return out;
}

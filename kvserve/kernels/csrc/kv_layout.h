// The pair-packed KV-cache layout used by the bf16 decode kernel (paged_attention_packed.cpp).
//
// A block of B tokens keeps the standard block's size and place in the pool ([Hkv][tile] instead of [B][Hkv][D]),
// so block tables, the prefix cache and block copies do not change; only the order inside a block does. Each kv
// head's keys and values form one contiguous tile of B x D bf16, ordered for `vdpbf16ps`, which multiplies pairs
// of bf16 and adds each pair's products into one fp32 lane:
//   K tile [D/2][B][2]: the (d, d+1) pair of every token; a 64-byte load holds 16 tokens' pairs, so q.k for 16
//                       tokens is D/2 instructions against a broadcast q pair, with no horizontal sums;
//   V tile [B/2][D][2]: the (t, t+1) pair of every dim; a 64-byte load holds 16 dims of two tokens, so p.v for
//                       two tokens is one instruction per 16 dims against a broadcast (p_t, p_t+1) pair.
// kvserve/attention/cpu_kernels.py has the same layout in torch (pack_kv_blocks / unpack_kv_blocks).
#pragma once

#include <cstdint>

namespace kvserve {

// Offsets of token t (0 <= t < B), kv head h, dim d within a block of `block_size` tokens.
inline int64_t packed_k_offset(int64_t t, int64_t h, int64_t d, int64_t block_size, int64_t head_dim) {
  return h * head_dim * block_size + ((d / 2) * block_size + t) * 2 + d % 2;
}
inline int64_t packed_v_offset(int64_t t, int64_t h, int64_t d, int64_t block_size, int64_t head_dim) {
  return h * head_dim * block_size + ((t / 2) * head_dim + d) * 2 + t % 2;
}

}  // namespace kvserve

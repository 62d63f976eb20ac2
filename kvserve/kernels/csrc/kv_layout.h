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
// An fp8 cache keeps the same tiles at one byte an element, in 64-byte chunks that each hold two of the bf16 order's
// 32-element vectors: K chunk (d/4, t/16) the pairs d/2 and d/2 + 1 of 16 tokens, V chunk (t/2, d/32) dims d/32 * 32
// .. + 31 of a token pair. Within a chunk the two vectors are interleaved by 8 bytes in each 16-byte lane (vector u's
// element w at byte 16 (w / 8) + 8 u + w % 8), so that widening (packed_decode.h: a bf16 byte pattern looked up for
// each code, then vpunpck{l,h}bw of low and high bytes, which work within 16-byte lanes) yields them in order.
// kvserve/attention/cpu_kernels.py has the same layouts in torch (pack_kv_blocks / unpack_kv_blocks).
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

// fp8: the byte of element w (0 <= w < 32) of vector u (0, 1) within a chunk, and the offsets as above (block_size
// a multiple of 16, head_dim of 32).
inline int64_t fp8_chunk_byte(int64_t u, int64_t w) { return (w / 8) * 16 + u * 8 + w % 8; }
inline int64_t packed_k_offset_fp8(int64_t t, int64_t h, int64_t d, int64_t block_size, int64_t head_dim) {
  const int64_t chunk = (d / 4) * (block_size / 16) + t / 16;
  return h * head_dim * block_size + chunk * 64 + fp8_chunk_byte((d / 2) % 2, (t % 16) * 2 + d % 2);
}
inline int64_t packed_v_offset_fp8(int64_t t, int64_t h, int64_t d, int64_t block_size, int64_t head_dim) {
  const int64_t chunk = (t / 2) * (head_dim / 32) + d / 32;
  return h * head_dim * block_size + chunk * 64 + fp8_chunk_byte((d / 16) % 2, (d % 16) * 2 + t % 2);
}

}  // namespace kvserve

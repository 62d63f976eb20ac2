"""The pure-torch paged-attention backend: the reference the kernel backend is tested against, and the path
when the C++ kernels are not built (no compiler, or KVSERVE_CPU_KERNELS=0).

Decodes gather each sequence's blocks into a padded context and use two batched matmuls; prefill chunks run one
request at a time through SDPA with a causal mask offset by the request's cached context (a chunk with no cached
context attends over its own fresh K/V). Python loops are per request, never per token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvserve.attention.base import AttentionBackend, AttentionInputs, KVCache
from kvserve.attention.common import PrefillSpan, prefill_span, sdpa_prefill_spans
from kvserve.attention.kv_dtype import is_fp8, quantize_kv
from kvserve.utils import cdiv


@dataclass
class TorchRefMetadata:
    slot_mapping: torch.Tensor  # [T] int64
    num_decodes: int
    decode_block_table: torch.Tensor | None  # [D, max_blocks] int32
    decode_seq_lens: torch.Tensor | None  # [D] int64
    prefills: list[PrefillSpan]


class TorchRefAttentionBackend(AttentionBackend):
    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        kv_cache_dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim, kv_cache_dtype or dtype)
        self.dtype = dtype
        self.group = num_heads // num_kv_heads

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        return (num_blocks, block_size, self.num_kv_heads, self.head_dim)

    def describe(self, block_size: int) -> str:
        return "pure torch (no C++ kernels)"

    def build_metadata(self, inputs: AttentionInputs) -> TorchRefMetadata:
        num_decodes = inputs.num_decodes
        seq_lens = inputs.seq_lens
        decode_block_table = decode_seq_lens = None
        if num_decodes:
            decode_seq_lens = torch.from_numpy(seq_lens[:num_decodes])
            num_blocks = cdiv(int(decode_seq_lens.max()), inputs.block_size)
            decode_block_table = torch.from_numpy(inputs.block_table[:num_decodes, :num_blocks]).contiguous()
        return TorchRefMetadata(
            slot_mapping=torch.from_numpy(inputs.slot_mapping),
            num_decodes=num_decodes,
            decode_block_table=decode_block_table,
            decode_seq_lens=decode_seq_lens,
            prefills=[prefill_span(inputs, i) for i in range(num_decodes, len(seq_lens))],
        )

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: KVCache,
        metadata: TorchRefMetadata,
        scale: float,
        sliding_window: int | None = None,
        alibi_slopes: torch.Tensor | None = None,
    ) -> torch.Tensor:
        key_cache, value_cache = kv_cache
        num_tokens = q.shape[0]
        hkv, hd = self.num_kv_heads, self.head_dim
        # Every write before any read (see AttentionBackend.forward). Decodes read whole padded blocks, and a
        # masked weight of 0 times a stale NaN is still NaN; so the cache never takes a non-finite value, and one
        # broken request cannot poison the requests that reuse its blocks later.
        # An fp8 cache stores the rounded values (kv_dtype.quantize_kv) and is read back widened to q's dtype.
        k = quantize_kv(k, key_cache.dtype)
        v = quantize_kv(v, value_cache.dtype)
        if is_fp8(key_cache.dtype):  # torch has no index_copy_ for fp8: copy the bytes
            key_cache.view(torch.uint8).view(-1, hkv, hd).index_copy_(0, metadata.slot_mapping, k.view(torch.uint8))
            value_cache.view(torch.uint8).view(-1, hkv, hd).index_copy_(0, metadata.slot_mapping, v.view(torch.uint8))
            k, v = k.to(q.dtype), v.to(q.dtype)
        else:
            key_cache.view(-1, hkv, hd).index_copy_(0, metadata.slot_mapping, k)
            value_cache.view(-1, hkv, hd).index_copy_(0, metadata.slot_mapping, v)

        d = metadata.num_decodes
        w, slopes = sliding_window, alibi_slopes
        if d == num_tokens:  # decodes only (the common step): no output buffer to fill
            out = self._decode(q.contiguous(), key_cache, value_cache, metadata, scale, w, slopes)
            return out.view(num_tokens, -1)
        out = torch.empty(num_tokens, self.num_heads, hd, dtype=q.dtype)
        if d:
            out[:d] = self._decode(q[:d].contiguous(), key_cache, value_cache, metadata, scale, w, slopes)
        sdpa_prefill_spans(q, k, v, kv_cache, metadata.prefills, scale, out, w, slopes)
        return out.view(num_tokens, self.num_heads * hd)

    def _decode(
        self,
        q: torch.Tensor,  # [D, H, hd]
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        metadata: TorchRefMetadata,
        scale: float,
        sliding_window: int | None = None,
        alibi_slopes: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The decodes' attention over their padded gathered contexts: [D, H, hd]. With a sliding window, each
        context starts at the block holding its window's first key (a request's own block ids from there on); with
        ALiBi slopes, each head's score of a key gets slope * (key position - query position)."""
        assert metadata.decode_block_table is not None and metadata.decode_seq_lens is not None
        d = q.shape[0]
        hkv, hd = self.num_kv_heads, self.head_dim
        block_size = key_cache.shape[1]
        seq_lens = metadata.decode_seq_lens
        table = metadata.decode_block_table.long()
        first_key = torch.zeros_like(seq_lens)  # [D] position of each context's first gathered key
        if sliding_window is not None:
            first_block = (seq_lens - sliding_window).clamp(min=0) // block_size
            num_blocks = min(table.shape[1], cdiv(sliding_window - 1, block_size) + 1)
            cols = first_block[:, None] + torch.arange(num_blocks)[None, :]
            # Columns past a table's end repeat its last one; their positions lie past the context, so masked.
            table = table.gather(1, cols.clamp(max=table.shape[1] - 1))
            first_key = first_block * block_size
        ctx_len = table.shape[1] * block_size
        flat = table.reshape(-1)
        # [D, L, Hkv, hd] -> [D, Hkv, L, hd]
        keys = key_cache.index_select(0, flat).view(d, ctx_len, hkv, hd).transpose(1, 2).to(q.dtype)
        values = value_cache.index_select(0, flat).view(d, ctx_len, hkv, hd).transpose(1, 2).to(q.dtype)
        qg = q.view(d, hkv, self.group, hd)
        scores = torch.matmul(qg, keys.transpose(2, 3)) * scale  # [D, Hkv, G, L]
        positions = first_key[:, None] + torch.arange(ctx_len)[None, :]  # [D, L]
        if alibi_slopes is not None:
            rel = (positions - (seq_lens - 1)[:, None]).float()  # [D, L], the query at position seq_len - 1
            slopes = alibi_slopes.float().view(hkv, self.group)
            scores += (slopes[None, :, :, None] * rel[:, None, None, :]).to(scores.dtype)
        hidden = positions >= seq_lens[:, None]
        if sliding_window is not None:
            hidden |= positions < (seq_lens - sliding_window)[:, None]
        scores.masked_fill_(hidden[:, None, None, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        return torch.matmul(probs, values).view(d, self.num_heads, hd)  # [D, Hkv, G, hd]

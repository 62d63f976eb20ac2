"""Paged attention in plain torch for the CPU: the ground truth other backends are tested against.

Decodes (one query token each) are batched: their blocks are gathered into a padded [D, L] context and the
scores come from two batched matmuls over the GQA groups, with positions past each sequence masked.
(SDPA is several times slower than this for single-token queries on this CPU.) Prefill chunks run one request
at a time through SDPA with a causal mask offset by the request's cached context. Python loops are per request,
never per token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvserve.attention.base import AttentionBackend, AttentionInputs, KVCache


@dataclass
class _PrefillSpan:
    query_start: int
    query_len: int
    seq_len: int
    block_ids: torch.Tensor  # [num_blocks] int64, just enough blocks to hold seq_len tokens
    mask: torch.Tensor | None  # [query_len, seq_len] bool (True = may attend); None when plainly causal


@dataclass
class TorchAttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64
    num_decodes: int
    decode_block_table: torch.Tensor | None  # [D, max_blocks] int64
    decode_pad_mask: torch.Tensor | None  # [D, 1, 1, max_blocks * block_size] bool, True past each sequence
    prefills: list[_PrefillSpan]


class TorchAttentionBackend(AttentionBackend):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim)
        self.dtype = dtype
        self.group = num_heads // num_kv_heads

    def build_metadata(self, inputs: AttentionInputs) -> TorchAttentionMetadata:
        bs = inputs.block_size
        num_decodes = inputs.num_decodes
        seq_lens = inputs.seq_lens
        decode_block_table = decode_pad_mask = None
        if num_decodes:
            d_lens = torch.from_numpy(seq_lens[:num_decodes])
            num_blocks = -(-int(d_lens.max()) // bs)
            decode_block_table = torch.from_numpy(inputs.block_table[:num_decodes, :num_blocks]).long()
            past_end = torch.arange(num_blocks * bs)[None, :] >= d_lens[:, None]
            decode_pad_mask = past_end[:, None, None, :]
        prefills = []
        qsl = inputs.query_start_loc
        for i in range(num_decodes, len(seq_lens)):
            start, q_len, seq_len = int(qsl[i]), int(qsl[i + 1] - qsl[i]), int(seq_lens[i])
            num_blocks = -(-seq_len // bs)
            block_ids = torch.from_numpy(inputs.block_table[i, :num_blocks]).long()
            mask = None
            if q_len != seq_len:
                # Query token j sits at position seq_len - q_len + j and sees keys up to that position.
                q_pos = torch.arange(seq_len - q_len, seq_len)[:, None]
                mask = torch.arange(seq_len)[None, :] <= q_pos
            prefills.append(_PrefillSpan(start, q_len, seq_len, block_ids, mask))
        return TorchAttentionMetadata(
            slot_mapping=torch.from_numpy(inputs.slot_mapping),
            num_decodes=num_decodes,
            decode_block_table=decode_block_table,
            decode_pad_mask=decode_pad_mask,
            prefills=prefills,
        )

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: KVCache,
        metadata: TorchAttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        key_cache, value_cache = kv_cache
        num_tokens = q.shape[0]
        hkv, hd = self.num_kv_heads, self.head_dim
        # Every write before any read (see AttentionBackend.forward). Decodes read whole padded blocks, and a
        # masked weight of 0 times a stale NaN is still NaN; so the cache never takes a non-finite value, and one
        # broken request cannot poison the requests that reuse its blocks later.
        key_cache.view(-1, hkv, hd).index_copy_(0, metadata.slot_mapping, torch.nan_to_num(k))
        value_cache.view(-1, hkv, hd).index_copy_(0, metadata.slot_mapping, torch.nan_to_num(v))

        out = torch.empty(num_tokens, self.num_heads, hd, dtype=q.dtype)
        d = metadata.num_decodes
        if d:
            out[:d] = self._decode(q[:d], key_cache, value_cache, metadata, scale)
        for span in metadata.prefills:
            s, e = span.query_start, span.query_start + span.query_len
            out[s:e] = self._prefill(q[s:e], key_cache, value_cache, span, scale)
        return out.view(num_tokens, self.num_heads * hd)

    def _decode(
        self,
        q: torch.Tensor,  # [D, H, hd]
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        metadata: TorchAttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        assert metadata.decode_block_table is not None and metadata.decode_pad_mask is not None
        d = q.shape[0]
        hkv, hd = self.num_kv_heads, self.head_dim
        table = metadata.decode_block_table
        ctx_len = table.shape[1] * key_cache.shape[1]
        # [D, L, Hkv, hd] -> [D, Hkv, L, hd]
        keys = key_cache[table].view(d, ctx_len, hkv, hd).transpose(1, 2)
        values = value_cache[table].view(d, ctx_len, hkv, hd).transpose(1, 2)
        qg = q.view(d, hkv, self.group, hd)
        scores = torch.matmul(qg, keys.transpose(2, 3)) * scale  # [D, Hkv, G, L]
        scores.masked_fill_(metadata.decode_pad_mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        return torch.matmul(probs, values).view(d, self.num_heads, hd)  # [D, Hkv, G, hd]

    def _prefill(
        self,
        q: torch.Tensor,  # [Q, H, hd]
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        span: _PrefillSpan,
        scale: float,
    ) -> torch.Tensor:
        hkv, hd = self.num_kv_heads, self.head_dim
        keys = key_cache[span.block_ids].view(-1, hkv, hd)[: span.seq_len].transpose(0, 1)  # [Hkv, S, hd]
        values = value_cache[span.block_ids].view(-1, hkv, hd)[: span.seq_len].transpose(0, 1)
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0),  # [1, H, Q, hd]
            keys.unsqueeze(0),
            values.unsqueeze(0),
            attn_mask=span.mask,
            is_causal=span.mask is None,
            scale=scale,
            enable_gqa=True,
        )
        return out[0].transpose(0, 1)  # [Q, H, hd]

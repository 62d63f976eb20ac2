"""Pieces both CPU backends use: a prefill chunk's span (its blocks and causal mask) and SDPA over it."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvserve.attention.base import AttentionInputs, KVCache
from kvserve.utils import cdiv


@dataclass
class PrefillSpan:
    query_start: int
    query_len: int
    seq_len: int
    block_ids: torch.Tensor  # [num_blocks] int64, just enough blocks to hold seq_len tokens
    mask: torch.Tensor | None  # [query_len, seq_len] bool (True = may attend); None when plainly causal
    block_size: int


def prefill_span(inputs: AttentionInputs, i: int) -> PrefillSpan:
    qsl, seq_lens = inputs.query_start_loc, inputs.seq_lens
    start, q_len, seq_len = int(qsl[i]), int(qsl[i + 1] - qsl[i]), int(seq_lens[i])
    num_blocks = cdiv(seq_len, inputs.block_size)
    block_ids = torch.from_numpy(inputs.block_table[i, :num_blocks]).long()
    mask = None
    if q_len != seq_len:
        # Query token j sits at position seq_len - q_len + j and sees keys up to that position.
        q_pos = torch.arange(seq_len - q_len, seq_len)[:, None]
        mask = torch.arange(seq_len)[None, :] <= q_pos
    return PrefillSpan(start, q_len, seq_len, block_ids, mask, inputs.block_size)


def sdpa_prefill_spans(
    q: torch.Tensor,  # [T, H, hd]
    k: torch.Tensor,  # [T, Hkv, hd], the step's new keys
    v: torch.Tensor,  # [T, Hkv, hd]
    kv_cache: KVCache,
    spans: list[PrefillSpan],
    scale: float,
    out: torch.Tensor,  # [T, H, hd], rows of the spans filled here
    sliding_window: int | None = None,
    alibi_slopes: torch.Tensor | None = None,  # [H] fp32
) -> None:
    """Each prefill chunk through SDPA, over its own fresh K/V (as the cache holds them: for an fp8 cache, the
    caller passes them rounded) or, after cached context, the gathered blocks (of the standard layout): with a
    sliding window, only the blocks from the one holding the first query's first key on; with ALiBi slopes, each
    head's position biases in the mask."""
    key_cache, value_cache = kv_cache
    hkv, hd = k.shape[1], k.shape[2]
    for span in spans:
        s, e = span.query_start, span.query_start + span.query_len
        if span.mask is None:  # no cached context: the chunk's own K/V are the whole context
            mask = None
            if sliding_window is not None or alibi_slopes is not None:
                mask = context_mask(span.query_len, span.query_len, 0, sliding_window, alibi_slopes, q.dtype)
            out[s:e] = sdpa(q[s:e], k[s:e], v[s:e], mask, scale)
            continue
        first_key = 0
        mask = span.mask
        if sliding_window is not None:
            first_query = span.seq_len - span.query_len
            first_key = max(0, first_query - sliding_window + 1) // span.block_size * span.block_size
        if sliding_window is not None or alibi_slopes is not None:
            mask = context_mask(span.query_len, span.seq_len, first_key, sliding_window, alibi_slopes, q.dtype)
        block_ids = span.block_ids[first_key // span.block_size :]
        # .to: an fp8 cache widens (exactly) to q's dtype; a no-op otherwise.
        keys = key_cache.index_select(0, block_ids).reshape(-1, hkv, hd)[: span.seq_len - first_key].to(q.dtype)
        values = value_cache.index_select(0, block_ids).reshape(-1, hkv, hd)[: span.seq_len - first_key].to(q.dtype)
        out[s:e] = sdpa(q[s:e], keys, values, mask, scale)


def window_mask(query_len: int, seq_len: int, first_key: int, window: int | None) -> torch.Tensor:
    """[query_len, seq_len - first_key] bool: the query tokens (the context's last query_len positions) against
    the keys from position first_key on; a query sees the keys up to itself, or with a window, the keys of the
    window ending at itself."""
    q_pos = torch.arange(seq_len - query_len, seq_len)[:, None]
    k_pos = torch.arange(first_key, seq_len)[None, :]
    visible = k_pos <= q_pos
    return visible if window is None else visible & (k_pos > q_pos - window)


def context_mask(
    query_len: int,
    seq_len: int,
    first_key: int,
    window: int | None,
    alibi_slopes: torch.Tensor | None,
    dtype: torch.dtype,
) -> torch.Tensor:
    """SDPA's mask for a chunk: window_mask's bool [query_len, seq_len - first_key], or with ALiBi slopes a float
    [H, query_len, seq_len - first_key] of slope[h] * (key position - query position), -inf where hidden."""
    visible = window_mask(query_len, seq_len, first_key, window)
    if alibi_slopes is None:
        return visible
    q_pos = torch.arange(seq_len - query_len, seq_len)[:, None]
    k_pos = torch.arange(first_key, seq_len)[None, :]
    bias = alibi_slopes.float()[:, None, None] * (k_pos - q_pos).float()  # [H, Q, K]
    return bias.masked_fill_(~visible, float("-inf")).to(dtype)


def sdpa(
    q: torch.Tensor,  # [Q, H, hd]
    keys: torch.Tensor,  # [S, Hkv, hd]
    values: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
) -> torch.Tensor:
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0),  # [1, H, Q, hd]
        keys.transpose(0, 1).unsqueeze(0),
        values.transpose(0, 1).unsqueeze(0),
        attn_mask=mask,
        is_causal=mask is None,
        scale=scale,
        enable_gqa=True,
    )
    return out[0].transpose(0, 1)  # [Q, H, hd]

"""Pieces both CPU backends use: a prefill chunk's span (its blocks and causal mask) and SDPA over it."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
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
    query_mask: torch.Tensor | None = None  # [query_len, query_len] bool among the query tokens (tree attention)


def prefill_span(inputs: AttentionInputs, i: int) -> PrefillSpan:
    qsl, seq_lens = inputs.query_start_loc, inputs.seq_lens
    start, q_len, seq_len = int(qsl[i]), int(qsl[i + 1] - qsl[i]), int(seq_lens[i])
    num_blocks = cdiv(seq_len, inputs.block_size)
    block_ids = torch.from_numpy(inputs.block_table[i, :num_blocks]).long()
    mask = query_mask = None
    if inputs.query_masks is not None and i in inputs.query_masks:
        query_mask = torch.from_numpy(np.asarray(inputs.query_masks[i], dtype=bool))
        assert query_mask.shape == (q_len, q_len), (query_mask.shape, q_len)
    if q_len != seq_len or query_mask is not None:
        mask = window_mask(q_len, seq_len, 0, None, query_mask)
    return PrefillSpan(start, q_len, seq_len, block_ids, mask, inputs.block_size, query_mask)


# A tree's query tokens per request at most: the kernels hold each query token's mask over the keys of the tree in
# one 64-bit word (tree_hidden_keys).
MAX_TREE_QUERY_TOKENS = 64


@functools.cache
def _hidden_bit_weights(q_len: int) -> tuple[np.ndarray, np.ndarray]:
    """For a tree of q_len query tokens: [q, q] uint64 with 2^(r - c) at row r, column c <= r (0 above the
    diagonal), so a row's hidden word is the sum (= the OR: distinct powers) of the weights where its mask is False;
    and the [q, q] bool strictly upper triangle (a token seeing a later one)."""
    r, c = np.indices((q_len, q_len))
    shifts = np.where(c <= r, r - c, 0).astype(np.uint64)
    weights = np.where(c <= r, np.left_shift(np.uint64(1), shifts), np.uint64(0))
    return weights, c > r


def tree_hidden_keys(inputs: AttentionInputs) -> np.ndarray | None:
    """The kernels' form of `inputs.query_masks`: [T] int64, one word per query token of the step, whose bit b hides
    the key at position (the token's own position - b) from it; 0 for every token of a request without a mask.
    None when no request has one (the kernels then run their unmasked path unchanged).

    Query token r of a request sees the keys up to its own slot (its context length is its slot position + 1), so
    its mask row's columns c <= r map to bits r - c; a mask that lets a token see a later query token (not in
    topological order) or a tree of more than 64 query tokens is refused with a ValueError."""
    if not inputs.query_masks:
        return None
    qsl = inputs.query_start_loc
    hidden = np.zeros(int(qsl[-1]), dtype=np.uint64)
    for i, mask in inputs.query_masks.items():
        mask = np.asarray(mask, dtype=bool)
        q_len = int(qsl[i + 1] - qsl[i])
        if mask.shape != (q_len, q_len):
            raise ValueError(f"query_masks[{i}]: shape {mask.shape}, the request has {q_len} query tokens")
        if q_len > MAX_TREE_QUERY_TOKENS:
            raise ValueError(
                f"query_masks[{i}]: a tree of {q_len} query tokens; the attention kernels take at most "
                f"{MAX_TREE_QUERY_TOKENS}"
            )
        weights, upper = _hidden_bit_weights(q_len)
        if (mask & upper).any():
            raise ValueError(f"query_masks[{i}]: a query token may only see earlier ones (topological order)")
        start = int(qsl[i])
        hidden[start : start + q_len] = np.where(mask, np.uint64(0), weights).sum(axis=1, dtype=np.uint64)
    return hidden.view(np.int64)


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
            mask = context_mask(
                span.query_len, span.seq_len, first_key, sliding_window, alibi_slopes, q.dtype, span.query_mask
            )
        block_ids = span.block_ids[first_key // span.block_size :]
        # .to: an fp8 cache widens (exactly) to q's dtype; a no-op otherwise.
        keys = key_cache.index_select(0, block_ids).reshape(-1, hkv, hd)[: span.seq_len - first_key].to(q.dtype)
        values = value_cache.index_select(0, block_ids).reshape(-1, hkv, hd)[: span.seq_len - first_key].to(q.dtype)
        out[s:e] = sdpa(q[s:e], keys, values, mask, scale)


def window_mask(
    query_len: int,
    seq_len: int,
    first_key: int,
    window: int | None,
    query_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """[query_len, seq_len - first_key] bool: the query tokens (the context's last query_len positions) against
    the keys from position first_key on; a query sees the keys up to itself, or with a window, the keys of the
    window ending at itself. A `query_mask` [query_len, query_len] (tree attention) then replaces the causal
    order among the query tokens' own keys (the window still applies on top, by slot position)."""
    q_pos = torch.arange(seq_len - query_len, seq_len)[:, None]
    k_pos = torch.arange(first_key, seq_len)[None, :]
    visible = k_pos <= q_pos
    if query_mask is not None:
        own = seq_len - query_len - first_key  # column of the first query token's own key
        assert own >= 0, "a windowed read must not start inside the tree"
        visible[:, own:] = query_mask
    return visible if window is None else visible & (k_pos > q_pos - window)


def context_mask(
    query_len: int,
    seq_len: int,
    first_key: int,
    window: int | None,
    alibi_slopes: torch.Tensor | None,
    dtype: torch.dtype,
    query_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """SDPA's mask for a chunk: window_mask's bool [query_len, seq_len - first_key], or with ALiBi slopes a float
    [H, query_len, seq_len - first_key] of slope[h] * (key position - query position), -inf where hidden. (With a
    query_mask, ALiBi's positions are the slots' positions, not the tree depths.)"""
    visible = window_mask(query_len, seq_len, first_key, window, query_mask)
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

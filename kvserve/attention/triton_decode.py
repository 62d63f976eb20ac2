"""Decode attention (one query token per request) over the paged KV cache, split into fixed key segments.

Each request's keys are cut into segments of `segment` keys at fixed positions (0, segment, 2 * segment, ...).
The host lists the step's work items, one per (request, segment) (`decode_work`); a kernel program takes work
items for one KV head, and for each writes an unnormalised partial output with its running max and sum; then
`_combine_segments_kernel` merges each request's segments in segment order. The split points depend on key
positions only, never on the batch (its size, the other requests' lengths, the GPU), and a work item's
arithmetic does not depend on which program runs it: a row's result is the same bits whatever batch it runs in,
eagerly or in a CUDA graph of any padded size (batch invariance, issue 32). The prefill kernel
(triton_kernels.paged_attention) sums in another order, so decode rows always come here, in decode-only and in
mixed steps.

Inside a work item, the rows of the tl.dot are the GQA group's query heads (padded to 16, the smallest dot), so
every K/V tile is loaded once for the whole group; each key's head slice (head_dim contiguous elements) is one
wide load, TILE_N keys at a time through the block table.

The grid is fixed by the caller (programs loop over the work items, stride the grid size): an eager step launches
one program per item, a captured graph a fixed number that serves any step (the item count is read from device
memory), so the launch does not depend on the lengths.

Logits are in the log2 domain (scale * log2(e)) so that the softmax uses exp2. Without a GPU the kernels run in
Triton's interpreter (TRITON_INTERPRET=1 before this module is imported).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class DecodeConfig:
    """Launch parameters. `segment` decides the numerics (where a context is split), so it is fixed for a
    backend; the others change only speed (tile_n divides segment)."""

    segment: int = 256  # keys per segment
    tile_n: int = 64  # keys per inner-loop tile
    num_warps: int = 4
    num_stages: int = 2


def decode_work(seq_lens: np.ndarray, segment: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The work items of a decode batch: (request, segment) of each item, requests in order and each request's
    segments in order, and each request's first item. A request of length 0 (padding) has no item.
    [R] lengths -> work_req [W], work_seg [W], first_item [R] (all int32)."""
    segs = -(-np.asarray(seq_lens, dtype=np.int64) // segment)
    first = np.cumsum(segs) - segs
    work_req = np.repeat(np.arange(len(segs)), segs)
    work_seg = np.arange(int(segs.sum())) - np.repeat(first, segs)
    return work_req.astype(np.int32), work_seg.astype(np.int32), first.astype(np.int32)


@triton.jit(do_not_specialize=["stride_bt"])
def _decode_segments_kernel(
    q_ptr,  # [R, H, D] (row r: request r's query token), rows of any stride
    key_cache_ptr,  # [N, B, Hkv, D]
    value_cache_ptr,
    part_ptr,  # [W_cap, H, DIM_PAD] fp32 partial output of each work item
    max_ptr,  # [W_cap, H] fp32 running max (log2 domain)
    sum_ptr,  # [W_cap, H] fp32 softmax denominator
    block_table_ptr,  # [R, W] int32
    seq_lens_ptr,  # [R] int32 keys including this step's
    work_req_ptr,  # [W_cap] int32
    work_seg_ptr,  # [W_cap] int32
    num_work_ptr,  # [1] int32: items this step
    scale_log2,
    stride_qt,
    stride_qh,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_bt,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    SEG_TILES: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    kv_head = tl.program_id(1)
    num_heads = tl.num_programs(1) * GROUP
    rows = tl.arange(0, GROUP_PAD)
    head = kv_head * GROUP + rows
    row_valid = rows < GROUP
    dims = tl.arange(0, DIM_PAD)
    dim_valid = dims < HEAD_DIM
    offs_n = tl.arange(0, TILE_N)
    head_off = kv_head * stride_ch
    num_work = tl.load(num_work_ptr)
    for w in range(tl.program_id(0), num_work, tl.num_programs(0)):
        req = tl.load(work_req_ptr + w).to(tl.int64)
        seg_start = tl.load(work_seg_ptr + w) * (SEG_TILES * TILE_N)
        seq_len = tl.load(seq_lens_ptr + req)
        q = tl.load(
            q_ptr + req * stride_qt + head[:, None] * stride_qh + dims[None, :],
            mask=row_valid[:, None] & dim_valid[None, :],
            other=0.0,
        )  # [GROUP_PAD, DIM_PAD]
        if UPCAST:
            q = q.to(tl.float32)
        m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        l_i = tl.zeros([GROUP_PAD], tl.float32)
        acc = tl.zeros([GROUP_PAD, DIM_PAD], tl.float32)
        table_row = block_table_ptr + req * stride_bt
        num_tiles = tl.minimum(tl.cdiv(seq_len - seg_start, TILE_N), SEG_TILES)
        for t in range(0, num_tiles):
            pos = seg_start + t * TILE_N + offs_n
            key_valid = pos < seq_len
            block = tl.load(table_row + pos // BLOCK_SIZE, mask=key_valid, other=0).to(tl.int64)
            kv_off = block * stride_cb + (pos % BLOCK_SIZE).to(tl.int64) * stride_cs + head_off  # [TILE_N]
            kv_mask = key_valid[:, None] & dim_valid[None, :]
            k = tl.load(key_cache_ptr + kv_off[:, None] + dims[None, :], mask=kv_mask, other=0.0)  # [TILE_N, D]
            v = tl.load(value_cache_ptr + kv_off[:, None] + dims[None, :], mask=kv_mask, other=0.0)
            if UPCAST:
                k = k.to(tl.float32)
                v = v.to(tl.float32)
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2  # [GROUP_PAD, TILE_N]
            s = tl.where(key_valid[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))  # finite: every tile holds a valid key
            p = tl.exp2(s - m_new[:, None])
            alpha = tl.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
            m_i = m_new
        stat = head.to(tl.int64) + w * num_heads  # [GROUP_PAD]
        tl.store(part_ptr + stat[:, None] * DIM_PAD + dims[None, :], acc, mask=row_valid[:, None])
        tl.store(max_ptr + stat, m_i, mask=row_valid)
        tl.store(sum_ptr + stat, l_i, mask=row_valid)


@triton.jit
def _combine_segments_kernel(
    out_ptr,  # [R, H, D]
    part_ptr,  # [W_cap, H, DIM_PAD] fp32
    max_ptr,  # [W_cap, H] fp32
    sum_ptr,
    seq_lens_ptr,  # [R] int32
    first_item_ptr,  # [R] int32
    stride_ot,
    stride_oh,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,
    SEG_KEYS: tl.constexpr,
    SEG_CHUNK: tl.constexpr,  # segments merged per pass (a power of 2)
):
    req = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    num_segs = tl.cdiv(tl.load(seq_lens_ptr + req), SEG_KEYS)
    first = tl.load(first_item_ptr + req).to(tl.int64)
    dims = tl.arange(0, DIM_PAD)
    offs = tl.arange(0, SEG_CHUNK)
    # Two passes over the segments, in order: the overall max, then the weighted sums.
    m_max = float("-inf")
    for c in range(0, num_segs, SEG_CHUNK):
        seg_valid = c + offs < num_segs
        m = tl.load(max_ptr + (first + c + offs) * NUM_HEADS + head, mask=seg_valid, other=float("-inf"))
        m_max = tl.maximum(m_max, tl.max(m, 0))
    denom = 0.0
    acc = tl.zeros([DIM_PAD], tl.float32)
    for c in range(0, num_segs, SEG_CHUNK):
        seg_valid = c + offs < num_segs
        stat = (first + c + offs) * NUM_HEADS + head
        m = tl.load(max_ptr + stat, mask=seg_valid, other=float("-inf"))
        weight = tl.where(seg_valid, tl.exp2(m - m_max), 0.0)
        denom += tl.sum(weight * tl.load(sum_ptr + stat, mask=seg_valid, other=0.0), 0)
        part = tl.load(part_ptr + stat[:, None] * DIM_PAD + dims[None, :], mask=seg_valid[:, None], other=0.0)
        acc += tl.sum(part * weight[:, None], 0)
    # A padding row (no keys, no items) gets 0 rather than 0 / 0.
    out = acc / tl.where(denom == 0.0, 1.0, denom)
    tl.store(
        out_ptr + req * stride_ot + head * stride_oh + dims, out.to(out_ptr.dtype.element_ty), mask=dims < HEAD_DIM
    )


def decode_attention(
    q: torch.Tensor,  # [R, H, D]: one query token per request, rows of any stride, each head contiguous
    key_cache: torch.Tensor,  # [N, B, Hkv, D] contiguous
    value_cache: torch.Tensor,
    out: torch.Tensor,  # [R, H, D], written here (rows of any stride, each head contiguous)
    block_table: torch.Tensor,  # [R, W] int32
    seq_lens: torch.Tensor,  # [R] int32, keys including this step's; 0 = padding row (output 0)
    work_req: torch.Tensor,  # [W_cap] int32 (decode_work), the step's items first
    work_seg: torch.Tensor,  # [W_cap] int32
    first_item: torch.Tensor,  # [R] int32
    num_work: torch.Tensor,  # [1] int32, items this step (<= W_cap)
    scale: float,
    config: DecodeConfig,
    num_programs: int | None = None,  # programs per KV head (None: one per item of W_cap)
) -> torch.Tensor:
    """Attention of each request's single query token over its keys (this step's K/V written first). Returns
    `out`."""
    num_reqs, num_heads, head_dim = q.shape
    capacity = work_req.shape[0]
    if num_reqs == 0 or capacity == 0:
        return out
    num_kv_heads = key_cache.shape[2]
    group = num_heads // num_kv_heads
    assert config.segment % config.tile_n == 0
    assert q.stride(2) == 1 and out.stride(2) == 1 and key_cache.is_contiguous() and value_cache.is_contiguous()
    dim_pad = max(16, triton.next_power_of_2(head_dim))
    partial = torch.empty(capacity, num_heads, dim_pad, dtype=torch.float32, device=q.device)
    max_buf = torch.empty(capacity, num_heads, dtype=torch.float32, device=q.device)
    sum_buf = torch.empty_like(max_buf)
    on_gpu = q.device.type == "cuda"
    launch = {"num_warps": config.num_warps, "num_stages": config.num_stages} if on_gpu else {}
    programs = capacity if num_programs is None else min(num_programs, capacity)
    _decode_segments_kernel[(programs, num_kv_heads)](
        q,
        key_cache,
        value_cache,
        partial,
        max_buf,
        sum_buf,
        block_table,
        seq_lens,
        work_req,
        work_seg,
        num_work,
        scale * LOG2E,
        q.stride(0),
        q.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        block_table.stride(0),
        GROUP=group,
        GROUP_PAD=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim,
        DIM_PAD=dim_pad,
        BLOCK_SIZE=key_cache.shape[1],
        TILE_N=config.tile_n,
        SEG_TILES=config.segment // config.tile_n,
        # fp32 models get fp32 dots (Triton's default for fp32 is tf32: no HF parity).
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        UPCAST=not on_gpu,  # the interpreter's tl.dot mishandles bf16 and fp16
        **launch,
    )
    _combine_segments_kernel[(num_reqs, num_heads)](
        out,
        partial,
        max_buf,
        sum_buf,
        seq_lens,
        first_item,
        out.stride(0),
        out.stride(1),
        NUM_HEADS=num_heads,
        HEAD_DIM=head_dim,
        DIM_PAD=dim_pad,
        SEG_KEYS=config.segment,
        SEG_CHUNK=8,
    )
    return out

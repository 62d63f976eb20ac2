"""Decode attention (one query token per request) over the paged KV cache, split into fixed key segments.

Each request's keys are cut into segments of `segment` keys at fixed positions (0, segment, 2 * segment, ...).
For every segment the kernel computes an unnormalised partial output with its running max and sum, from a fresh
start at the segment's first key; the request's segments are then merged in segment order, in the same launch.
The split points depend on key positions only, never on the batch (its size, the other requests' lengths, the
GPU), so a row's result is the same bits whatever batch it runs in, eagerly or in a CUDA graph of any padded
size (batch invariance, issue 32). The prefill kernel (triton_kernels.paged_attention) sums in another order, so
decode rows always come here, in decode-only and in mixed steps.

A program takes one request, one KV head and a run of up to `segs_per_program` consecutive segments, in one loop
over their key tiles (a long loop keeps the loads pipelined; each segment's partial is stored, and the running
state reset, as the loop crosses the segment's end). Which program computes a segment changes no bit of it, so
the run length is chosen per launch from the batch size alone (`segments_per_program`): a large batch gives each
request one program (requests x KV heads programs already fill the GPU), a small one splits long contexts over
several. The grid, (requests x programs per request, KV heads), depends on the batch size and the longest context
allowed, not on the lengths: a captured graph serves any step, and programs past a request's last segment only
count themselves in. The program that finishes last among a (request, KV head)'s merges them (a count per pair in
`arrived`, zero between launches): a separate merge kernel cost ~2.2 us a layer at batch 1 on an H200, a
launch and its gap included.

Inside a program, the rows of the tl.dot are the GQA group's query heads (padded to 16, the smallest dot), so
every K/V tile is loaded once for the whole group; each key's head slice (head_dim contiguous elements) is one
wide load, TILE_N keys at a time through the block table.

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

    # One tile a segment: at batch 1 (Llama-3-8B shape, 704 keys, H200) the kernel took 263-267 us a step against
    # 333-336 with 256-key segments (twice the programs, each one tile deep), and the nano-vllm workload at batch
    # 256 ran as fast (issue 35's fourth session, docs/benchmarks.md).
    segment: int = 128  # keys per segment
    # 128-key tiles, 2 stages: of 14 configs timed on an H200 (one layer, graph replays, docs/benchmarks.md), the
    # fastest at batch 256 (386 us vs 394 for 64-key tiles) and among the fastest at batch 1 (11.4 vs 13.7 us).
    tile_n: int = 128  # keys per inner-loop tile
    num_warps: int = 4
    num_stages: int = 2
    merge_segs: int = 0  # segments' partials the merge loads at once; 0: ~4K fp32 values' worth (tests set it)


def first_segments(seq_lens: np.ndarray, segment: int) -> np.ndarray:
    """Each request's first slot in the partial buffers: its segments are stored in order, request after request.
    [R] lengths -> [R] int32 (a request of length 0, padding, has no segment)."""
    segs = -(-np.asarray(seq_lens, dtype=np.int64) // segment)
    return (np.cumsum(segs) - segs).astype(np.int32)


def segments_per_program(num_reqs: int, max_segments: int, num_kv_heads: int, target_programs: int) -> int:
    """Consecutive segments one program runs: the most (doubling from 1) that still leave `target_programs`
    programs in all, so that a large batch walks each context in one loop and a small one splits it. Depends on
    the batch size and the longest context allowed, never on the lengths."""
    per_program = 1
    while per_program < max_segments:
        programs = num_reqs * num_kv_heads * triton.cdiv(max_segments, 2 * per_program)
        if programs < target_programs:
            break
        per_program *= 2
    return min(per_program, max_segments)


@triton.jit(do_not_specialize=["stride_bt", "segs_per_program", "programs_per_req", "window"])
def _decode_segments_kernel(
    q_ptr,  # [R, H, D] (row r: request r's query token), rows of any stride
    key_cache_ptr,  # [N, B, Hkv, D]
    value_cache_ptr,
    out_ptr,  # [R, H, D], rows of any stride
    part_ptr,  # [S_cap, H, DIM_PAD] fp32 partial output of each segment
    max_ptr,  # [S_cap, H] fp32 running max (log2 domain)
    sum_ptr,  # [S_cap, H] fp32 softmax denominator
    arrived_ptr,  # [>= R * Hkv] int32, zero between launches: programs of a (request, KV head) done so far
    block_table_ptr,  # [R, W] int32
    seq_lens_ptr,  # [R] int32 keys including this step's; 0 = padding row
    first_seg_ptr,  # [R] int32 each request's first partial slot
    scale_log2,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_bt,
    segs_per_program,
    programs_per_req,
    window,  # the query sees its last `window` keys; 0: all of them
    alibi_ptr,  # [H] fp32 ALiBi slopes; unused without ALIBI
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    GROUP_P2: tl.constexpr,  # GROUP rounded up to a power of 2: the merge's rows
    MERGE_SEGS: tl.constexpr,  # segments the merge loads at once (a power of 2)
    HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    SEG_TILES: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    ALIBI: tl.constexpr,  # add slope * (key position - query position) to each head's scores
):
    pid = tl.program_id(0)
    req = pid // programs_per_req
    kv_head = tl.program_id(1)
    num_heads = tl.num_programs(1) * GROUP
    rows = tl.arange(0, GROUP_PAD)
    head = kv_head * GROUP + rows
    row_valid = rows < GROUP
    dims = tl.arange(0, DIM_PAD)
    dim_valid = dims < HEAD_DIM
    req64 = req.to(tl.int64)
    # Issued together, before the length is known: at small batches each program is short and these latencies
    # would otherwise add up one after the other.
    seq_len = tl.load(seq_lens_ptr + req)
    q = tl.load(
        q_ptr + req64 * stride_qt + head[:, None] * stride_qh + dims[None, :],
        mask=row_valid[:, None] & dim_valid[None, :],
        other=0.0,
    )  # [GROUP_PAD, DIM_PAD]
    stat_base = tl.load(first_seg_ptr + req).to(tl.int64) * num_heads + head  # [GROUP_PAD]
    # This program's key tiles: those of its run of segments that the request has, from the tile of the first
    # key in the window on (a sliding window: the segments before the window's segment are left unwritten and
    # skipped by the merge; no key before the window is loaded, its block may belong to another request).
    lo = tl.where(window > 0, tl.maximum(seq_len - window, 0), 0)
    tile_lo = (pid % programs_per_req) * segs_per_program * SEG_TILES
    tile_hi = tl.minimum(tile_lo + segs_per_program * SEG_TILES, tl.cdiv(seq_len, TILE_N))
    tile_lo = tl.maximum(tile_lo, lo // TILE_N)
    if tile_lo < tile_hi:
        offs_n = tl.arange(0, TILE_N)
        if UPCAST:
            q = q.to(tl.float32)
        table_row = block_table_ptr + req64 * stride_bt
        head_off = kv_head * stride_ch
        m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        l_i = tl.zeros([GROUP_PAD], tl.float32)
        acc = tl.zeros([GROUP_PAD, DIM_PAD], tl.float32)
        if ALIBI:
            slope_log2 = tl.load(alibi_ptr + head, mask=row_valid, other=0.0) * 1.4426950408889634  # [GROUP_PAD]
        for t in range(tile_lo, tile_hi):
            pos = t * TILE_N + offs_n
            key_valid = (pos < seq_len) & (pos >= lo)
            block = tl.load(table_row + pos // BLOCK_SIZE, mask=key_valid, other=0).to(tl.int64)
            kv_off = block * stride_cb + (pos % BLOCK_SIZE).to(tl.int64) * stride_cs + head_off  # [TILE_N]
            kv_mask = key_valid[:, None] & dim_valid[None, :]
            k = tl.load(key_cache_ptr + kv_off[:, None] + dims[None, :], mask=kv_mask, other=0.0)  # [TILE_N, D]
            v = tl.load(value_cache_ptr + kv_off[:, None] + dims[None, :], mask=kv_mask, other=0.0)
            if UPCAST:
                k = k.to(tl.float32)
                v = v.to(tl.float32)
            k = k.to(q.dtype)  # an fp8 cache widens to q's dtype; a no-op otherwise
            v = v.to(q.dtype)
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2  # [GROUP_PAD, TILE_N]
            if ALIBI:  # the query sits at position seq_len - 1
                s += slope_log2[:, None] * (pos - seq_len + 1).to(tl.float32)[None, :]
            s = tl.where(key_valid[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))  # finite: every tile from the window's first holds a valid key
            p = tl.exp2(s - m_new[:, None])
            alpha = tl.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
            m_i = m_new
            # At a segment's last tile: store its partial and start the next one afresh (masked, not branched, so
            # the loop stays one straight body for the compiler to pipeline).
            seg_end = ((t + 1) % SEG_TILES == 0) | (t + 1 == tile_hi)
            stat = stat_base + (t // SEG_TILES) * num_heads
            store = row_valid & seg_end
            tl.store(part_ptr + stat[:, None] * DIM_PAD + dims[None, :], acc, mask=store[:, None])
            tl.store(max_ptr + stat, m_i, mask=store)
            tl.store(sum_ptr + stat, l_i, mask=store)
            acc = tl.where(seg_end, 0.0, acc)
            l_i = tl.where(seg_end, 0.0, l_i)
            m_i = tl.where(seg_end, float("-inf"), m_i)

    # The merge, in the program that finishes last among its request's (for this KV head): each program counts
    # itself in once its partials are stored (the barrier orders all its threads' stores before the release);
    # the one that sees every other program counted reads all partials and resets the count for the next launch.
    # One program per request (large batches) merges without the count. Either way the merge reads the stored
    # partials in segment order, so its bits do not depend on which program ran which segment.
    arrived = programs_per_req - 1
    if programs_per_req > 1:
        tl.debug_barrier()
        arrived = tl.atomic_add(arrived_ptr + req * tl.num_programs(1) + kv_head, 1, sem="acq_rel")
    if arrived == programs_per_req - 1:
        if programs_per_req > 1:
            tl.store(arrived_ptr + req * tl.num_programs(1) + kv_head, 0)
        tl.debug_barrier()  # this program's own partials, stored by other threads, are read below
        _merge_segments(
            out_ptr + req64 * stride_ot,
            part_ptr,
            max_ptr,
            sum_ptr,
            tl.load(first_seg_ptr + req).to(tl.int64),
            kv_head * GROUP,
            num_heads,
            stride_oh,
            lo // (SEG_TILES * TILE_N),  # with a window, the segments before its first key's were not written
            tl.cdiv(seq_len, SEG_TILES * TILE_N),
            GROUP,
            GROUP_P2,
            HEAD_DIM,
            DIM_PAD,
            MERGE_SEGS,
        )


@triton.jit
def _merge_segments(
    out_row_ptr,  # the request's output row [H, D]
    part_ptr,
    max_ptr,
    sum_ptr,
    first_slot,  # the request's first partial slot
    head0,  # the KV head's first query head
    num_heads,
    stride_oh,
    seg_lo,
    num_segs,
    GROUP: tl.constexpr,
    GROUP_P2: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,
    MERGE_SEGS: tl.constexpr,
):
    """The GQA group's outputs from its segments' partials, MERGE_SEGS segments' loads in flight at a time (one
    round trip for contexts up to MERGE_SEGS segments), merged in segment order."""
    rows = tl.arange(0, GROUP_P2)
    row_valid = rows < GROUP
    dims = tl.arange(0, DIM_PAD)
    offs = tl.arange(0, MERGE_SEGS)
    m_run = tl.full([GROUP_P2], float("-inf"), tl.float32)
    denom = tl.zeros([GROUP_P2], tl.float32)
    acc = tl.zeros([GROUP_P2, DIM_PAD], tl.float32)
    for c in range(seg_lo, num_segs, MERGE_SEGS):
        valid = (c + offs < num_segs)[:, None] & row_valid[None, :]  # [MERGE_SEGS, GROUP_P2]
        stat = (first_slot + c + offs)[:, None] * num_heads + head0 + rows[None, :]
        m = tl.load(max_ptr + stat, mask=valid, other=float("-inf"), cache_modifier=".cg")
        l_seg = tl.load(sum_ptr + stat, mask=valid, other=0.0, cache_modifier=".cg")
        part = tl.load(
            part_ptr + stat[:, :, None] * DIM_PAD + dims[None, None, :],
            mask=valid[:, :, None],
            other=0.0,
            cache_modifier=".cg",
        )  # [MERGE_SEGS, GROUP_P2, DIM_PAD]
        m_new = tl.maximum(m_run, tl.max(m, 0))  # finite on valid rows: every segment holds a key
        a = tl.exp2(m_run - m_new)
        w = tl.where(valid, tl.exp2(m - m_new[None, :]), 0.0)
        denom = denom * a + tl.sum(l_seg * w, 0)
        acc = acc * a[:, None] + tl.sum(part * w[:, :, None], 0)
        m_run = m_new
    # A padding row (no keys, no segments) gets 0 rather than 0 / 0.
    out = acc / tl.where(denom == 0.0, 1.0, denom)[:, None]
    tl.store(
        out_row_ptr + (head0 + rows)[:, None] * stride_oh + dims[None, :],
        out.to(out_row_ptr.dtype.element_ty),
        mask=row_valid[:, None] & (dims < HEAD_DIM)[None, :],
    )


def decode_attention(
    q: torch.Tensor,  # [R, H, D]: one query token per request, rows of any stride, each head contiguous
    key_cache: torch.Tensor,  # [N, B, Hkv, D] contiguous
    value_cache: torch.Tensor,
    out: torch.Tensor,  # [R, H, D], written here (rows of any stride, each head contiguous)
    block_table: torch.Tensor,  # [R, W] int32
    seq_lens: torch.Tensor,  # [R] int32, keys including this step's; 0 = padding row (output 0)
    first_seg: torch.Tensor,  # [R] int32 (first_segments)
    num_slots: int,  # partial slots to allocate: >= the step's total segments
    max_segments: int,  # >= every request's segments: cdiv(longest length allowed, config.segment)
    segs_per_program: int,  # segments_per_program(R, max_segments, ...)
    scale: float,
    config: DecodeConfig,
    window: int = 0,
    alibi_slopes: torch.Tensor | None = None,
    arrived: torch.Tensor | None = None,  # [>= R * Hkv] int32 zeros, left zero (made here when None)
) -> torch.Tensor:
    """Attention of each request's single query token over its keys (this step's K/V written first), or with
    `window` > 0 over its last `window` keys only; `alibi_slopes` ([H] fp32): head h's score of key position k
    gets slope[h] * (k - the query's position). Returns `out`."""
    num_reqs, num_heads, head_dim = q.shape
    if num_reqs == 0 or num_slots == 0:
        return out
    num_kv_heads = key_cache.shape[2]
    group = num_heads // num_kv_heads
    assert config.segment % config.tile_n == 0
    assert q.stride(2) == 1 and out.stride(2) == 1 and key_cache.is_contiguous() and value_cache.is_contiguous()
    dim_pad = max(16, triton.next_power_of_2(head_dim))
    partial = torch.empty(num_slots, num_heads, dim_pad, dtype=torch.float32, device=q.device)
    max_buf = torch.empty(num_slots, num_heads, dtype=torch.float32, device=q.device)
    sum_buf = torch.empty_like(max_buf)
    on_gpu = q.device.type == "cuda"
    launch = {"num_warps": config.num_warps, "num_stages": config.num_stages} if on_gpu else {}
    programs_per_req = triton.cdiv(max_segments, segs_per_program)
    if arrived is None:
        arrived = torch.zeros(num_reqs * num_kv_heads, dtype=torch.int32, device=q.device)
    assert arrived.numel() >= num_reqs * num_kv_heads
    group_p2 = triton.next_power_of_2(group)
    _decode_segments_kernel[(num_reqs * programs_per_req, num_kv_heads)](
        q,
        key_cache,
        value_cache,
        out,
        partial,
        max_buf,
        sum_buf,
        arrived,
        block_table,
        seq_lens,
        first_seg,
        scale * LOG2E,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        block_table.stride(0),
        segs_per_program,
        programs_per_req,
        window,
        alibi_slopes if alibi_slopes is not None else max_buf,
        GROUP=group,
        GROUP_PAD=max(16, group_p2),
        GROUP_P2=group_p2,
        # ~4K fp32 of partials loaded at once (8 segments of a 4-head group of 128 dims)
        MERGE_SEGS=config.merge_segs or max(1, min(16, 4096 // (group_p2 * dim_pad))),
        HEAD_DIM=head_dim,
        DIM_PAD=dim_pad,
        BLOCK_SIZE=key_cache.shape[1],
        TILE_N=config.tile_n,
        SEG_TILES=config.segment // config.tile_n,
        # fp32 models get fp32 dots (Triton's default for fp32 is tf32: no HF parity).
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        UPCAST=not on_gpu,  # the interpreter's tl.dot mishandles bf16 and fp16
        ALIBI=alibi_slopes is not None,
        **launch,
    )
    return out

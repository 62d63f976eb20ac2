"""The Triton paged-attention kernels (attention/triton_kernels.py, triton_decode.py, triton_backend.py) against
plain per-sequence causal attention and the torch reference backend.

On a machine with CUDA they run on the GPU; elsewhere on the CPU in Triton's interpreter (tests/conftest.py sets
TRITON_INTERPRET=1 before anything imports Triton), with small shapes: the interpreter runs every program
instance in Python.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from kvserve.attention.base import AttentionInputs
from kvserve.attention.torch_ref import TorchRefAttentionBackend
from kvserve.layers.alibi import alibi_slopes

pytest.importorskip("triton")

from kvserve.attention import triton_kernels  # noqa: E402
from kvserve.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from kvserve.attention.triton_decode import DecodeConfig, first_segments, segments_per_program  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# In the interpreter the kernels do not depend on the CPU's ISA level: once, in the native run, is enough.
pytestmark = pytest.mark.skipif(
    DEVICE == "cpu" and bool(os.environ.get("KVSERVE_CPU_ISA")), reason="forced ISA level: Triton tests run once"
)
TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}


def reference_attention(q, k, v, scale, window=None, slopes=None):
    """q [Q, H, D]: the last Q positions of a sequence whose keys/values are k, v [S, Hkv, D]; fp32 result. With a
    window, each position sees its last `window` keys, itself included; with ALiBi slopes [H], head h's score of a
    key gets slope[h] * (key position - query position)."""
    num_q, num_heads, _ = q.shape
    s, num_kv, _ = k.shape
    group = num_heads // num_kv
    k = k.repeat_interleave(group, dim=1).float()
    v = v.repeat_interleave(group, dim=1).float()
    scores = torch.einsum("qhd,shd->hqs", q.float(), k) * scale
    q_pos = torch.arange(s - num_q, s, device=q.device)[:, None]
    k_pos = torch.arange(s, device=q.device)[None, :]
    hidden = k_pos > q_pos
    if window is not None:
        hidden |= k_pos <= q_pos - window
    if slopes is not None:
        scores = scores + slopes.float()[:, None, None] * (k_pos - q_pos).float()
    scores = scores.masked_fill(hidden, float("-inf"))
    return torch.einsum("hqs,shd->qhd", scores.softmax(-1), v)


@dataclass
class Batch:
    inputs: AttentionInputs
    key_cache: torch.Tensor  # [N, B, Hkv, D], the cached contexts in place
    value_cache: torch.Tensor
    q: torch.Tensor  # [T, H, D]
    k_new: torch.Tensor  # [T, Hkv, D]
    v_new: torch.Tensor
    full_k: list[torch.Tensor]  # per request [S, Hkv, D]: context then new tokens
    full_v: list[torch.Tensor]
    slots: np.ndarray  # [T]


def make_batch(seqs, num_heads, num_kv_heads, head_dim, block_size, dtype, seed=0, spare_blocks=3) -> Batch:
    """`seqs`: (cached context, new query tokens) per request, single-token ones first. Blocks are handed out in
    shuffled order, as a real pool does after churn; the cache starts as random junk, not zeros."""
    gen = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(dtype)

    num_blocks = sum(math.ceil((c + n) / block_size) for c, n in seqs) + spare_blocks
    key_cache = randn(num_blocks, block_size, num_kv_heads, head_dim)
    value_cache = randn(num_blocks, block_size, num_kv_heads, head_dim)
    free = list(rng.permutation(num_blocks))
    max_blocks = max(math.ceil((c + n) / block_size) for c, n in seqs)
    block_table = np.zeros((len(seqs), max_blocks), dtype=np.int32)
    full_k, full_v, slots = [], [], []
    for i, (ctx, n) in enumerate(seqs):
        nb = math.ceil((ctx + n) / block_size)
        block_table[i, :nb] = [free.pop() for _ in range(nb)]
        full_k.append(randn(ctx + n, num_kv_heads, head_dim))
        full_v.append(randn(ctx + n, num_kv_heads, head_dim))
        for pos in range(ctx + n):
            b, off = block_table[i, pos // block_size], pos % block_size
            if pos < ctx:
                key_cache[b, off] = full_k[i][pos]
                value_cache[b, off] = full_v[i][pos]
            else:
                slots.append(int(b) * block_size + off)
    q_lens = np.array([n for _, n in seqs])
    inputs = AttentionInputs(
        num_decodes=int(np.count_nonzero(q_lens == 1)),
        query_start_loc=np.concatenate([[0], np.cumsum(q_lens)]),
        seq_lens=np.array([c + n for c, n in seqs]),
        block_table=block_table,
        slot_mapping=np.array(slots, dtype=np.int64),
        block_size=block_size,
    )
    dev = torch.device(DEVICE)
    return Batch(
        inputs=inputs,
        key_cache=key_cache.to(dev),
        value_cache=value_cache.to(dev),
        q=randn(int(q_lens.sum()), num_heads, head_dim).to(dev),
        k_new=torch.cat([full_k[i][c:] for i, (c, _) in enumerate(seqs)]).to(dev),
        v_new=torch.cat([full_v[i][c:] for i, (c, _) in enumerate(seqs)]).to(dev),
        full_k=[k.to(dev) for k in full_k],
        full_v=[v.to(dev) for v in full_v],
        slots=np.array(slots),
    )


def check_against_reference(
    batch: Batch, out: torch.Tensor, num_heads: int, head_dim: int, dtype, window: int | None = None, slopes=None
) -> None:
    qsl = batch.inputs.query_start_loc
    for i in range(len(batch.full_k)):
        s, e = int(qsl[i]), int(qsl[i + 1])
        q, k, v = batch.q[s:e], batch.full_k[i], batch.full_v[i]
        want = reference_attention(q, k, v, head_dim**-0.5, window, slopes)
        got = out[s:e].view(e - s, num_heads, head_dim).float()
        torch.testing.assert_close(got, want, atol=TOL[dtype], rtol=TOL[dtype], msg=f"request {i}")


def run_backend(backend: TritonAttentionBackend, batch: Batch) -> torch.Tensor:
    md = backend.build_metadata(batch.inputs)
    kv = (batch.key_cache, batch.value_cache)
    return backend.forward(batch.q, batch.k_new, batch.v_new, kv, md, backend.head_dim**-0.5)


# (cached context, new tokens): decodes (one spanning many blocks), decodes carrying 2 and 4 draft tokens, a
# prompt with no cached context, and prefill chunks after a cached prefix.
MIXED = [(37, 1), (0, 1), (150, 1), (23, 3), (70, 5), (0, 21), (50, 37), (9, 2)]


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_dim",
    [(4, 4, 64), (8, 2, 128), (8, 1, 64)],
    ids=["mha-d64", "gqa4-d128", "gqa8-d64"],
)
def test_mixed_batch_matches_reference(num_heads, num_kv_heads, head_dim, block_size):
    dtype = torch.float32
    batch = make_batch(MIXED, num_heads, num_kv_heads, head_dim, block_size, dtype)
    backend = TritonAttentionBackend(num_heads, num_kv_heads, head_dim, dtype, DEVICE)
    out = run_backend(backend, batch)
    assert out.shape == (len(batch.slots), num_heads * head_dim)
    check_against_reference(batch, out, num_heads, head_dim, dtype)
    # The new tokens' K/V were written where the slot mapping says.
    slots = torch.from_numpy(batch.slots).to(batch.key_cache.device)
    assert torch.equal(batch.key_cache.view(-1, num_kv_heads, head_dim)[slots], batch.k_new)
    assert torch.equal(batch.value_cache.view(-1, num_kv_heads, head_dim)[slots], batch.v_new)


@pytest.mark.parametrize("tile_n", [16, 64])
def test_bf16_and_tiles_smaller_and_larger_than_a_block(tile_n):
    """bf16 inputs (fp32 accumulation) and key tiles that cover part of a block or several blocks."""
    dtype = torch.bfloat16
    batch = make_batch(MIXED, 8, 2, 64, 32, dtype, seed=1)
    backend = TritonAttentionBackend(8, 2, 64, dtype, DEVICE, tile_n=tile_n)
    check_against_reference(batch, run_backend(backend, batch), 8, 64, dtype)


def test_agrees_with_the_torch_reference_backend():
    """Same batch, same cache layout: the Triton backend and attention/torch_ref.py give the same outputs and
    leave the same cache."""
    dtype = torch.float32
    seqs = [(5, 1), (40, 1), (0, 12), (17, 9)]
    a = make_batch(seqs, 8, 2, 64, 16, dtype, seed=2)
    b = make_batch(seqs, 8, 2, 64, 16, dtype, seed=2)
    got = run_backend(TritonAttentionBackend(8, 2, 64, dtype, DEVICE), a)
    ref = TorchRefAttentionBackend(8, 2, 64, dtype)
    cpu = (b.key_cache.cpu(), b.value_cache.cpu())
    want = ref.forward(b.q.cpu(), b.k_new.cpu(), b.v_new.cpu(), cpu, ref.build_metadata(b.inputs), 64**-0.5)
    torch.testing.assert_close(got.cpu(), want, atol=1e-4, rtol=1e-4)
    assert torch.equal(a.key_cache.cpu(), cpu[0]) and torch.equal(a.value_cache.cpu(), cpu[1])


@pytest.mark.parametrize("seed", [3, 4, 5])
def test_random_batches(seed):
    rng = np.random.default_rng(seed)
    group = [1, 4, 8][seed % 3]
    num_kv_heads = int(rng.integers(1, 3))
    head_dim = [64, 128][seed % 2]
    block_size = [16, 32][seed % 2]
    num_decodes, num_prefills = int(rng.integers(1, 5)), int(rng.integers(0, 3))
    seqs = [(int(rng.integers(0, 200)), 1) for _ in range(num_decodes)]
    seqs += [(int(rng.integers(0, 80)), int(rng.integers(2, 40))) for _ in range(num_prefills)]
    num_heads = group * num_kv_heads
    batch = make_batch(seqs, num_heads, num_kv_heads, head_dim, block_size, torch.float32, seed=seed)
    backend = TritonAttentionBackend(num_heads, num_kv_heads, head_dim, torch.float32, DEVICE)
    check_against_reference(batch, run_backend(backend, batch), num_heads, head_dim, torch.float32)


@pytest.mark.parametrize("num_splits", [1, 4])
@pytest.mark.parametrize("window", [7, 40])
def test_sliding_window_matches_reference_and_reads_only_the_window(window, num_splits):
    """Each token sees its last `window` keys. The blocks wholly before the window of a request's first query
    token hold NaN (the scheduler may have given them to another request): no output may show it. Decode
    segments of 32 keys, so a window starts segments and tiles in: those before it are skipped."""
    dtype = torch.float32
    batch = make_batch(MIXED, 8, 2, 64, 16, dtype, seed=2)
    table = batch.inputs.block_table
    for i, (ctx, _) in enumerate(MIXED):
        for j in range(max(0, ctx - window + 1) // 16):
            batch.key_cache[int(table[i, j])] = float("nan")
            batch.value_cache[int(table[i, j])] = float("nan")
    backend = TritonAttentionBackend(8, 2, 64, dtype, DEVICE, tile_n=16, decode_config=DecodeConfig(32, 16))
    md = backend.build_metadata(batch.inputs)
    md.num_splits = num_splits
    kv = (batch.key_cache, batch.value_cache)
    out = backend.forward(batch.q, batch.k_new, batch.v_new, kv, md, 64**-0.5, window)
    assert torch.isfinite(out).all()
    check_against_reference(batch, out, 8, 64, dtype, window)


@pytest.mark.parametrize("num_splits", [1, 4])
@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(6, 6), (8, 2)])
def test_alibi_matches_reference_and_the_torch_reference_backend(num_heads, num_kv_heads, window, num_splits):
    """ALiBi (HF's slopes; 6 heads takes the rule for head counts that are not a power of two) in the prefill and
    decode kernels, with split-K and decode segments of 32 keys (a bias that grows over many segments), alone and
    with a window; against plain attention and the torch reference backend given the same slopes."""
    dtype = torch.float32
    batch = make_batch(MIXED, num_heads, num_kv_heads, 64, 16, dtype, seed=7)
    ref_batch = make_batch(MIXED, num_heads, num_kv_heads, 64, 16, dtype, seed=7)
    slopes = alibi_slopes(num_heads)
    backend = TritonAttentionBackend(
        num_heads, num_kv_heads, 64, dtype, DEVICE, tile_n=16, decode_config=DecodeConfig(32, 16)
    )
    md = backend.build_metadata(batch.inputs)
    md.num_splits = num_splits
    kv = (batch.key_cache, batch.value_cache)
    out = backend.forward(batch.q, batch.k_new, batch.v_new, kv, md, 64**-0.5, window, slopes.to(DEVICE))
    check_against_reference(batch, out, num_heads, 64, dtype, window, slopes.to(DEVICE))
    ref = TorchRefAttentionBackend(num_heads, num_kv_heads, 64, dtype)
    b = ref_batch
    cpu = (b.key_cache.cpu(), b.value_cache.cpu())
    md_ref = ref.build_metadata(b.inputs)
    want = ref.forward(b.q.cpu(), b.k_new.cpu(), b.v_new.cpu(), cpu, md_ref, 64**-0.5, window, slopes)
    torch.testing.assert_close(out.cpu(), want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("num_splits", [2, 4, 16])
def test_split_k_decode_long_contexts(num_splits):
    """Split-K (partial softmax per key segment, then the reduction) on decodes whose contexts span many blocks,
    next to a short one whose later segments are empty; also multi-token decode rows."""
    dtype = torch.float32
    seqs = [(300, 1), (3, 1), (211, 1), (180, 3)]
    batch = make_batch(seqs, 8, 2, 64, 16, dtype, seed=6)
    backend = TritonAttentionBackend(8, 2, 64, dtype, DEVICE, tile_n=16)
    md = backend.build_metadata(batch.inputs)
    md.num_splits = num_splits
    out = backend.forward(batch.q, batch.k_new, batch.v_new, (batch.key_cache, batch.value_cache), md, 64**-0.5)
    check_against_reference(batch, out, 8, 64, dtype)


def test_split_k_is_chosen_for_few_long_draft_rows_only():
    """The prefill kernel's split-K: for few long rows of several query tokens (drafts) and no prefill chunk;
    single-token decodes take the segment kernel and do not count."""
    backend = TritonAttentionBackend(8, 2, 64, torch.float32, DEVICE, tile_n=16, target_programs=64)
    drafts = make_batch([(300, 2), (200, 3)], 8, 2, 64, 16, torch.float32)
    assert backend.build_metadata(drafts.inputs).num_splits > 1
    with_prefill = make_batch([(300, 2), (0, 40)], 8, 2, 64, 16, torch.float32)
    assert backend.build_metadata(with_prefill.inputs).num_splits == 1
    decodes = backend.build_metadata(make_batch([(300, 1), (200, 1)], 8, 2, 64, 16, torch.float32).inputs)
    assert decodes.num_splits == 1 and decodes.num_decodes == 2 and decodes.prog_req.numel() == 0
    assert triton_kernels.num_splits_for(4, 300, 16, 64) == 4  # 19 tiles: at least 4 per split
    assert triton_kernels.num_splits_for(4, 2000, 16, 64) == 16
    assert triton_kernels.num_splits_for(8, 2000, 16, 64) == 8  # 8 x 8 programs fill the target
    assert triton_kernels.num_splits_for(64, 10_000, 16, 64) == 1  # enough programs already
    assert triton_kernels.num_splits_for(4, 40, 16, 64) == 1  # too short to split


def test_write_kv_skips_slot_minus_one_and_writes_strided_rows():
    """Slot -1 (padding) writes nothing; k and v may be views into a fused qkv row (row stride > heads x dim)."""
    torch.manual_seed(0)
    num_kv_heads, head_dim, block_size = 2, 64, 16
    dev = torch.device(DEVICE)
    key_cache = torch.randn(4, block_size, num_kv_heads, head_dim, device=dev)
    value_cache = torch.randn(4, block_size, num_kv_heads, head_dim, device=dev)
    before_k, before_v = key_cache.clone(), value_cache.clone()
    qkv = torch.randn(6, 3 * num_kv_heads * head_dim, device=dev)
    k = qkv[:, num_kv_heads * head_dim : 2 * num_kv_heads * head_dim].view(6, num_kv_heads, head_dim)
    v = qkv[:, 2 * num_kv_heads * head_dim :].view(6, num_kv_heads, head_dim)
    slots = torch.tensor([5, -1, 63, 16, -1, 40], dtype=torch.int32, device=dev)
    triton_kernels.write_kv(k, v, key_cache, value_cache, slots)
    written = slots >= 0
    flat_k, flat_v = key_cache.view(-1, num_kv_heads, head_dim), value_cache.view(-1, num_kv_heads, head_dim)
    assert torch.equal(flat_k[slots[written].long()], k[written])
    assert torch.equal(flat_v[slots[written].long()], v[written])
    untouched = torch.ones(flat_k.shape[0], dtype=torch.bool, device=dev)
    untouched[slots[written].long()] = False
    assert torch.equal(flat_k[untouched], before_k.view(-1, num_kv_heads, head_dim)[untouched])
    assert torch.equal(flat_v[untouched], before_v.view(-1, num_kv_heads, head_dim)[untouched])


def test_stale_nan_in_reused_blocks_never_leaks():
    """A block's previous owner left NaN and huge values past the new owner's end: reads are masked to each
    request's own keys, so they cannot reach its output."""
    dtype = torch.float32
    batch = make_batch([(20, 1), (5, 1), (9, 4)], 4, 2, 64, 16, dtype, seed=7, spare_blocks=0)
    # Poison every slot that no request owns.
    owned = set(batch.slots.tolist())
    table = batch.inputs.block_table
    for i, s in enumerate(batch.inputs.seq_lens):
        for pos in range(int(s)):
            owned.add(int(table[i, pos // 16]) * 16 + pos % 16)
    flat_k = batch.key_cache.view(-1, 2, 64)
    flat_v = batch.value_cache.view(-1, 2, 64)
    for slot in range(flat_k.shape[0]):
        if slot not in owned:
            flat_k[slot] = float("nan")
            flat_v[slot] = 1e30 if slot % 2 else float("inf")
    backend = TritonAttentionBackend(4, 2, 64, dtype, DEVICE)
    out = run_backend(backend, batch)
    assert torch.isfinite(out).all()
    check_against_reference(batch, out, 4, 64, dtype)


def test_decode_graph_buffers_pad_the_batch():
    """The persistent buffers a captured decode graph reads: a step of 3 decodes padded to 8 rows gives the same
    outputs for the real rows, zeros for the padding, and no cache write for it (slot -1)."""
    dtype = torch.float32
    seqs = [(33, 1), (0, 1), (70, 1)]
    batch = make_batch(seqs, 8, 2, 64, 16, dtype, seed=8)
    backend = TritonAttentionBackend(8, 2, 64, dtype, DEVICE, target_programs=64)
    buffers = backend.alloc_decode_buffers(max_reqs=16, width=8, block_size=16)
    md = backend.decode_graph_metadata(buffers, num_reqs=8, max_model_len=1024)
    assert md.num_decodes == 8 and md.max_segments == 1024 // backend.decode_config.segment
    backend.fill_decode_buffers(buffers, batch.inputs, num_padded=8)
    q = torch.cat([batch.q, torch.randn(5, 8, 64, device=batch.q.device)])
    k_new = torch.cat([batch.k_new, torch.randn(5, 2, 64, device=batch.q.device)])
    v_new = torch.cat([batch.v_new, torch.randn(5, 2, 64, device=batch.q.device)])
    before_k = batch.key_cache.clone()
    out = backend.forward(q, k_new, v_new, (batch.key_cache, batch.value_cache), md, 64**-0.5)
    check_against_reference(batch, out[:3], 8, 64, dtype)
    assert torch.equal(out[3:], torch.zeros_like(out[3:]))
    changed = (batch.key_cache != before_k).flatten(1).any(1).nonzero().flatten().tolist()
    assert sorted(changed) == sorted({int(s) // 16 for s in batch.slots})
    # A later, smaller step in the same buffers: stale rows past it are padding again.
    small = make_batch([(12, 1)], 8, 2, 64, 16, dtype, seed=9)
    backend.fill_decode_buffers(buffers, small.inputs, num_padded=8)
    out = backend.forward(
        torch.cat([small.q, q[1:]]),
        torch.cat([small.k_new, k_new[1:]]),
        torch.cat([small.v_new, v_new[1:]]),
        (small.key_cache, small.value_cache),
        md,
        64**-0.5,
    )
    check_against_reference(small, out[:1], 8, 64, dtype)
    assert torch.equal(out[1:], torch.zeros_like(out[1:]))


def test_block_m_covers_the_gqa_group():
    assert triton_kernels.block_m_for(1, 1) == 16
    assert triton_kernels.block_m_for(8, 1) == 16
    assert triton_kernels.block_m_for(32, 1) == 32
    assert triton_kernels.block_m_for(4, 100) == 64
    assert triton_kernels.block_m_for(4, 5) == 32  # a decode with 4 draft tokens
    assert triton_kernels.block_m_for(7, 1) == 16  # 2 tokens of 7 heads, 2 rows unused


# ---------------------------------------------------------------------------------------------------- segment decode


def test_segment_slots_and_segments_per_program():
    assert first_segments(np.array([5, 0, 64, 65]), 32).tolist() == [0, 1, 1, 3]  # padding (0) has no segment
    # A large batch walks each context in one program; a small one splits it; never more than the context has.
    assert segments_per_program(256, 8, 8, 528) == 8
    assert segments_per_program(1, 8, 8, 528) == 1
    assert segments_per_program(16, 8, 8, 528) == 1  # 2 each: 16 x 8 heads x 4 programs = 512 < 528
    assert segments_per_program(32, 8, 8, 528) == 2
    assert segments_per_program(64, 32, 8, 528) == 16
    assert segments_per_program(3, 1, 8, 528) == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 2, 8])
def test_segment_decode_matches_reference(group, dtype):
    """Decodes whose contexts end inside a segment, on its last key, one key past it, and span many segments
    (segments of 32 keys in tiles of 16 in the interpreter; the GPU's defaults on a GPU)."""
    seqs = [(0, 1), (31, 1), (63, 1), (64, 1), (200, 1), (7, 1)]
    num_kv_heads = 2
    batch = make_batch(seqs, group * num_kv_heads, num_kv_heads, 64, 16, dtype, seed=group)
    backend = TritonAttentionBackend(group * num_kv_heads, num_kv_heads, 64, dtype, DEVICE)
    md = backend.build_metadata(batch.inputs)
    assert md.num_decodes == len(seqs) and md.prog_req.numel() == 0
    kv = (batch.key_cache, batch.value_cache)
    out = backend.forward(batch.q, batch.k_new, batch.v_new, kv, md, 64**-0.5)
    check_against_reference(batch, out, group * num_kv_heads, 64, dtype)


def test_segment_decode_is_batch_invariant():
    """A decode row's output is the same bits alone, in a larger batch, beside prefill chunks, and through the
    graph buffers (padded rows, a fixed grid of programs looping over the items)."""
    dtype = torch.float32
    seqs = [(150, 1), (3, 1), (70, 1), (40, 9)]
    batch = make_batch(seqs, 8, 2, 64, 16, dtype, seed=11)
    backend = TritonAttentionBackend(8, 2, 64, dtype, DEVICE)
    kv = (batch.key_cache.clone(), batch.value_cache.clone())
    mixed = backend.forward(batch.q, batch.k_new, batch.v_new, kv, backend.build_metadata(batch.inputs), 0.125)
    # Request 0 alone (its K/V for this step are in the cache now: slot -1 writes nothing again).
    inputs = batch.inputs
    alone = AttentionInputs(
        num_decodes=1,
        query_start_loc=np.array([0, 1]),
        seq_lens=inputs.seq_lens[:1],
        block_table=inputs.block_table[:1],
        slot_mapping=np.array([-1]),
        block_size=16,
    )
    out1 = backend.forward(batch.q[:1], batch.k_new[:1], batch.v_new[:1], kv, backend.build_metadata(alone), 0.125)
    assert torch.equal(out1[0], mixed[0])
    # The three decodes through graph buffers padded to 8 rows, and whatever the segments each program runs.
    decodes = AttentionInputs(
        num_decodes=3,
        query_start_loc=np.arange(4),
        seq_lens=inputs.seq_lens[:3],
        block_table=inputs.block_table[:3],
        slot_mapping=np.full(3, -1),
        block_size=16,
    )
    buffers = backend.alloc_decode_buffers(max_reqs=8, width=inputs.block_table.shape[1], block_size=16)
    md = backend.decode_graph_metadata(buffers, num_reqs=8, max_model_len=16 * inputs.block_table.shape[1])
    backend.fill_decode_buffers(buffers, decodes, num_padded=8)
    q = torch.cat([batch.q[:3], torch.randn(5, 8, 64, device=batch.q.device)])
    for per_program in (1, 2, 8):  # 151 keys: 5 segments of 32
        md.segs_per_program = per_program
        out = backend.forward(q, q[:, :2], q[:, :2], kv, md, 0.125)
        assert torch.equal(out[:3], mixed[:3]), per_program
        assert torch.equal(out[3:], torch.zeros_like(out[3:]))
        # The last program of each (request, KV head) merged its segments and left the counts at zero.
        assert not backend._arrived.any()


def test_metadata_parts_start_on_16_bytes():
    """Every view the kernels get is 16-byte aligned whatever the batch, so Triton compiles one variant per
    kernel instead of one per alignment pattern met while serving."""
    backend = TritonAttentionBackend(8, 2, 64, torch.float32, DEVICE)
    for seqs in ([(5, 1)], [(5, 1), (9, 1), (30, 3)], [(0, 7), (3, 1), (1, 1), (2, 1), (40, 5)]):
        md = backend.build_metadata(make_batch(seqs, 8, 2, 64, 16, torch.float32).inputs)
        for name in ("query_start_loc", "seq_lens", "block_table", "slot_mapping", "prog_req", "prog_qstart"):
            assert getattr(md, name).data_ptr() % 16 == 0, name
        assert md.first_seg.data_ptr() % 16 == 0


def test_decode_graph_work_capacity_is_bounded_by_the_pool():
    backend = TritonAttentionBackend(8, 2, 64, torch.float32, DEVICE, decode_config=DecodeConfig(256, 64))
    full = backend.alloc_decode_buffers(max_reqs=64, width=128, block_size=16)  # 2048 keys: 8 segments each
    assert full.max_slots == 64 * 8
    small_pool = backend.alloc_decode_buffers(max_reqs=64, width=128, block_size=16, num_kv_blocks=100)
    assert small_pool.max_slots == 64 + 100 * 16 // 256 + 1


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(8, 2), (4, 4), (6, 1)])
def test_rotary_write_kv_equals_rotary_then_write(dtype, num_heads, num_kv_heads):
    """The fused launch leaves qkv and both caches bit for bit as rotary_ followed by write_kv do (slot -1 writes
    nothing; rows of a stride wider than the row)."""
    from kvserve.kernels.triton_ops import rotary_

    torch.manual_seed(num_heads * 10 + num_kv_heads)
    t, d, nb, bs = 5, 64, 6, 16
    total = num_heads + 2 * num_kv_heads
    wide = torch.randn(t, total * d + 8, device=DEVICE).to(dtype)
    positions = torch.tensor([0, 3, 17, 100, 5], device=DEVICE)
    angles = torch.outer(torch.arange(128, dtype=torch.float32), 1.0 / (10000 ** (torch.arange(0, d, 2) / d)))
    cos, sin = angles.cos().to(dtype).to(DEVICE), angles.sin().to(dtype).to(DEVICE)
    slots = torch.tensor([3, -1, 40, 17, 95], device=DEVICE)
    caches = [torch.randn(nb, bs, num_kv_heads, d, device=DEVICE).to(dtype) for _ in range(2)]
    ref_qkv, ref_k, ref_v = wide.clone(), caches[0].clone(), caches[1].clone()
    qkv_ref = ref_qkv[:, : total * d]
    rotary_(positions, qkv_ref[:, : (num_heads + num_kv_heads) * d], cos, sin, num_heads + num_kv_heads)
    kv = qkv_ref[:, num_heads * d :].view(t, 2 * num_kv_heads, d)
    triton_kernels.write_kv(kv[:, :num_kv_heads], kv[:, num_kv_heads:], ref_k, ref_v, slots)
    out_qkv, out_k, out_v = wide.clone(), caches[0].clone(), caches[1].clone()
    triton_kernels.rotary_write_kv(
        positions, out_qkv[:, : total * d], cos, sin, num_heads, num_kv_heads, out_k, out_v, slots
    )
    assert torch.equal(out_qkv, ref_qkv)
    assert torch.equal(out_k, ref_k) and torch.equal(out_v, ref_v)
    assert not torch.equal(out_k, caches[0])  # something was written


def test_merge_in_chunks_of_segments_matches_reference():
    """Contexts of up to 7 segments merged 2 segments' partials at a time (the GPU merges up to 8 or 16 at once):
    the running rescale across chunks."""
    seqs = [(200, 1), (31, 1), (97, 1)]
    batch = make_batch(seqs, 8, 2, 64, 16, torch.float32, seed=21)
    backend = TritonAttentionBackend(8, 2, 64, torch.float32, DEVICE, decode_config=DecodeConfig(32, 16, merge_segs=2))
    md = backend.build_metadata(batch.inputs)
    out = backend.forward(batch.q, batch.k_new, batch.v_new, (batch.key_cache, batch.value_cache), md, 64**-0.5)
    check_against_reference(batch, out, 8, 64, torch.float32)


def test_larger_eager_batches_keep_the_counts_graphs_hold():
    """The merge's counts grow for a larger eager batch; the tensor the decode graphs captured stays alive (a
    graph replay writes to the pointer it captured) and stays zero."""
    backend = TritonAttentionBackend(8, 2, 64, torch.float32, DEVICE)
    backend.alloc_decode_buffers(max_reqs=2, width=4, block_size=16)
    captured = backend._arrived
    batch = make_batch([(40, 1)] * 5, 8, 2, 64, 16, torch.float32, seed=8)
    backend.forward(
        batch.q,
        batch.k_new,
        batch.v_new,
        (batch.key_cache, batch.value_cache),
        backend.build_metadata(batch.inputs),
        0.1,
    )
    assert backend._arrived is not captured and backend._arrived.numel() >= 5 * 2
    assert any(t is captured for t in backend._arrived_kept)
    assert not captured.any() and not backend._arrived.any()

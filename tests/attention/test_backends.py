"""The CPU paged-attention backends (torch reference and C++ kernels) against plain per-sequence causal
attention, and the backend choice."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from kvserve.attention import cpu_kernels
from kvserve.attention.base import AttentionInputs
from kvserve.attention.cpu_kernels import CpuKernelAttentionBackend, pack_kv_blocks, unpack_kv_blocks
from kvserve.attention.selector import get_attn_backend
from kvserve.attention.torch_ref import TorchRefAttentionBackend
from kvserve.kernels.cpu import load_cpu_kernels
from kvserve.layers.alibi import alibi_slopes
from kvserve.worker.kv_cache import allocate_kv_cache
from tests.kernels.build import require_kernels


def make_backend(
    use_kernel: bool, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, deterministic: bool = True
):
    if use_kernel:
        require_kernels()  # skips without a compiler or with KVSERVE_CPU_KERNELS=0; a broken build fails
        return CpuKernelAttentionBackend(num_heads, num_kv_heads, head_dim, dtype, deterministic=deterministic)
    return TorchRefAttentionBackend(num_heads, num_kv_heads, head_dim, dtype)


def uses_packed_layout(backend, block_size: int) -> bool:
    return isinstance(backend, CpuKernelAttentionBackend) and backend.uses_packed_layout(block_size)


def reference_attention(q, k, v, scale, window=None, slopes=None):
    """q [Q, H, D] for the last Q positions of a sequence whose keys/values are k, v [S, Hkv, D]; with a window,
    each query sees its last `window` keys (itself included); with ALiBi slopes [H], head h's score of a key gets
    slope[h] * (key position - query position)."""
    num_q, num_heads, _ = q.shape
    s, num_kv, _ = k.shape
    group = num_heads // num_kv
    k = k.repeat_interleave(group, dim=1).float()
    v = v.repeat_interleave(group, dim=1).float()
    scores = torch.einsum("qhd,shd->hqs", q.float(), k) * scale
    q_pos = torch.arange(s - num_q, s)[:, None]
    hidden = torch.arange(s)[None, :] > q_pos
    if window is not None:
        hidden |= torch.arange(s)[None, :] <= q_pos - window
    if slopes is not None:
        scores = scores + slopes[:, None, None] * (torch.arange(s)[None, :] - q_pos).float()
    scores = scores.masked_fill(hidden, float("-inf"))
    return torch.einsum("hqs,shd->qhd", scores.softmax(-1), v)


@pytest.mark.parametrize("mode", ["cpp-kernel", "cpp-kernel+sdpa", "torch"])
@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
# head_dim 64/128 with GQA groups 1-8 take the kernel's AVX-512 fast path; 24 and 32 the generic one.
@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_dim", [(4, 4, 32), (6, 2, 64), (4, 1, 24), (8, 2, 128), (2, 2, 64), (8, 1, 64)]
)
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_mixed_batch_matches_reference(mode, dtype, atol, num_heads, num_kv_heads, head_dim, block_size, monkeypatch):
    check_mixed_batch(mode, dtype, atol, num_heads, num_kv_heads, head_dim, block_size, monkeypatch, None)


@pytest.mark.parametrize("mode", ["cpp-kernel", "cpp-kernel+sdpa", "torch"])
@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(6, 2, 64), (4, 1, 24), (8, 2, 128)])
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("window", [5, 16])
def test_sliding_window_matches_reference_and_reads_only_the_window(
    mode, dtype, atol, num_heads, num_kv_heads, head_dim, block_size, window, monkeypatch
):
    """Each query sees its last `window` keys; the blocks wholly before the first query's window of a request hold
    NaN (released blocks may hold anything), which no output may show."""
    check_mixed_batch(mode, dtype, atol, num_heads, num_kv_heads, head_dim, block_size, monkeypatch, window)


@pytest.mark.parametrize("mode", ["cpp-kernel", "cpp-kernel+sdpa", "torch"])
@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
# 6 and 12 heads: HF's rule for head counts that are not a power of two; (12, 3, 64) and (8, 2, 128) the fast
# path (and with bf16 blocks of 16 the pair-packed kernel), (6, 6, 24) the plain loops.
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(12, 3, 64), (6, 6, 24), (8, 2, 128), (8, 8, 64)])
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("window", [None, 5])
def test_alibi_matches_reference(mode, dtype, atol, num_heads, num_kv_heads, head_dim, block_size, window, monkeypatch):
    """ALiBi slopes (HF's) in the decode kernels (standard and pair-packed), SDPA spans and the torch reference;
    with a window too."""
    check_mixed_batch(
        mode, dtype, atol, num_heads, num_kv_heads, head_dim, block_size, monkeypatch, window, alibi_slopes(num_heads)
    )


def check_mixed_batch(
    mode, dtype, atol, num_heads, num_kv_heads, head_dim, block_size, monkeypatch, window, slopes=None
):
    use_kernel = mode != "torch"
    if mode == "cpp-kernel+sdpa":
        # With deterministic=False and the standard layout, (0, 13) and (3, 30) exceed 150 query x context pairs and
        # go to SDPA; (21, 5) and the decodes stay.
        monkeypatch.setattr(cpu_kernels, "_KERNEL_MAX_WORK", 150)
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    # (cached context, new query tokens): decodes first, then prefill chunks with and without context.
    seqs = [(7, 1), (0, 1), (40, 1), (0, 13), (21, 5), (3, 30)]
    num_blocks = sum(math.ceil((c + n) / block_size) for c, n in seqs) + 5
    key_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim).to(dtype)
    value_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim).to(dtype)
    # Blocks handed out in shuffled order, as a real pool does after churn.
    free = list(rng.permutation(num_blocks))
    max_blocks = max(math.ceil((c + n) / block_size) for c, n in seqs)
    block_table = np.zeros((len(seqs), max_blocks), dtype=np.int32)
    full_k, full_v = [], []
    for i, (ctx, n) in enumerate(seqs):
        nb = math.ceil((ctx + n) / block_size)
        block_table[i, :nb] = [free.pop() for _ in range(nb)]
        full_k.append(torch.randn(ctx + n, num_kv_heads, head_dim).to(dtype))
        full_v.append(torch.randn(ctx + n, num_kv_heads, head_dim).to(dtype))
        # The cached context is already in the cache; the new tokens' K/V arrive with the call.
        for pos in range(ctx):
            b, off = block_table[i, pos // block_size], pos % block_size
            key_cache[b, off] = full_k[i][pos]
            value_cache[b, off] = full_v[i][pos]
        if window is not None:  # blocks no query of this step may read: as if released and reused
            for j in range(max(0, ctx - window + 1) // block_size):
                key_cache[block_table[i, j]] = float("nan")
                value_cache[block_table[i, j]] = float("nan")

    q_lens = np.array([n for _, n in seqs])
    qsl = np.concatenate([[0], np.cumsum(q_lens)])
    slots = []
    for i, (ctx, n) in enumerate(seqs):
        for pos in range(ctx, ctx + n):
            slots.append(int(block_table[i, pos // block_size]) * block_size + pos % block_size)
    inputs = AttentionInputs(
        num_decodes=3,
        query_start_loc=qsl,
        seq_lens=np.array([c + n for c, n in seqs]),
        block_table=block_table,
        slot_mapping=np.array(slots, dtype=np.int64),
        block_size=block_size,
    )
    q = torch.randn(int(qsl[-1]), num_heads, head_dim).to(dtype)
    k_new = torch.cat([full_k[i][c:] for i, (c, _) in enumerate(seqs)])
    v_new = torch.cat([full_v[i][c:] for i, (c, _) in enumerate(seqs)])
    backend = make_backend(use_kernel, num_heads, num_kv_heads, head_dim, dtype, mode != "cpp-kernel+sdpa")
    packed = uses_packed_layout(backend, block_size)
    if packed:  # the cached context was written in the standard order above
        key_cache, value_cache = pack_kv_blocks(key_cache, value_cache)
    scale = head_dim**-0.5
    metadata = backend.build_metadata(inputs)
    if use_kernel:  # SDPA spans only where asked, and never with the pair-packed layout
        assert len(metadata.prefills) == (2 if mode == "cpp-kernel+sdpa" and not packed else 0)
    out = backend.forward(q, k_new, v_new, (key_cache, value_cache), metadata, scale, window, slopes)
    assert out.shape == (int(qsl[-1]), num_heads * head_dim)

    for i in range(len(seqs)):
        s, e = int(qsl[i]), int(qsl[i + 1])
        ref = reference_attention(q[s:e], full_k[i], full_v[i], scale, window, slopes)
        got = out[s:e].view(e - s, num_heads, head_dim).float()
        torch.testing.assert_close(got, ref, atol=atol, rtol=atol)
    # The new tokens' K/V were written where the slot mapping says.
    if packed:
        key_cache, value_cache = unpack_kv_blocks(key_cache, value_cache)
    flat_k = key_cache.reshape(-1, num_kv_heads, head_dim)
    flat_v = value_cache.reshape(-1, num_kv_heads, head_dim)
    torch.testing.assert_close(flat_k[torch.tensor(slots)], k_new)
    torch.testing.assert_close(flat_v[torch.tensor(slots)], v_new)


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(9, 3, 64), (8, 2, 128), (4, 4, 64)])
def test_packed_layout_round_trip_and_writes(num_heads, num_kv_heads, head_dim, block_size):
    """pack/unpack are inverses, and the kernel's packed writes land where pack_kv_blocks puts standard ones."""
    torch.manual_seed(0)
    backend = make_backend(True, num_heads, num_kv_heads, head_dim, torch.bfloat16)
    if not backend.uses_packed_layout(block_size):
        pytest.skip("no AVX512-BF16 on this CPU: the packed layout is not used")
    shape = (6, block_size, num_kv_heads, head_dim)
    kc, vc = torch.randn(shape).bfloat16(), torch.randn(shape).bfloat16()
    pk, pv = pack_kv_blocks(kc, vc)
    assert not torch.equal(pk, kc) and not torch.equal(pv, vc)
    uk, uv = unpack_kv_blocks(pk, pv)
    assert torch.equal(uk, kc) and torch.equal(uv, vc)
    slots = torch.randperm(6 * block_size)[:20]
    k = torch.randn(20, num_kv_heads * head_dim).bfloat16()
    v = torch.randn(20, num_kv_heads * head_dim).bfloat16()
    k[3, 5], v[4, 7] = float("nan"), float("inf")
    backend.kernels.write_kv(k, v, kc, vc, slots)
    backend.kernels.write_kv(k, v, pk, pv, slots, True)
    want_k, want_v = pack_kv_blocks(kc, vc)
    assert torch.equal(pk, want_k) and torch.equal(pv, want_v)
    assert torch.isfinite(pk).all() and torch.isfinite(pv).all()


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float8_e4m3fn, torch.float32])
def test_move_kv_slots_moves_whole_tokens_in_every_layer(cache_dtype):
    """A draft tree's accepted path moved into chain order: every layer's K and V of each destination slot become
    its source's, nothing else changes, in the packed layouts (one gather over the pool) as in the standard one."""
    torch.manual_seed(0)
    dtype = torch.float32 if cache_dtype == torch.float32 else torch.bfloat16
    backend = CpuKernelAttentionBackend(9, 3, 64, dtype, kv_cache_dtype=cache_dtype)
    block_size, num_blocks, num_layers = 16, 6, 3
    packed = backend.uses_packed_layout(block_size)
    if cache_dtype != torch.float32 and not packed:
        pytest.skip("this CPU keeps the standard layout for this cache dtype")
    caches = allocate_kv_cache(backend, num_blocks, block_size, num_layers, cache_dtype, "cpu")
    standard = []
    for key_cache, value_cache in caches:
        k = torch.randn(key_cache.shape).to(cache_dtype)
        v = torch.randn(value_cache.shape).to(cache_dtype)
        standard.append((k, v))
        if packed:
            k, v = pack_kv_blocks(k, v)
        key_cache.copy_(k)
        value_cache.copy_(v)
    # Two requests' paths: sources past their destinations, across a block boundary too.
    src = np.array([20, 22, 35, 70, 83], dtype=np.int64)
    dst = np.array([17, 18, 19, 65, 66], dtype=np.int64)
    backend.move_kv_slots(caches, src, dst, block_size)
    for (key_cache, value_cache), (k, v) in zip(caches, standard, strict=True):
        for cache in (k, v):
            flat = cache.view(-1, *cache.shape[2:])
            flat[torch.from_numpy(dst)] = flat[torch.from_numpy(src)].clone()
        got_k, got_v = unpack_kv_blocks(key_cache, value_cache) if packed else (key_cache, value_cache)
        assert torch.equal(got_k.view(torch.uint8), k.view(torch.uint8))
        assert torch.equal(got_v.view(torch.uint8), v.view(torch.uint8))


@pytest.mark.parametrize("use_kernel", [True, False], ids=["cpp-kernel", "torch"])
# bf16 with head_dim 64 and 16-token blocks runs the packed kernel, whose 16-token tiles read past a context's end.
@pytest.mark.parametrize("dtype,hd,bs", [(torch.float32, 16, 4), (torch.bfloat16, 64, 16)])
def test_stale_cache_contents_do_not_leak_into_other_requests(use_kernel, dtype, hd, bs):
    """Blocks are reused without clearing. A previous owner's K/V past a sequence's end, even huge values or a
    NaN it produced, must not change the next owner's output."""
    torch.manual_seed(0)
    hkv = 1
    backend = make_backend(use_kernel, 2, hkv, hd, dtype)
    key_cache = torch.zeros(3, bs, hkv, hd, dtype=dtype)
    value_cache = torch.zeros(3, bs, hkv, hd, dtype=dtype)
    packed = uses_packed_layout(backend, bs)

    def decode_inputs(seq_lens, table, slots):
        return AttentionInputs(
            num_decodes=len(seq_lens),
            query_start_loc=np.arange(len(seq_lens) + 1),
            seq_lens=np.array(seq_lens),
            block_table=np.array(table, dtype=np.int32),
            slot_mapping=np.array(slots, dtype=np.int64),
            block_size=bs,
        )

    # A broken request writes NaN and huge values into every slot of blocks 1 and 2.
    slots = np.arange(bs, 3 * bs)
    junk_k = torch.full((len(slots), hkv, hd), float("nan"), dtype=dtype)
    junk_k[::2] = 1e30
    junk_v = torch.full((len(slots), hkv, hd), float("inf"), dtype=dtype)
    meta = backend.build_metadata(
        AttentionInputs(
            0,
            np.array([0, len(slots)]),
            np.array([len(slots)]),
            np.array([[1, 2]], dtype=np.int32),
            slots,
            bs,
        )
    )
    backend.forward(torch.randn(len(slots), 2, hd, dtype=dtype), junk_k, junk_v, (key_cache, value_cache), meta, 1.0)
    assert torch.isfinite(key_cache).all() and torch.isfinite(value_cache).all()

    # Two later requests reuse the blocks: one of length 2 in block 1, one of length 6 over blocks 0 and 2
    # (padded in the batch to 2 blocks, so the first one's padding also reads the junk of block 2... via 0).
    ctx = {1: torch.randn(2, hkv, hd, dtype=dtype), 0: torch.randn(6, hkv, hd, dtype=dtype)}
    vals = {1: torch.randn(2, hkv, hd, dtype=dtype), 0: torch.randn(6, hkv, hd, dtype=dtype)}
    if packed:  # edit in the standard order
        key_cache, value_cache = unpack_kv_blocks(key_cache, value_cache)
    key_cache[1, 0] = ctx[1][0]
    value_cache[1, 0] = vals[1][0]
    for pos in range(5):
        blk = [0, 2][pos // bs] if bs < 6 else 0 if pos < bs else 2
        key_cache[blk, pos % bs] = ctx[0][pos]
        value_cache[blk, pos % bs] = vals[0][pos]
    if packed:
        key_cache, value_cache = pack_kv_blocks(key_cache, value_cache)
    q = torch.randn(2, 2, hd, dtype=dtype)
    k_new = torch.stack([ctx[1][1], ctx[0][5]])
    v_new = torch.stack([vals[1][1], vals[0][5]])
    last = [1 * bs + 1, (2 if bs < 6 else 0) * bs + (5 % bs)]
    meta = backend.build_metadata(decode_inputs([2, 6], [[1, 0], [0, 2]], last))
    out = backend.forward(q, k_new, v_new, (key_cache, value_cache), meta, hd**-0.5)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for i, seq in enumerate([1, 0]):
        ref = reference_attention(q[i : i + 1], ctx[seq], vals[seq], hd**-0.5)
        torch.testing.assert_close(out[i].view(1, 2, hd).float(), ref, atol=tol, rtol=tol)


def test_kernel_long_context_and_many_sequences_match_torch():
    """Long contexts (many blocks, prefetching across them) and more sequences than threads, in bf16."""
    torch.manual_seed(0)
    rng = np.random.default_rng(1)
    num_heads, num_kv, hd, bs = 9, 3, 64, 16
    seq_lens = rng.integers(1, 700, 37)
    num_blocks = int(sum(-(-s // bs) for s in seq_lens)) + 3
    perm = rng.permutation(num_blocks)
    table = np.zeros((len(seq_lens), -(-int(seq_lens.max()) // bs)), dtype=np.int32)
    p = 0
    for i, s in enumerate(seq_lens):
        n = -(-int(s) // bs)
        table[i, :n] = perm[p : p + n]
        p += n
    kc = torch.randn(num_blocks, bs, num_kv, hd).to(torch.bfloat16)
    vc = torch.randn(num_blocks, bs, num_kv, hd).to(torch.bfloat16)
    q = torch.randn(len(seq_lens), num_heads, hd).to(torch.bfloat16)
    inputs = AttentionInputs(
        len(seq_lens), np.arange(len(seq_lens) + 1), seq_lens.astype(np.int64), table, np.zeros(0, dtype=np.int64), bs
    )
    kernel = make_backend(True, num_heads, num_kv, hd, torch.bfloat16)
    md = kernel.build_metadata(inputs)
    got = kernel.kernels.paged_attention_decode(q, kc, vc, md.token_block_table, md.token_seq_lens, hd**-0.5)
    reference = TorchRefAttentionBackend(num_heads, num_kv, hd, torch.bfloat16)
    want = reference._decode(q, kc, vc, reference.build_metadata(inputs), hd**-0.5)
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
    if kernel.uses_packed_layout(bs):
        pk, pv = pack_kv_blocks(kc, vc)
        got = kernel.kernels.paged_attention_packed(q, pk, pv, md.token_block_table, md.token_seq_lens, hd**-0.5)
        torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("deterministic", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(6, 2, 64), (4, 1, 24), (8, 2, 128)])
def test_kernel_backend_is_batch_invariant(deterministic, dtype, num_heads, num_kv_heads, head_dim, monkeypatch):
    """One request's 300-token prompt in one chunk among other requests' decodes and chunks, in chunks of 7 tokens
    alone, or after its first 160 tokens' K/V were written by an earlier step (as on a prefix hit): each token's
    output is bitwise the same. With deterministic=False and the standard layout, chunks of over 1,000 query-key pairs
    (here) go to SDPA, and the outputs differ."""
    monkeypatch.setattr(cpu_kernels, "_KERNEL_MAX_WORK", 1000)
    backend = make_backend(True, num_heads, num_kv_heads, head_dim, dtype, deterministic)
    invariant = backend.batch_invariant(16)
    assert invariant == (deterministic or backend.uses_packed_layout(16))
    torch.manual_seed(0)
    bs, n, others = 16, 300, [(40, 1), (0, 1), (100, 30)]  # (cached, new tokens) of the other requests
    blocks_per_seq = math.ceil((n + 200) / bs)
    num_blocks = blocks_per_seq * (1 + len(others))
    seq_qkv = [(torch.randn(n, num_heads, head_dim), torch.randn(n, num_kv_heads, head_dim),
                torch.randn(n, num_kv_heads, head_dim))]  # fmt: skip
    seq_qkv += [tuple(t[: c + m] for t in seq_qkv[0]) for c, m in others]
    seq_qkv = [tuple(t.to(dtype) for t in x) for x in seq_qkv]
    scale = head_dim**-0.5
    # Every request's blocks, in reverse order of the pool.
    table = np.arange(num_blocks, dtype=np.int32)[::-1].reshape(1 + len(others), blocks_per_seq).copy()

    def run(chunks: list[tuple[int, int]], with_others: bool) -> torch.Tensor:
        """The prompt's tokens [start, end) per step from a fresh cache; returns each token's output."""
        cache = tuple(torch.zeros(num_blocks, bs, num_kv_heads, head_dim, dtype=dtype) for _ in range(2))
        out = torch.empty(n, num_heads * head_dim, dtype=dtype)
        for start, end in chunks:
            seqs = [(start, end - start, 0)] + ([(c, m, i + 1) for i, (c, m) in enumerate(others)] * with_others)
            seqs.sort(key=lambda x: x[1] > 1)  # decodes first, as the runner lays a step out
            parts, slots, qsl = [], [], [0]
            for ctx, m, row in seqs:
                parts.append([t[ctx : ctx + m] for t in seq_qkv[row]])
                slots += [int(table[row, p // bs]) * bs + p % bs for p in range(ctx, ctx + m)]
                qsl.append(qsl[-1] + m)
            inputs = AttentionInputs(
                num_decodes=sum(m == 1 for _, m, _ in seqs),
                query_start_loc=np.array(qsl),
                seq_lens=np.array([c + m for c, m, _ in seqs]),
                block_table=table[[row for _, _, row in seqs]],
                slot_mapping=np.array(slots, dtype=np.int64),
                block_size=bs,
            )
            q, k, v = (torch.cat([p[i] for p in parts]) for i in range(3))
            res = backend.forward(q, k, v, cache, backend.build_metadata(inputs), scale)
            first = qsl[[row for _, _, row in seqs].index(0)]
            out[start:end] = res[first : first + end - start]
        return out

    whole = run([(0, n)], with_others=True)
    ref = reference_attention(*seq_qkv[0], scale).reshape(n, -1)
    torch.testing.assert_close(whole.float(), ref, atol=3e-2 if dtype == torch.bfloat16 else 1e-5, rtol=3e-2)
    in_sevens = run([(s, min(s + 7, n)) for s in range(0, n, 7)], with_others=False)
    after_a_hit = run([(0, 160), (160, n)], with_others=False)
    if invariant:
        assert torch.equal(in_sevens, whole) and torch.equal(after_a_hit, whole)
    else:
        assert not torch.equal(in_sevens, whole)


def test_selector_picks_the_kernel_backend_when_the_kernels_load(monkeypatch):
    from kvserve.attention import selector

    backend = get_attn_backend(8, 2, 64, torch.bfloat16)
    assert isinstance(
        backend, CpuKernelAttentionBackend if load_cpu_kernels() is not None else TorchRefAttentionBackend
    )
    monkeypatch.setattr(selector, "load_cpu_kernels", lambda: None)  # no build, or KVSERVE_CPU_KERNELS=0
    backend = get_attn_backend(8, 2, 64, torch.bfloat16)
    assert isinstance(backend, TorchRefAttentionBackend)
    assert backend.describe(16) == "pure torch (no C++ kernels)"


@pytest.mark.parametrize("use_kernel", [True, False], ids=["cpp-kernel", "torch"])
def test_kv_cache_shape_is_the_standard_block_shape(use_kernel):
    """Both backends keep [num_blocks, block_size, num_kv_heads, head_dim] (the packed layout reorders inside)."""
    backend = make_backend(use_kernel, 9, 3, 64, torch.bfloat16)
    assert backend.kv_cache_shape(7, 16) == (7, 16, 3, 64)

"""Tree attention inside the kernels: the C++ CPU kernels (standard layout, pair-packed bf16 and fp8) and the Triton
kernels (interpreter on the CPU) against the torch reference backend (kvserve/attention/torch_ref.py, itself
checked token by token in test_tree_attention.py), on random draft trees mixed with decodes and prefill chunks.

Run the file with KVSERVE_CPU_ISA=avx2 and =generic too: the C++ kernels are built per ISA level (the Triton
tests run once, in the native run)."""

from __future__ import annotations

import math
import os

import numpy as np
import pytest
import torch

from kvserve.attention import cpu_kernels
from kvserve.attention.base import AttentionInputs
from kvserve.attention.common import tree_hidden_keys
from kvserve.attention.cpu_kernels import CpuKernelAttentionBackend, pack_kv_blocks
from kvserve.attention.kv_dtype import quantize_kv
from kvserve.attention.torch_ref import TorchRefAttentionBackend
from tests.kernels.build import require_kernels


def random_forest_mask(n: int, rng: np.random.Generator, roots: bool) -> np.ndarray:
    """[n, n] bool ancestor mask (row = query, col = key, itself included) of n nodes in topological order: node 0 is
    the root and every other node's parent is a random earlier node, as tree.py's DraftTree makes them; with
    `roots`, some nodes start new trees (no parent), so that a row may hide whole key blocks before any visible key
    (the kernels' all-hidden-block path)."""
    mask = np.zeros((n, n), dtype=bool)
    for j in range(n):
        parent = -1 if j == 0 or (roots and rng.random() < 0.15) else int(rng.integers(max(0, j - 20), j))
        if parent >= 0:
            mask[j] = mask[parent]
        mask[j, j] = True
    return mask


# (cached context, query tokens, tree?): decodes first (a one-node tree among them), then trees crossing block
# boundaries with and without context, a plain chunk between them, and a 64-token tree (the most the kernels take).
SEQS = [(9, 1, False), (30, 1, False), (21, 1, True), (13, 12, True), (5, 20, False), (0, 37, True), (50, 64, True)]


def make_step(seqs, num_kv_heads, head_dim, block_size, dtype, cache_dtype, seed, roots):
    """A step's inputs, the standard-layout caches with the context written (the cache's dtype), the new K/V and
    the masks. Blocks are handed out shuffled; unused cache slots hold junk."""
    rng = np.random.default_rng(seed)
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(math.ceil((c + n) / block_size) for c, n, _ in seqs) + 3
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = quantize_kv(torch.randn(shape, generator=gen).to(dtype), cache_dtype)
    value_cache = quantize_kv(torch.randn(shape, generator=gen).to(dtype), cache_dtype)
    free = list(rng.permutation(num_blocks))
    max_blocks = max(math.ceil((c + n) / block_size) for c, n, _ in seqs)
    block_table = np.zeros((len(seqs), max_blocks), dtype=np.int32)
    new_k, new_v, slots, masks = [], [], [], {}
    for i, (ctx, n, tree) in enumerate(seqs):
        nb = math.ceil((ctx + n) / block_size)
        block_table[i, :nb] = [free.pop() for _ in range(nb)]
        k = torch.randn(ctx + n, num_kv_heads, head_dim, generator=gen).to(dtype)
        v = torch.randn(ctx + n, num_kv_heads, head_dim, generator=gen).to(dtype)
        for pos in range(ctx + n):
            b, off = int(block_table[i, pos // block_size]), pos % block_size
            if pos < ctx:
                key_cache[b, off] = quantize_kv(k[pos], cache_dtype)
                value_cache[b, off] = quantize_kv(v[pos], cache_dtype)
            else:
                slots.append(b * block_size + off)
        new_k.append(k[ctx:])
        new_v.append(v[ctx:])
        if tree:
            masks[i] = random_forest_mask(n, rng, roots)
    q_lens = np.array([n for _, n, _ in seqs])
    inputs = AttentionInputs(
        num_decodes=int(np.count_nonzero(q_lens == 1)),
        query_start_loc=np.concatenate([[0], np.cumsum(q_lens)]),
        seq_lens=np.array([c + n for c, n, _ in seqs]),
        block_table=block_table,
        slot_mapping=np.array(slots, dtype=np.int64),
        block_size=block_size,
        query_masks=masks,
    )
    return inputs, key_cache, value_cache, torch.cat(new_k), torch.cat(new_v)


def reference_output(inputs, key_cache, value_cache, k, v, q, num_heads, dtype, cache_dtype, scale):
    ref = TorchRefAttentionBackend(num_heads, key_cache.shape[2], key_cache.shape[3], dtype, cache_dtype)
    caches = (key_cache.clone(), value_cache.clone())
    return ref.forward(q, k, v, caches, ref.build_metadata(inputs), scale).float()


TOL = {torch.float32: 1e-5, torch.bfloat16: 3e-2}


@pytest.mark.parametrize(
    "dtype,cache_dtype",
    [
        (torch.float32, None),
        (torch.bfloat16, None),
        (torch.bfloat16, torch.float8_e4m3fn),
        (torch.float32, torch.float8_e5m2),
    ],
    ids=["fp32", "bf16", "bf16-fp8e4m3", "fp32-fp8e5m2"],
)
# head_dim 64/128 with these groups: the fast path (and with bf16 blocks of 16/32 the pair-packed kernel); 32 with
# group 1 and 24 with group 3: the plain loops.
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(4, 2, 64), (8, 2, 128), (3, 3, 32), (6, 2, 24)])
@pytest.mark.parametrize("block_size", [16, 32, 8])
@pytest.mark.parametrize("roots", [False, True], ids=["tree", "forest"])
@pytest.mark.parametrize("sdpa", [False, True], ids=["kernel", "kernel+sdpa"])
def test_cpu_kernel_tree_attention_matches_reference(
    dtype, cache_dtype, num_heads, num_kv_heads, head_dim, block_size, roots, sdpa, monkeypatch
):
    """Every row of a step with random trees equals the torch reference's; with deterministic=False (the standard
    layout), the big chunks, trees among them, go through SDPA with the mask instead."""
    require_kernels()
    if sdpa:
        monkeypatch.setattr(cpu_kernels, "_KERNEL_MAX_WORK", 400)
    torch.manual_seed(0)
    cache_dtype = cache_dtype or dtype
    inputs, key_cache, value_cache, k, v = make_step(
        SEQS, num_kv_heads, head_dim, block_size, dtype, cache_dtype, seed=block_size + head_dim, roots=roots
    )
    q = torch.randn(int(inputs.query_start_loc[-1]), num_heads, head_dim).to(dtype)
    scale = head_dim**-0.5
    ref = reference_output(inputs, key_cache, value_cache, k, v, q, num_heads, dtype, cache_dtype, scale)

    backend = CpuKernelAttentionBackend(
        num_heads, num_kv_heads, head_dim, dtype, deterministic=not sdpa, kv_cache_dtype=cache_dtype
    )
    packed = backend.uses_packed_layout(block_size)
    metadata = backend.build_metadata(inputs)
    assert metadata.token_hidden_keys is not None
    if sdpa and not packed:  # the trees of 37 and 64 tokens and the 20-token chunk exceed 400 pairs
        assert [span.query_len for span in metadata.prefills] == [20, 37, 64]
    else:
        assert metadata.prefills == []
    caches = pack_kv_blocks(key_cache, value_cache) if packed else (key_cache, value_cache)
    out = backend.forward(q, k, v, caches, metadata, scale).float()
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, ref, atol=TOL[dtype], rtol=TOL[dtype])


def test_packed_layouts_are_covered_here():
    """The pair-packed kernels (bf16, and fp8 where the CPU has VBMI) take tree masks on this machine, or this file
    tests only the standard layout: say which (a skip, not a silent pass)."""
    require_kernels()
    bf16 = CpuKernelAttentionBackend(4, 2, 64, torch.bfloat16)
    fp8 = CpuKernelAttentionBackend(4, 2, 64, torch.bfloat16, kv_cache_dtype=torch.float8_e4m3fn)
    if not bf16.uses_packed_layout(16):
        pytest.skip("no AVX512-BF16 kernels at this ISA level: the pair-packed layouts are not run here")
    assert bf16.kv_layout(16) == "bf16-pair-packed"
    if fp8.uses_packed_layout(16):
        assert fp8.kv_layout(16) == "fp8-pair-packed"


def test_fused_layer_args_carry_the_tree_bits():
    require_kernels()
    inputs, *_ = make_step(SEQS, 2, 64, 16, torch.float32, torch.float32, seed=0, roots=False)
    backend = CpuKernelAttentionBackend(4, 2, 64, torch.float32)
    args = backend.fused_layer_args(backend.build_metadata(inputs))
    assert args is not None and torch.equal(args[4], torch.from_numpy(tree_hidden_keys(inputs)))


def test_tree_hidden_keys_bits():
    """Bit b of a token's word hides the key b positions before its own; rows of requests without a mask are 0."""
    mask = np.array([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], dtype=bool)  # 0 -> 1, 0 -> 2 -> 3
    inputs = AttentionInputs(
        num_decodes=1,
        query_start_loc=np.array([0, 1, 5]),
        seq_lens=np.array([3, 10]),
        block_table=np.zeros((2, 1), dtype=np.int32),
        slot_mapping=np.zeros(5, dtype=np.int64),
        block_size=16,
        query_masks={1: mask},
    )
    # token 2 (query 1) sees 0, 1; token 3 (query 2) hides query 1 (1 back); token 4 (query 3) hides query 1 (2 back).
    assert tree_hidden_keys(inputs).tolist() == [0, 0, 0, 0b10, 0b100]
    inputs.query_masks = None
    assert tree_hidden_keys(inputs) is None


def test_tree_masks_out_of_contract_are_refused():
    def inputs_with(mask):
        n = mask.shape[0]
        return AttentionInputs(
            num_decodes=0,
            query_start_loc=np.array([0, n]),
            seq_lens=np.array([n]),
            block_table=np.zeros((1, math.ceil(n / 16)), dtype=np.int32),
            slot_mapping=np.arange(n, dtype=np.int64),
            block_size=16,
            query_masks={0: mask},
        )

    with pytest.raises(ValueError, match="at most 64"):
        tree_hidden_keys(inputs_with(np.tril(np.ones((65, 65), dtype=bool))))
    with pytest.raises(ValueError, match="topological order"):
        tree_hidden_keys(inputs_with(np.ones((3, 3), dtype=bool)))


@pytest.mark.skipif(bool(os.environ.get("KVSERVE_CPU_ISA")), reason="forced ISA level: Triton tests run once")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("roots", [False, True], ids=["tree", "forest"])
@pytest.mark.parametrize("block_size", [16, 8])
def test_triton_tree_attention_matches_reference(dtype, roots, block_size):
    """The Triton kernels (the interpreter here; tests/conftest.py sets TRITON_INTERPRET=1) on the same steps."""
    pytest.importorskip("triton")
    from kvserve.attention.triton_backend import TritonAttentionBackend

    device = "cuda" if torch.cuda.is_available() else "cpu"
    num_heads, num_kv_heads, head_dim = 4, 2, 32
    seqs = [(9, 1, False), (21, 1, True), (13, 12, True), (5, 20, False), (0, 37, True)]
    inputs, key_cache, value_cache, k, v = make_step(
        seqs, num_kv_heads, head_dim, block_size, dtype, dtype, seed=3, roots=roots
    )
    q = torch.randn(int(inputs.query_start_loc[-1]), num_heads, head_dim).to(dtype)
    scale = head_dim**-0.5
    ref = reference_output(inputs, key_cache, value_cache, k, v, q, num_heads, dtype, dtype, scale)
    backend = TritonAttentionBackend(num_heads, num_kv_heads, head_dim, dtype, device, tile_n=16)
    metadata = backend.build_metadata(inputs)
    assert metadata.hidden_keys is not None
    caches = (key_cache.to(device), value_cache.to(device))
    out = backend.forward(q.to(device), k.to(device), v.to(device), caches, metadata, scale).float().cpu()
    tol = {torch.float32: 1e-4, torch.bfloat16: 2e-2}[dtype]
    torch.testing.assert_close(out, ref, atol=tol, rtol=tol)

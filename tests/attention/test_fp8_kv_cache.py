"""fp8 KV caches (kv_cache_dtype fp8_e4m3 / fp8_e5m2) in the CPU backends: the C++ write kernel stores exactly what
kv_dtype.quantize_kv (torch's rounding, saturated) stores, the C++ kernels' widening loads are exact for every
code, and both backends' attention equals exact attention over the dequantized K/V."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from kvserve.attention import cpu_kernels
from kvserve.attention.base import AttentionInputs
from kvserve.attention.cpu_kernels import CpuKernelAttentionBackend, pack_kv_blocks, unpack_kv_blocks
from kvserve.attention.kv_dtype import quantize_kv
from kvserve.attention.torch_ref import TorchRefAttentionBackend
from tests.attention.test_backends import reference_attention
from tests.kernels.build import require_kernels

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]


@pytest.mark.parametrize("cache_dtype", FP8, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_stores_quantize_kv_exactly(cache_dtype, dtype):
    kernels = require_kernels()
    torch.manual_seed(0)
    n, b, h, d = 8, 16, 2, 64
    kc, vc = torch.zeros(n, b, h, d, dtype=cache_dtype), torch.zeros(n, b, h, d, dtype=cache_dtype)
    t = 40
    # Normals, subnormals, values past the format's range, ties, and non-finite values.
    k = (torch.randn(t, h * d) * torch.logspace(-4, 5, t)[:, None]).to(dtype)
    v = torch.randn(t, h * d).to(dtype)
    k[0, :4] = torch.tensor([float("nan"), float("inf"), -float("inf"), 1e30])
    v[1, :3] = torch.tensor([0.0625 + 0.00390625, -464.0, 2**-10])
    slots = torch.randperm(n * b)[:t]
    kernels.write_kv(k, v, kc, vc, slots, False)
    flat_k, flat_v = kc.view(-1, h * d)[slots], vc.view(-1, h * d)[slots]
    assert torch.equal(flat_k.view(torch.uint8), quantize_kv(k, cache_dtype).view(torch.uint8))
    assert torch.equal(flat_v.view(torch.uint8), quantize_kv(v, cache_dtype).view(torch.uint8))
    assert torch.isfinite(kc.float()).all()


@pytest.mark.parametrize("cache_dtype", FP8, ids=["e4m3", "e5m2"])
def test_write_kv_fp32_rounds_every_exponent_and_tie_as_torch(cache_dtype):
    """The fp32 rows' vector conversion (simd.h, vfp8_codes) against torch on every sign, exponent and top 7
    mantissa bits (the high 16 bits of the float), each with low bits 0 (exact ties among them), 1, 0x7FFF and 0xFFFF:
    normals, subnormals, the boundary between them, saturation, -0, inf and NaN; rows of 200 values, so each row's
    scalar tail (to_fp8) converts some as well."""
    kernels = require_kernels()
    high = torch.arange(1 << 16, dtype=torch.int64) << 16
    low = torch.tensor([0, 1, 0x7FFF, 0xFFFF], dtype=torch.int64)
    bits = (high[:, None] | low[None, :]).flatten()
    x = (bits - ((bits >> 31) << 32)).to(torch.int32).view(torch.float32)  # as signed 32-bit patterns
    width = 200
    rows = x.numel() // width
    k = x[: rows * width].view(rows, width)
    v = k.flip(0).contiguous()
    kc = torch.zeros(rows, 1, 1, width, dtype=cache_dtype)
    vc = torch.zeros_like(kc)
    slots = torch.randperm(rows)
    kernels.write_kv(k, v, kc, vc, slots, False)
    for cache, src in ((kc, k), (vc, v)):
        got = cache.view(rows, width)[slots].view(torch.uint8)
        assert torch.equal(got, quantize_kv(src, cache_dtype).view(torch.uint8))


@pytest.mark.parametrize("cache_dtype", FP8, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("head_dim", [64, 24])  # the fast path's vector loads, the generic path's row loads
def test_kernel_reads_every_fp8_code_exactly(cache_dtype, head_dim):
    """Rows that see one key output that key's value row: every finite code (subnormals included) comes back as
    torch widens it."""
    kernels = require_kernels()
    codes = torch.arange(256, dtype=torch.uint8).view(cache_dtype)
    codes = torch.where(torch.isnan(codes.float()), torch.zeros_like(codes.float()), codes.float()).to(cache_dtype)
    codes = codes.repeat(math.ceil(head_dim * 16 / 256))[: head_dim * 16].view(16, head_dim)
    num_rows, bs = 16, 4
    vc = torch.zeros(num_rows, bs, 1, head_dim, dtype=cache_dtype)
    vc[:, 0, 0] = codes
    kc = torch.zeros_like(vc)
    q = torch.randn(num_rows, 2, head_dim)
    table = torch.arange(num_rows, dtype=torch.int32)[:, None]
    out = kernels.paged_attention_decode(q, kc, vc, table, torch.ones(num_rows, dtype=torch.int64), 0.125, 0)
    assert torch.equal(out, codes.float()[:, None, :].expand(num_rows, 2, head_dim))


def _backend(kind: str, num_heads, num_kv_heads, head_dim, dtype, cache_dtype):
    if kind == "torch":
        return TorchRefAttentionBackend(num_heads, num_kv_heads, head_dim, dtype, cache_dtype)
    require_kernels()
    return CpuKernelAttentionBackend(
        num_heads, num_kv_heads, head_dim, dtype, deterministic=kind == "cpp-kernel", kv_cache_dtype=cache_dtype
    )


@pytest.mark.parametrize("kind", ["cpp-kernel", "cpp-kernel+sdpa", "torch"])
@pytest.mark.parametrize("cache_dtype", FP8, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(6, 2, 64), (9, 3, 64), (4, 1, 24), (8, 2, 128)])
@pytest.mark.parametrize("block_size,window", [(16, None), (4, None), (4, 5)])
def test_fp8_cache_attention_matches_dequantized_reference(
    kind, cache_dtype, dtype, atol, num_heads, num_kv_heads, head_dim, block_size, window, monkeypatch
):
    """A mixed step (decodes, then prefill chunks with and without cached context) over an fp8 cache: each query's
    output is exact attention over its context's K/V as the cache holds them (quantize_kv, widened), and the new
    tokens' K/V land in their slots as quantize_kv stores them (the two backends' caches agree byte for byte)."""
    if kind == "cpp-kernel+sdpa":  # big chunks through SDPA (deterministic=False), as in test_backends
        monkeypatch.setattr(cpu_kernels, "_KERNEL_MAX_WORK", 150)
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    seqs = [(7, 1), (0, 1), (40, 1), (0, 13), (21, 5), (3, 30)]  # (cached context, new query tokens)
    num_blocks = sum(math.ceil((c + n) / block_size) for c, n in seqs) + 5
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache, value_cache = torch.zeros(shape, dtype=cache_dtype), torch.zeros(shape, dtype=cache_dtype)
    free = list(rng.permutation(num_blocks))
    max_blocks = max(math.ceil((c + n) / block_size) for c, n in seqs)
    block_table = np.zeros((len(seqs), max_blocks), dtype=np.int32)
    full_k, full_v, slots = [], [], []
    for i, (ctx, n) in enumerate(seqs):
        nb = math.ceil((ctx + n) / block_size)
        block_table[i, :nb] = [free.pop() for _ in range(nb)]
        # Keys of a realistic spread (up to ~8), so that e4m3's subnormals and both formats' rounding show.
        full_k.append((torch.randn(ctx + n, num_kv_heads, head_dim) * 3).to(dtype))
        full_v.append(torch.randn(ctx + n, num_kv_heads, head_dim).to(dtype))
        for pos in range(ctx + n):
            slot = int(block_table[i, pos // block_size]) * block_size + pos % block_size
            if pos < ctx:  # the cached context, stored as the cache stores it
                key_cache.view(-1, num_kv_heads, head_dim)[slot] = quantize_kv(full_k[i][pos], cache_dtype)
                value_cache.view(-1, num_kv_heads, head_dim)[slot] = quantize_kv(full_v[i][pos], cache_dtype)
            else:
                slots.append(slot)
    qsl = np.concatenate([[0], np.cumsum([n for _, n in seqs])])
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
    backend = _backend(kind, num_heads, num_kv_heads, head_dim, dtype, cache_dtype)
    metadata = backend.build_metadata(inputs)
    packed = kind != "torch" and metadata.packed
    if kind != "torch":  # the packed layout: a bf16 model, 16-token blocks, 32-dim chunks, a CPU with VBMI
        assert packed == backend.uses_packed_layout(block_size)
        assert len(metadata.prefills) == (2 if kind == "cpp-kernel+sdpa" and not packed else 0)
    if packed:  # the cached context was written in the standard order above
        key_cache, value_cache = pack_kv_blocks(key_cache, value_cache)
    scale = head_dim**-0.5
    out = backend.forward(q, k_new, v_new, (key_cache, value_cache), metadata, scale, window)
    if packed:
        key_cache, value_cache = unpack_kv_blocks(key_cache, value_cache)

    for i in range(len(seqs)):
        s, e = int(qsl[i]), int(qsl[i + 1])
        keys = quantize_kv(full_k[i], cache_dtype).float()
        values = quantize_kv(full_v[i], cache_dtype).float()
        ref = reference_attention(q[s:e], keys, values, scale, window)
        got = out[s:e].view(e - s, num_heads, head_dim).float()
        torch.testing.assert_close(got, ref, atol=atol, rtol=atol)
    slot_ids = torch.tensor(slots)
    flat_k = key_cache.view(-1, num_kv_heads, head_dim)[slot_ids]
    flat_v = value_cache.view(-1, num_kv_heads, head_dim)[slot_ids]
    assert torch.equal(flat_k.view(torch.uint8), quantize_kv(k_new, cache_dtype).view(torch.uint8))
    assert torch.equal(flat_v.view(torch.uint8), quantize_kv(v_new, cache_dtype).view(torch.uint8))


def _packed_fp8_backend(cache_dtype, num_heads=9, num_kv_heads=3, head_dim=64, block_size=16):
    require_kernels()
    backend = CpuKernelAttentionBackend(num_heads, num_kv_heads, head_dim, torch.bfloat16, kv_cache_dtype=cache_dtype)
    if not backend.uses_packed_layout(block_size):
        pytest.skip("no AVX512-BF16 + AVX512-VBMI on this CPU: fp8 caches keep the standard layout")
    return backend


def test_fp8_cache_layout_choice():
    """fp8 caches are pair-packed only with a bf16 model, whole 16-token tiles and 32-dim chunks; fp32 models keep
    the standard layout (the kernel's q is bf16)."""
    require_kernels()
    fp32 = CpuKernelAttentionBackend(9, 3, 64, torch.float32, kv_cache_dtype=torch.float8_e4m3fn)
    assert not fp32.uses_packed_layout(16) and fp32.kv_layout(16) == "standard"
    narrow = CpuKernelAttentionBackend(4, 1, 24, torch.bfloat16, kv_cache_dtype=torch.float8_e4m3fn)
    assert not narrow.uses_packed_layout(16)
    backend = _packed_fp8_backend(torch.float8_e4m3fn)
    assert backend.kv_layout(16) == "fp8-pair-packed" and not backend.uses_packed_layout(4)
    assert backend.kv_cache_dtype == torch.float8_e4m3fn
    assert "pair-packed float8_e4m3fn KV" in backend.describe(16)


@pytest.mark.parametrize("cache_dtype", FP8, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(9, 3, 64), (8, 2, 128)])
def test_packed_fp8_round_trip_and_writes(cache_dtype, block_size, num_heads, num_kv_heads, head_dim):
    """pack/unpack are inverses on fp8 blocks, and the kernel's packed writes land where pack_kv_blocks puts the
    standard writes' bytes (the same rounding, saturation and NaN rule)."""
    backend = _packed_fp8_backend(cache_dtype, num_heads, num_kv_heads, head_dim, block_size)
    torch.manual_seed(0)
    shape = (6, block_size, num_kv_heads, head_dim)
    kc = torch.randint(0, 256, shape, dtype=torch.uint8).view(cache_dtype)
    vc = torch.randint(0, 256, shape, dtype=torch.uint8).view(cache_dtype)
    pk, pv = pack_kv_blocks(kc, vc)
    assert not torch.equal(pk.view(torch.uint8), kc.view(torch.uint8))
    uk, uv = unpack_kv_blocks(pk, pv)
    assert torch.equal(uk.view(torch.uint8), kc.view(torch.uint8))
    assert torch.equal(uv.view(torch.uint8), vc.view(torch.uint8))
    slots = torch.randperm(6 * block_size)[:40]
    k = (torch.randn(40, num_kv_heads * head_dim) * torch.logspace(-4, 5, 40)[:, None]).bfloat16()
    v = torch.randn(40, num_kv_heads * head_dim).bfloat16()
    k[3, 5], v[4, 7], v[5, 1] = float("nan"), float("inf"), -1e30
    backend.kernels.write_kv(k, v, kc, vc, slots)
    backend.kernels.write_kv(k, v, pk, pv, slots, True)
    want_k, want_v = pack_kv_blocks(kc, vc)
    assert torch.equal(pk.view(torch.uint8), want_k.view(torch.uint8))
    assert torch.equal(pv.view(torch.uint8), want_v.view(torch.uint8))


@pytest.mark.parametrize("cache_dtype", FP8, ids=["e4m3", "e5m2"])
def test_packed_kernel_reads_every_fp8_code_exactly(cache_dtype):
    """The packed kernel's widening (byte tables) is exact for every finite code, subnormals included: a row that
    sees one key outputs that key's value row (p = 1 is exact in bf16; -0 comes out as +0 from the fp32 sum)."""
    backend = _packed_fp8_backend(cache_dtype, 2, 1, 64, 16)
    codes = torch.arange(256, dtype=torch.uint8).view(cache_dtype)
    # The cache never holds NaN or inf (e5m2's codes for them): write_kv stores 0 and the largest finite value.
    finite = torch.isfinite(codes.float())
    codes = torch.where(finite, codes.float(), torch.zeros_like(codes.float())).to(cache_dtype)
    codes = codes.view(4, 64)  # each of the 4 rows' value row: 64 codes
    num_rows = 4
    vc = torch.zeros(num_rows, 16, 1, 64, dtype=cache_dtype)
    vc[:, 0, 0] = codes
    kc = torch.zeros_like(vc)
    pk, pv = pack_kv_blocks(kc, vc)
    q = torch.randn(num_rows, 2, 64).bfloat16()
    table = torch.arange(num_rows, dtype=torch.int32)[:, None]
    out = backend.kernels.paged_attention_packed(q, pk, pv, table, torch.ones(num_rows, dtype=torch.int64), 0.125)
    assert torch.equal(out.float(), codes.float()[:, None, :].expand(num_rows, 2, 64))
    # Keys too: a query of 1.0 at dim d scores each code of column d exactly (two keys: the code and zero).
    kc = torch.zeros(num_rows, 16, 1, 64, dtype=cache_dtype)
    kc[:, 0, 0] = codes
    vc = torch.zeros_like(kc)
    vc[:, 0, 0, 0], vc[:, 1, 0, 1] = 1.0, 1.0  # out[0] = p(key 0), out[1] = p(key 1)
    pk, pv = pack_kv_blocks(kc, vc)
    for d in range(0, 64, 7):
        q = torch.zeros(num_rows, 2, 64).bfloat16()
        q[:, :, d] = 1.0
        out = backend.kernels.paged_attention_packed(q, pk, pv, table, torch.full((num_rows,), 2), 1.0).float()
        score = codes[:, d].float().clamp(-60, 60)  # softmax of (score, 0): p0 = sigmoid(score)
        torch.testing.assert_close(out[:, 0, 0], torch.sigmoid(score), atol=5e-3, rtol=0)

"""Fused C++ elementwise kernels against the torch code they replace."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.build import require_kernels

K = require_kernels()

DTYPES = [(torch.float32, 1e-5), (torch.bfloat16, 0.0)]


def ulp_close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype, atol: float) -> None:
    if dtype == torch.bfloat16:
        # Same rounding steps as torch: equal, except a rare 1-ulp difference from the order of a sum.
        diff = (a.float() - b.float()).abs()
        ulp = b.float().abs().clamp(min=1e-30) * 2**-7
        assert (diff <= ulp).float().mean() > 0.999 and (diff <= 2 * ulp + 1e-6).all()
    else:
        torch.testing.assert_close(a, b, atol=atol, rtol=atol)


@pytest.mark.parametrize("dtype,atol", DTYPES)
@pytest.mark.parametrize("dim", [576, 64, 20])
def test_rms_norm_with_and_without_residual(dtype, atol, dim):
    torch.manual_seed(0)
    x = torch.randn(37, dim).to(dtype)
    res = torch.randn(37, dim).to(dtype)
    w = (1 + 0.1 * torch.randn(dim)).to(dtype)

    def ref(v):
        vf = v.float()
        return w * (vf * torch.rsqrt(vf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype)

    out = x.clone()
    K.rms_norm_(out, None, w, 1e-5)
    ulp_close(out, ref(x), dtype, atol)
    x2, r2 = x.clone(), res.clone()
    K.rms_norm_(x2, r2, w, 1e-5)
    summed = x + res
    assert torch.equal(r2, summed)
    ulp_close(x2, ref(summed), dtype, atol)


@pytest.mark.parametrize("dtype,atol", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 16])
def test_rotary_in_place_matches_torch(dtype, atol, head_dim):
    from kvserve.layers.rotary import RotaryEmbedding, _rotate

    torch.manual_seed(0)
    rope = RotaryEmbedding(head_dim, 512, 10000.0, None, dtype)
    t, h = 11, 5
    qkv = torch.randn(t, (h + 2) * head_dim).to(dtype)  # 5 heads to rotate, 2 more that must not change
    pos = torch.randint(0, 512, (t,))
    heads = qkv[:, : h * head_dim].view(t, h, head_dim)
    expected = _rotate(heads, rope.cos[pos].unsqueeze(1), rope.sin[pos].unsqueeze(1))
    tail = qkv[:, h * head_dim :].clone()
    K.rotary_(qkv[:, : h * head_dim], pos, rope.cos, rope.sin, h, head_dim)
    ulp_close(qkv[:, : h * head_dim].view(t, h, head_dim), expected, dtype, atol)
    assert torch.equal(qkv[:, h * head_dim :], tail)


@pytest.mark.parametrize("dtype,atol", DTYPES)
def test_silu_and_mul(dtype, atol):
    torch.manual_seed(0)
    x = (3 * torch.randn(9, 2 * 1536)).to(dtype)
    gate, up = x.chunk(2, dim=-1)
    ulp_close(K.silu_and_mul(x), torch.nn.functional.silu(gate) * up, dtype, max(atol, 1e-6))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_writes_slots_and_sanitises(dtype):
    cache_k = torch.zeros(4, 4, 3, 8, dtype=dtype)
    cache_v = torch.zeros_like(cache_k)
    qkv = torch.randn(5, 3 * 3 * 8).to(dtype)
    k, v = qkv[:, 24:48], qkv[:, 48:]  # strided row views, as in the model
    k[1, 3] = float("nan")
    v[2, 0] = float("inf")
    slots = torch.tensor([0, 5, 6, 15, 9])
    K.write_kv(k, v, cache_k, cache_v, slots)
    flat_k, flat_v = cache_k.view(16, 24), cache_v.view(16, 24)
    expect_k = torch.nan_to_num(k.clone())
    expect_v = torch.nan_to_num(v.clone())
    assert torch.equal(flat_k[slots], expect_k) and torch.equal(flat_v[slots], expect_v)
    assert torch.isfinite(cache_k).all() and torch.isfinite(cache_v).all()

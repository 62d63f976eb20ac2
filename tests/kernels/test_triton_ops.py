"""The layers' Triton kernels (kvserve/kernels/triton_ops.py) against the layers' native torch paths.

On a machine with CUDA they run on the GPU and are called through the layers (whose CUDA path picks them);
elsewhere the kernels run on the CPU in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1).
Half types must match the native path to the bit almost everywhere: it rounds at the same places, and only a
reduction's order or a special function's last bit may move an element by one unit in the last place.
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")

from kvserve.kernels import triton_ops  # noqa: E402
from kvserve.layers.activation import SiluAndMul  # noqa: E402
from kvserve.layers.norm import RMSNorm  # noqa: E402
from kvserve.layers.rotary import RotaryEmbedding  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(
    DEVICE == "cpu" and bool(os.environ.get("KVSERVE_CPU_ISA")), reason="forced ISA level: Triton tests run once"
)
DTYPES = [torch.bfloat16, torch.float16]


# Triton's interpreter casts fp32 to bf16 by truncation whatever rounding a kernel names (the GPU rounds to nearest
# even), so on the CPU bf16 results may sit a unit or two off almost everywhere: only the closeness is checked.
INTERPRETED_BF16 = DEVICE == "cpu"


def assert_matches(got: torch.Tensor, want: torch.Tensor, max_ulp_share: float = 0.01, max_units: int = 1) -> None:
    """Equal but for a few elements one unit in the last place apart (a reduction's order, exp/rsqrt's last bit)."""
    assert got.shape == want.shape and got.dtype == want.dtype
    assert torch.isfinite(got).all()
    mantissa_bits = 7 if want.dtype == torch.bfloat16 else 10
    ulp = torch.exp2(torch.floor(torch.log2(want.float().abs().clamp_min(1e-4))) - mantissa_bits)
    units = (got.float() - want.float()).abs() / ulp
    if INTERPRETED_BF16 and want.dtype == torch.bfloat16:
        # Truncated products cancel in a rotation's sums: a small result can be many of its own units off.
        torch.testing.assert_close(got.float(), want.float(), atol=3e-2, rtol=2e-2)
        return
    assert (units <= max_units).all(), f"off by {units.max()} units"
    assert (units > 0).float().mean() <= max_ulp_share, f"{(units > 0).float().mean():.3%} of elements differ"


def make_norm(n: int, dtype: torch.dtype) -> RMSNorm:
    with torch.device(DEVICE):
        norm = RMSNorm(n, 1e-6, use_kernel=False)
    norm.weight.data = (1 + 0.1 * torch.randn(n, device=DEVICE)).to(dtype)
    return norm


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,n", [(1, 256), (5, 640), (3, 96)])
def test_rms_norm(dtype, rows, n):
    torch.manual_seed(rows * n)
    norm = make_norm(n, dtype)
    x = (3 * torch.randn(rows, n, device=DEVICE)).to(dtype)
    want = norm.forward_native(x)
    got = triton_ops.rms_norm(x.clone(), norm.weight, norm.eps)
    assert_matches(got, want)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_with_residual_works_in_place_on_strided_rows(dtype):
    torch.manual_seed(1)
    n = 384
    norm = make_norm(n, dtype)
    # Rows of a wider buffer: the kernel must follow the row stride.
    wide = torch.randn(7, n + 64, device=DEVICE).to(dtype)
    x, residual = wide[:, :n], torch.randn(7, n, device=DEVICE).to(dtype)
    want_out, want_res = norm.forward_native(x.clone(), residual.clone())
    untouched = wide[:, n:].clone()
    got_out, got_res = triton_ops.rms_norm(x, norm.weight, norm.eps, residual)
    assert got_out.data_ptr() == x.data_ptr() and got_res.data_ptr() == residual.data_ptr()
    assert_matches(got_res, want_res, max_ulp_share=0.0)  # the add rounds exactly as torch's
    assert_matches(got_out, want_out)
    assert torch.equal(wide[:, n:], untouched)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,d", [(1, 1536), (4, 200)])
def test_silu_and_mul(dtype, rows, d):
    torch.manual_seed(d)
    x = (4 * torch.randn(rows, 2 * d, device=DEVICE)).to(dtype)
    with torch.device(DEVICE):
        want = SiluAndMul(use_kernel=False).forward_native(x)
    assert_matches(triton_ops.silu_and_mul(x), want)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim,num_q,num_kv", [(64, 4, 2), (128, 32, 8), (96, 3, 1)])
def test_rotary(dtype, head_dim, num_q, num_kv):
    torch.manual_seed(head_dim + num_q)
    with torch.device(DEVICE):
        rope = RotaryEmbedding(head_dim, 4096, 500000.0, None, dtype, use_kernel=False)
    t = 6
    # A fused qkv row: q heads, k heads, then v heads, which must stay as they are.
    qkv = torch.randn(t, (num_q + 2 * num_kv) * head_dim, device=DEVICE).to(dtype)
    positions = torch.tensor([0, 1, 7, 300, 4095, 2048], device=DEVICE)
    qk = (num_q + num_kv) * head_dim
    want = qkv.clone()
    rope.forward_native(positions, want[:, :qk], num_q + num_kv)
    got = qkv.clone()
    triton_ops.rotary_(positions, got[:, :qk], rope.cos, rope.sin, num_q + num_kv)
    assert torch.equal(got[:, qk:], qkv[:, qk:])
    assert_matches(got, want, max_ulp_share=0.0)  # no reduction, no special function: the same bits


@pytest.mark.parametrize("dtype", DTYPES)
def test_empty_batches(dtype):
    norm = make_norm(64, dtype)
    empty = torch.empty(0, 64, device=DEVICE, dtype=dtype)
    assert triton_ops.rms_norm(empty, norm.weight, 1e-6).shape == (0, 64)
    assert triton_ops.silu_and_mul(torch.empty(0, 128, device=DEVICE, dtype=dtype)).shape == (0, 64)


@pytest.mark.skipif(DEVICE != "cuda", reason="the layers pick the Triton kernels on CUDA only")
def test_layers_pick_the_kernels_for_half_types_only():
    torch.manual_seed(0)
    with torch.device("cuda"):
        norm, act = RMSNorm(128, 1e-6), SiluAndMul()
    assert norm.impl == act.impl == "cuda"
    x = torch.randn(4, 128, device="cuda")
    assert torch.equal(norm(x), norm.forward_native(x))  # fp32: the native path itself
    xh, wh = x.bfloat16(), norm.weight.data.bfloat16()
    norm.weight.data = wh
    assert_matches(norm(xh), norm.forward_native(xh))
    y = torch.randn(4, 256, device="cuda").bfloat16()
    assert_matches(act(y), act.forward_native(y))


@pytest.mark.parametrize("dtype", DTYPES)
def test_qk_norm_in_place_on_fused_qkv_rows(dtype):
    """Qwen3's q/k norm in one launch, in place on qkv rows (query heads, key heads, then values, untouched),
    against the two norms over reshaped copies and their write-backs."""
    torch.manual_seed(2)
    num_heads, num_kv_heads, head_dim = 4, 2, 64
    q_norm, k_norm = make_norm(head_dim, dtype), make_norm(head_dim, dtype)
    qkv = (3 * torch.randn(5, (num_heads + 2 * num_kv_heads) * head_dim + 32, device=DEVICE)).to(dtype)[:, :-32]
    want, q_size, k_end = qkv.clone(), num_heads * head_dim, (num_heads + num_kv_heads) * head_dim
    want[:, :q_size] = q_norm.forward_native(want[:, :q_size].reshape(-1, head_dim)).view(5, -1)
    want[:, q_size:k_end] = k_norm.forward_native(want[:, q_size:k_end].reshape(-1, head_dim)).view(5, -1)
    got = qkv.clone()
    triton_ops.qk_norm_(got, q_norm.weight, k_norm.weight, q_norm.eps, num_heads, num_kv_heads)
    # A unit of the normalised value (the sum's order) can become two once the weight (~1.1) multiplies it.
    assert_matches(got, want, max_units=2)
    v_start = (num_heads + num_kv_heads) * head_dim
    assert torch.equal(got[:, v_start:], qkv[:, v_start:])

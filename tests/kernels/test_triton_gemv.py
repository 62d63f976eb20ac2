"""The batch-1 Triton GEMV (kvserve/kernels/triton_gemv.py) against F.linear, and how a layer picks it.

On a machine with CUDA it runs on the GPU; elsewhere in Triton's interpreter (tests/conftest.py sets
TRITON_INTERPRET=1), which rounds fp32 to bf16 by truncation: half results are compared to within a unit or two
of the reference's last place rather than to the bit.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from kvserve.kernels.triton_gemv import CANDIDATES, GemvConfig, gemv, pick  # noqa: E402
from kvserve.layers.linear import Linear  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(
    DEVICE == "cpu" and bool(os.environ.get("KVSERVE_CPU_ISA")), reason="forced ISA level: Triton tests run once"
)


def reference(x, w, b):
    """fp32 sums of the half inputs, rounded once: what cuBLAS computes, in any order."""
    y = x.float() @ w.float().T
    return (y + b.float() if b is not None else y).to(x.dtype)


@pytest.mark.parametrize("config", CANDIDATES[:2] + (GemvConfig(block_n=4, block_k=64, num_warps=4),))
@pytest.mark.parametrize("n,k,bias", [(37, 200, False), (64, 128, True), (5, 1030, True)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_gemv_matches_the_fp32_sum(config, n, k, bias, dtype):
    torch.manual_seed(n * k)
    x = torch.randn(1, k, device=DEVICE).to(dtype)
    w = torch.randn(n, k, device=DEVICE).to(dtype)
    b = torch.randn(n, device=DEVICE).to(dtype) if bias else None
    got = gemv(x, w, b, config)
    want = reference(x, w, b)
    assert got.shape == (1, n) and got.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    else:
        # One rounding of an fp32 sum: at most a unit or two apart (interpreter: truncation), relative to |y|.
        unit = 2.0 ** -(7 if dtype == torch.bfloat16 else 10)
        err = (got.float() - want.float()).abs() / want.float().abs().clamp_min(1.0)
        assert (err <= 2 * unit).all(), err.max()


def test_a_layer_with_a_config_uses_it_at_batch_1_only(monkeypatch):
    from kvserve.kernels import triton_gemv

    calls = []
    real = triton_gemv.gemv
    monkeypatch.setattr(triton_gemv, "gemv", lambda *a: calls.append(a[3]) or real(*a))
    torch.manual_seed(0)
    with torch.device(DEVICE):
        layer = Linear(96, 40, bias=True)
    layer.weight.data = torch.randn(40, 96, device=DEVICE)
    layer.bias.data = torch.randn(40, device=DEVICE)
    x = torch.randn(3, 96, device=DEVICE)
    want = F.linear(x, layer.weight, layer.bias)
    torch.testing.assert_close(layer(x[1:2]), want[1:2])  # no config: F.linear
    layer.gemv_config = GemvConfig(block_n=8, block_k=32, num_warps=4)
    torch.testing.assert_close(layer(x), want)  # batch 3: F.linear
    assert calls == []
    torch.testing.assert_close(layer(x[1:2]), want[1:2], rtol=1e-5, atol=1e-4)
    assert calls == [layer.gemv_config]


def test_pick_takes_the_fastest_candidate_only_where_it_beats_cublas():
    times = {repr(c): 10.0 + i for i, c in enumerate(CANDIDATES)}
    assert pick({**times, "cublas": 12.0}) == CANDIDATES[0]
    assert pick({**times, "cublas": 10.2}) is None  # within 3%: cuBLAS stays
    times[repr(CANDIDATES[2])] = 5.0
    assert pick({**times, "cublas": 12.0}) == CANDIDATES[2]


@pytest.mark.parametrize("config", CANDIDATES[:1] + (GemvConfig(block_n=4, block_k=64, num_warps=4),))
@pytest.mark.parametrize("n,k,bias", [(37, 200, False), (5, 1030, True)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_silu_mul_gemv_is_the_two_launches_it_replaces(config, n, k, bias, dtype):
    from kvserve.kernels.triton_ops import silu_and_mul

    torch.manual_seed(n + k)
    gate_up = (3 * torch.randn(1, 2 * k, device=DEVICE)).to(dtype)
    gate_up[0, :7] = torch.tensor([0.0, -0.0, 30.0, -30.0, 88.0, -88.0, 1e-3])  # SiLU's saturated ends, zeros
    w = torch.randn(n, k, device=DEVICE).to(dtype)
    b = torch.randn(n, device=DEVICE).to(dtype) if bias else None
    fused = gemv(gate_up, w, b, config, silu_mul=True)
    assert torch.equal(fused, gemv(silu_and_mul(gate_up), w, b, config))


def test_the_mlp_fuses_silu_into_its_down_projection_at_batch_1_only(monkeypatch):
    from kvserve.config import ArchConfig
    from kvserve.kernels import triton_gemv
    from kvserve.models.llama import LlamaMLP

    cfg = ArchConfig("LlamaForCausalLM", 100, 64, 96, 1, 4, 2, 16, 1e-5, 1e4, 128)
    with torch.device(DEVICE):
        mlp = LlamaMLP(cfg).to(torch.bfloat16)
    torch.manual_seed(0)
    for p in mlp.parameters():
        p.data = torch.randn_like(p) * 0.2
    assert mlp.down_proj.takes_silu_mul and not mlp.gate_up_proj.takes_silu_mul
    x = torch.randn(3, 64, device=DEVICE).to(torch.bfloat16)
    want = mlp(x)
    calls = []
    real = triton_gemv.gemv
    monkeypatch.setattr(triton_gemv, "gemv", lambda *a, **kw: calls.append(kw.get("silu_mul")) or real(*a, **kw))
    mlp.down_proj.gemv_silu_config = GemvConfig(block_n=4, block_k=32, num_warps=4)
    torch.testing.assert_close(mlp(x), want)  # batch 3: the two launches
    assert calls == []
    got = mlp(x[1:2])
    assert calls == [True]
    # The same bits as the GPU's two launches (Triton's SiLU-and-mul, then the GEMV with the same config; the CPU's
    # own SiluAndMul, which the module path takes here, rounds in another order).
    from kvserve.kernels.triton_ops import silu_and_mul

    two = real(silu_and_mul(mlp.gate_up_proj(x[1:2])), mlp.down_proj.weight, None, mlp.down_proj.gemv_silu_config)
    assert torch.equal(got, two)
    torch.testing.assert_close(got, want[1:2], rtol=0.05, atol=0.05)
    mlp.down_proj.gemv_silu_config = None
    assert torch.equal(mlp(x[1:2]), want[1:2])  # no fused config: the module path as before

"""CustomOp dispatch: each op's cpu (C++ kernel) path agrees with its native (torch) path, and the path is fixed
when the op is built."""

from __future__ import annotations

import types

import pytest
import torch

from kvserve.layers import custom_op
from kvserve.layers.activation import SiluAndMul
from kvserve.layers.norm import RMSNorm
from kvserve.layers.rotary import RotaryEmbedding
from kvserve.sample.sampler import GumbelSample

KERNELS_BUILT = custom_op.load_cpu_kernels() is not None
needs_kernels = pytest.mark.skipif(
    not KERNELS_BUILT, reason="C++ kernels not loaded (no build, or KVSERVE_CPU_KERNELS=0)"
)

DTYPES = [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)]


def pair(cls, *args, **kwargs):
    """The same op built twice: the kernel path and the forced native one."""
    cpu, native = cls(*args, **kwargs), cls(*args, use_kernel=False, **kwargs)
    assert cpu.impl == "cpu" and native.impl == "native"
    return cpu, native


@needs_kernels
@pytest.mark.parametrize("dtype,atol", DTYPES)
def test_rms_norm_paths_agree(dtype, atol):
    torch.manual_seed(0)
    cpu, native = pair(RMSNorm, 64, 1e-6)
    w = (1 + 0.1 * torch.randn(64)).to(dtype)
    for op in (cpu, native):
        op.weight.data = w.clone()
    x, res = torch.randn(9, 64).to(dtype), torch.randn(9, 64).to(dtype)
    torch.testing.assert_close(cpu(x), native(x), atol=atol, rtol=atol)
    got, got_res = cpu(x.clone(), res.clone())
    want, want_res = native(x.clone(), res.clone())
    torch.testing.assert_close(got, want, atol=atol, rtol=atol)
    assert torch.equal(got_res, want_res)
    # A non-contiguous input goes the native way on the cpu op too.
    strided = torch.randn(9, 128).to(dtype)[:, ::2]
    torch.testing.assert_close(cpu(strided), native(strided), atol=atol, rtol=atol)


@needs_kernels
@pytest.mark.parametrize("dtype,atol", DTYPES)
def test_rotary_paths_agree(dtype, atol):
    torch.manual_seed(0)
    head_dim, t, h = 64, 7, 3
    cpu, native = pair(RotaryEmbedding, head_dim, 256, 10000.0, None, dtype)
    qkv = torch.randn(t, (h + 1) * head_dim).to(dtype)  # rotate 3 heads of a row view, the last one untouched
    pos = torch.randint(0, 256, (t,))
    a, b = qkv.clone(), qkv.clone()
    cpu.rotate_(pos, a[:, : h * head_dim], h)
    native.rotate_(pos, b[:, : h * head_dim], h)
    torch.testing.assert_close(a, b, atol=atol, rtol=atol)
    assert torch.equal(a[:, h * head_dim :], qkv[:, h * head_dim :])
    assert not torch.equal(a, qkv)


@needs_kernels
@pytest.mark.parametrize("dtype,atol", DTYPES)
def test_silu_and_mul_paths_agree(dtype, atol):
    torch.manual_seed(0)
    cpu, native = pair(SiluAndMul)
    x = (3 * torch.randn(5, 2 * 96)).to(dtype)
    torch.testing.assert_close(cpu(x), native(x), atol=atol, rtol=atol)
    x3 = x.view(5, 1, -1)  # not the kernel's [T, 2d] layout: native on both
    torch.testing.assert_close(cpu(x3), native(x3))


@needs_kernels
def test_gumbel_sample_paths_agree():
    torch.manual_seed(0)
    cpu, native = pair(GumbelSample)
    logits = torch.randn(64, 1000) * 3
    keys = torch.arange(64, dtype=torch.int64) * 104729
    # Same hash, a different log: equal except where two perturbed values tie within rounding.
    assert (cpu(logits, keys) == native(logits, keys)).float().mean() > 0.95


def _fake_kernels(calls: list[str]) -> types.SimpleNamespace:
    def record(name):
        def fn(*args, **kwargs):
            calls.append(name)
            raise AssertionError(f"kernel {name} called")

        return fn

    return types.SimpleNamespace(**{n: record(n) for n in ("rms_norm_", "rotary_", "silu_and_mul", "sample_gumbel")})


def test_choice_is_made_at_construction(monkeypatch):
    calls: list[str] = []
    monkeypatch.setattr(custom_op, "load_cpu_kernels", lambda: _fake_kernels(calls))
    x = torch.randn(4, 16)
    keys = torch.arange(4, dtype=torch.int64)
    # Forced native: the kernels are there but never called.
    natives = [
        RMSNorm(16, 1e-6, use_kernel=False),
        RotaryEmbedding(8, 32, 10000.0, None, torch.float32, use_kernel=False),
        SiluAndMul(use_kernel=False),
        GumbelSample(use_kernel=False),
    ]
    assert [op.impl for op in natives] == ["native"] * 4
    natives[0](x)
    natives[0](x.clone(), x.clone())
    natives[1].rotate_(torch.arange(4), x.clone(), 2)
    natives[2](x)
    natives[3](x, keys)
    assert calls == []

    # Built while the kernels load: the cpu path, even if the kernels are gone by the time it runs.
    norm = RMSNorm(16, 1e-6)
    monkeypatch.setattr(custom_op, "load_cpu_kernels", lambda: None)
    assert norm.impl == "cpu"
    with pytest.raises(AssertionError, match="rms_norm_"):
        norm(x)
    assert calls == ["rms_norm_"]
    # Built without them (no build, or KVSERVE_CPU_KERNELS=0): native.
    assert RMSNorm(16, 1e-6).impl == SiluAndMul().impl == GumbelSample().impl == "native"


def test_cuda_ops_default_to_native(monkeypatch):
    """forward_cuda defaults to forward_native; the CPU kernels are not even loaded for a cuda op."""
    monkeypatch.setattr(custom_op, "load_cpu_kernels", lambda: pytest.fail("loaded the CPU kernels"))
    op = SiluAndMul(device="cuda")
    assert op.impl == "cuda" and op.kernels is None
    x = torch.randn(3, 8)
    torch.testing.assert_close(op(x), SiluAndMul(device="meta").forward_native(x))

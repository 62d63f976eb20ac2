"""The few-row linear kernel (batch-1 decode) and the Linear layer's choice of path, against F.linear."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvserve.layers.linear import SMALL_M, Linear
from tests.kernels.build import require_kernels

K = require_kernels()


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("m", [1, 3])
@pytest.mark.parametrize("n,k", [(960, 576), (37, 20), (16, 1536), (5, 3)])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_small_matches_torch(dtype, tol, m, n, k, bias):
    torch.manual_seed(0)
    x = torch.randn(m, k).to(dtype)
    w = torch.randn(n, k).to(dtype)
    b = torch.randn(n).to(dtype) if bias else None
    got = K.linear_small(x, w, b)
    want = F.linear(x.float(), w.float(), None if b is None else b.float())
    assert got.dtype == dtype and got.shape == (m, n)
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol * k**0.5)


@pytest.mark.parametrize("rows", [1, SMALL_M, SMALL_M + 1, 64])
@pytest.mark.parametrize("keep_packed_too", [False, True])
def test_fp32_linear_keeps_plain_weights_and_matches(rows, keep_packed_too, monkeypatch):
    torch.manual_seed(0)
    lin = Linear(64, 48, bias=True)
    lin.weight.data.normal_()
    lin.bias.data.normal_()
    w, b = lin.weight.detach().clone(), lin.bias.detach().clone()
    lin.pack_for_cpu(keep_packed_too=keep_packed_too)
    assert lin.weight is not None and lin._small_kernels is not None
    if not keep_packed_too:
        assert lin._packed is None
    calls = []
    real = lin._small_kernels

    class Spy:
        def linear_small(self, *args):
            calls.append(args[0].shape[0])
            return real.linear_small(*args)

    monkeypatch.setattr(lin, "_small_kernels", Spy())
    x = torch.randn(rows, 64)
    torch.testing.assert_close(lin(x), F.linear(x, w, b), rtol=1e-5, atol=1e-4)
    assert calls == ([rows] if rows <= SMALL_M else [])  # few rows: the kernel; more: a GEMM


def test_bf16_linear_is_packed_where_bf16_is_native():
    from kvserve.platform import cpu_info

    lin = Linear(64, 48)
    lin.weight.data = torch.randn(48, 64).bfloat16()
    lin.pack_for_cpu()
    assert lin._small_kernels is None
    if cpu_info().native_bf16:
        assert lin._packed is not None and lin.weight is None
    else:
        assert lin._packed is None and lin.weight is not None

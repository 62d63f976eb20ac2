"""The panel-layout linear kernel (every batch size) and the Linear layer's choice of weight form, against F.linear."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvserve.layers.linear import Linear
from kvserve.platform import cpu_info
from tests.kernels.build import require_kernels

K = require_kernels()


def test_panel_layout():
    w = torch.arange(5 * 3, dtype=torch.float32).view(5, 3)
    wp = K.pack_linear_weight(w)
    width = K.linear_panel_width()
    assert wp.shape == (1, 3, width)
    torch.testing.assert_close(wp[0, :, :5], w.t())  # k-major panel
    assert not wp[0, :, 5:].any()  # zero rows past N


# Rows: the batch-1 stream, row tiles and their tails, several row blocks (K = 1536 holds ~40 rows per block);
# K: a vector tail, one k block, several; N: partial panels.
@pytest.mark.parametrize("m", [1, 2, 5, 7, 13, 64, 100])
@pytest.mark.parametrize("n,k", [(960, 576), (37, 20), (16, 1536), (5, 3)])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_linear_packed_matches_torch(m, n, k, dtype, tol):
    torch.manual_seed(0)
    x = torch.randn(m, k).to(dtype)
    w = torch.randn(n, k).to(dtype)
    b = torch.randn(n).to(dtype)
    wp = K.pack_linear_weight(w)
    for bias in (None, b):
        got = K.linear_packed(x, wp, n, bias)
        want = F.linear(x.float(), w.float(), None if bias is None else bias.float())
        assert got.dtype == dtype and got.shape == (m, n)
        torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol * k**0.5)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_linear_packed_pair_tiles(threads):
    """Tiles over two adjacent panels of a thread's share (AVX-512; AVX2 at 2-3 rows), its odd last panel alone: odd and
    even shares, a partial last panel inside a pair and alone, row counts around the pair tiles, one k block and
    several (K = 1536)."""
    torch.manual_seed(0)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for n, k in ((100, 70), (160, 576), (200, 1536), (64, 33), (96, 8)):
            w = torch.randn(n, k)
            wp = K.pack_linear_weight(w)
            for m in (2, 6, 7, 11, 12, 25, 48, 131):
                x = torch.randn(m, k)
                torch.testing.assert_close(
                    K.linear_packed(x, wp, n, None), F.linear(x, w), rtol=1e-5, atol=1e-5 * k**0.5
                )
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("n,k", [(960, 576), (37, 700), (200, 1536)])
def test_linear_packed_row_is_batch_invariant(n, k):
    """A row's output is bitwise the same alone (the batch-1 stream) as inside any batch (the row tiles), so a
    request's greedy tokens cannot depend on what it is batched with."""
    torch.manual_seed(0)
    x = torch.randn(64, k)
    wp = K.pack_linear_weight(torch.randn(n, k))
    alone = torch.cat([K.linear_packed(x[i : i + 1], wp, n, None) for i in range(len(x))])
    for m in (2, 5, 13, 64):
        assert torch.equal(K.linear_packed(x[:m], wp, n, None), alone[:m])


def test_linear_packed_rejects_mismatches():
    wp = K.pack_linear_weight(torch.randn(40, 8))
    with pytest.raises(RuntimeError, match="n does not match"):
        K.linear_packed(torch.randn(2, 8), wp, wp.shape[0] * K.linear_panel_width() + 1, None)
    with pytest.raises(RuntimeError, match="x \\[M, K\\]"):
        K.linear_packed(torch.randn(2, 9), wp, 40, None)


def _loaded(dtype: torch.dtype, bias: bool = True) -> tuple[Linear, torch.Tensor, torch.Tensor | None]:
    torch.manual_seed(0)
    lin = Linear(64, 48, bias=bias)
    lin.weight.data = torch.randn(48, 64).to(dtype)
    if bias:
        lin.bias.data = torch.randn(48).to(dtype)
    return lin, lin.weight.detach().clone(), None if lin.bias is None else lin.bias.detach().clone()


@pytest.mark.parametrize("rows", [1, 4, 64])
def test_fp32_linear_holds_only_panels_and_matches(rows):
    lin, w, b = _loaded(torch.float32)
    lin.pack_for_cpu()
    assert lin.weight is None and lin._packed is None and lin._panels is not None
    x = torch.randn(rows, 64)
    torch.testing.assert_close(lin(x), F.linear(x, w, b), rtol=1e-5, atol=1e-4)


def test_bf16_linear_form_follows_the_cpu():
    lin, w, b = _loaded(torch.bfloat16)
    lin.pack_for_cpu()
    assert lin.weight is None
    if cpu_info().native_bf16 and K.linear_bf16_pairs_supported():
        assert lin._panel_kind == "bf16_pairs" and lin._packed is None  # vdpbf16ps on kvserve's pair panels
    elif cpu_info().native_bf16:
        assert lin._packed is not None and lin._panels is None  # oneDNN's bf16 kernels (kernels built lower)
    else:
        assert lin._panels is not None and lin._panels.dtype == torch.bfloat16  # not oneDNN's emulated bf16
    x = torch.randn(3, 64).bfloat16()
    torch.testing.assert_close(lin(x).float(), F.linear(x.float(), w.float(), b.float()), rtol=2e-2, atol=5e-2)


pairs = pytest.mark.skipif(not K.linear_bf16_pairs_supported(), reason="bf16 pair panels need AVX512-BF16")
AMX_HERE = K.linear_bf16_amx_active()


@pytest.fixture(params=["vdpbf16ps", "amx"])
def pair_path(request):
    """Run the pair-panel kernels on both of their paths: AVX512-BF16 vectors, and AMX tiles where the CPU has
    them (there, every row count takes the tiles unless they are turned off)."""
    if request.param == "amx" and not AMX_HERE:
        pytest.skip("no AMX-BF16 on this CPU (or Linux refused the tile registers)")
    was = K.linear_amx_set_enabled(request.param == "amx")
    yield request.param
    K.linear_amx_set_enabled(was)


@pairs
def test_amx_tiles_are_used_where_the_cpu_has_them():
    assert AMX_HERE == ("amx_bf16" in cpu_info().features and "amx_tile" in cpu_info().features)


@pairs
def test_pair_panel_layout():
    w = torch.arange(5 * 4, dtype=torch.float32).view(5, 4).bfloat16()
    wp = K.pack_linear_weight_bf16_pairs(w)
    width = K.linear_panel_width()  # the same panel width as the float panels
    assert wp.shape == (1, 2, width, 2)
    torch.testing.assert_close(wp[0, :, :5, :], w.view(5, 2, 2).transpose(0, 1))  # (k, k + 1) pairs, k-major
    assert not wp[0, :, 5:].any()
    with pytest.raises(RuntimeError, match="K must be even"):
        K.pack_linear_weight_bf16_pairs(torch.zeros(4, 3).bfloat16())


@pairs
@pytest.mark.parametrize("m", [1, 2, 12, 13, 16, 17, 64, 100])
@pytest.mark.parametrize("n,k", [(960, 576), (37, 20), (16, 1536), (5, 2), (40, 70)])
def test_linear_bf16_pairs_matches_torch(m, n, k, pair_path):
    torch.manual_seed(0)
    x = torch.randn(m, k).bfloat16()
    w = torch.randn(n, k).bfloat16()
    b = torch.randn(n).bfloat16()
    wp = K.pack_linear_weight_bf16_pairs(w)
    for bias in (None, b):
        got = K.linear_bf16_pairs(x, wp, n, bias)
        want = F.linear(x.double(), w.double(), None if bias is None else bias.double())
        assert got.dtype == torch.bfloat16 and got.shape == (m, n)
        # Exact products, fp32 sums: only the output's rounding to bf16 is left.
        torch.testing.assert_close(got.double(), want, rtol=1e-2, atol=1e-3 * k**0.5)


@pairs
@pytest.mark.parametrize("n,k", [(960, 576), (37, 700), (200, 1536)])
def test_linear_bf16_pairs_row_is_batch_invariant(n, k, pair_path):
    torch.manual_seed(0)
    x = torch.randn(64, k).bfloat16()
    wp = K.pack_linear_weight_bf16_pairs(torch.randn(n, k).bfloat16())
    alone = torch.cat([K.linear_bf16_pairs(x[i : i + 1], wp, n, None) for i in range(len(x))])
    for m in (2, 5, 13, 16, 17, 33, 48, 64):
        assert torch.equal(K.linear_bf16_pairs(x[:m], wp, n, None), alone[:m])


@pairs
def test_linear_bf16_pairs_large_output_matches_torch(pair_path):
    """An output of 16 MB or more (an LM head at ~170 rows and up) is written with streaming stores: same values."""
    torch.manual_seed(0)
    m, n, k = 176, 49152, 64
    x = torch.randn(m, k).bfloat16()
    w = torch.randn(n, k).bfloat16()
    got = K.linear_bf16_pairs(x, K.pack_linear_weight_bf16_pairs(w), n, None)
    want = F.linear(x.double(), w.double())
    torch.testing.assert_close(got.double(), want, rtol=1e-2, atol=1e-3 * k**0.5)
    # ... and a row's bits are its bits alone.
    assert torch.equal(got[100:101], K.linear_bf16_pairs(x[100:101], K.pack_linear_weight_bf16_pairs(w), n, None))


@pairs
def test_bf16_linear_with_an_odd_input_width_keeps_another_form():
    torch.manual_seed(0)
    lin = Linear(63, 48)
    lin.weight.data = torch.randn(48, 63).bfloat16()
    w = lin.weight.detach().clone()
    lin.pack_for_cpu()
    assert lin._panel_kind == "float"  # oneDNN's packed copy, or float panels
    x = torch.randn(3, 63).bfloat16()
    torch.testing.assert_close(lin(x).float(), F.linear(x.float(), w.float()), rtol=2e-2, atol=5e-2)

"""The int4 kernel (kernels/csrc/int4_linear.cpp) against exact references computed in torch, at the ISA level the
kernels were built for (run this file with KVSERVE_CPU_ISA=generic|avx2|avx512 to check the lower levels:
generic loops, AVX2 and AVX-512BW vpmaddubsw with int16 block sums, AVX512-VNNI vpdpbusd)."""

from __future__ import annotations

import pytest
import torch

from kvserve.layers.quant.int4_linear import (
    block_dots,
    pack_int4_weight,
    quantize_q4_1,
    quantize_rows_q8,
)
from tests.kernels.build import require_kernels

kernels = require_kernels()


def _x(rows: int, k: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, k, generator=g) * torch.linspace(0.01, 30, rows)[:, None]).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_activation_quantization_is_bitwise_the_torch_reference(dtype):
    x = _x(9, 192, 0, dtype)
    x[1, 32:64] = 0.0  # an all-zero block
    x[2, :8] = torch.tensor([127.0, 0.5, 1.5, 2.5, -0.5, -1.5, 3.5, -2.5])  # scale 1: ties round to even
    x[2, 8:32] = 0.0
    x[4, 70] = float("inf")
    x[5, 100] = float("nan")
    q, dx, mx = kernels.int4_quantize_rows(x)
    want_q, want_dx, want_mx = quantize_rows_q8(x)
    assert torch.equal(q, want_q)
    assert torch.allclose(dx, want_dx, rtol=0, atol=0, equal_nan=True)
    assert torch.allclose(mx, want_mx, rtol=0, atol=0, equal_nan=True)
    assert q[2, :8].tolist() == [127, 0, 2, 2, 0, -2, 4, -2]
    assert dx[1, 1] == 0 and mx[1, 1] == 0 and not q[1, 32:64].any()
    assert dx[4, 2].isnan() and dx[5, 3].isnan() and not q[4, 64:96].any()  # non-finite blocks: nan, not numbers
    assert q.abs().max() <= 127


def _int_reference(x: torch.Tensor, codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """The kernel's formula in float64 from the exact int32 block dots of the reference quantization."""
    q, dx, mx = quantize_rows_q8(x)
    dots = block_dots(q, codes).double()  # [T, N, KB]
    return (dots * (d.double()[None] * dx.double()[:, None]) + m.double()[None] * mx.double()[:, None]).sum(-1)


@pytest.mark.parametrize("k,n", [(32, 3), (64, 24), (576, 200), (1536, 576), (576, 1000)])
@pytest.mark.parametrize("rows", [1, 2, 5, 8, 9, 17, 18, 19, 40])
def test_integer_outputs_are_exact(k, n, rows):
    """d = 1, m = -8 (Q4_0's form) and activations that quantize to themselves (every block holds 127, so dx = 1):
    every output is an integer below 2^24, so the kernel must equal the int64 reference exactly. Covers the GEMV
    (1 row, panel groups and single panels), the GEMM tiles and their tails (on AVX2 row blocks of 16 or more take
    the unpacked 4-row tiles: 17-19 leave tails of 1-3 rows), N not a multiple of a panel."""
    g = torch.Generator().manual_seed(k * n + rows)
    codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    codes[0] = 15  # the largest products, 15 * 127: see row 0 below
    ones = torch.ones(n, k // 32)
    packed = pack_int4_weight(codes, ones, torch.full_like(ones, -8.0))
    xi = torch.randint(-127, 128, (rows, k), generator=g)
    xi.view(rows, -1, 32)[:, :, 0] = 127
    # Row 0: 127 at every k with k % 4 in (0, 1), the 16 products of one int16 lane per block in vpmaddubsw's pairing:
    # against channel 0's all-15 codes that lane sums 16 * 15 * 127 = 30,480 (the int16 bound). The other k stay
    # random, so that a wrong nibble or byte order changes the result.
    xi[0].view(-1, 4)[:, :2] = 127
    want = (xi.long() @ (codes.long() - 8).t()).float()
    assert torch.equal(kernels.int4_linear(xi.float(), packed, n), want)
    assert torch.equal(kernels.int4_linear(xi.bfloat16(), packed, n), want)  # |x| <= 127 is exact in bf16


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k,n", [(64, 24), (576, 200), (1536, 576)])
@pytest.mark.parametrize("rows", [1, 3, 17])
def test_scaled_outputs_match_the_integer_reference(k, n, rows, out_dtype):
    """Real scales and offsets (Q4_1 of a random weight) and random rows: the fp32 sum over blocks of exact block
    dots agrees with the float64 reference to fp32 rounding; bias added; bf16 output rounded once."""
    g = torch.Generator().manual_seed(k + n + rows)
    codes, d, m = quantize_q4_1(torch.randn(n, k, generator=g) * 0.05)
    bias = torch.randn(n, generator=g)
    x = _x(rows, k, rows)
    y = kernels.int4_linear(x, pack_int4_weight(codes, d, m), n, bias, out_dtype)
    assert y.dtype == out_dtype and y.shape == (rows, n)
    ref = _int_reference(x, codes, d, m) + bias.double()
    q, dx, mx = quantize_rows_q8(x)
    magnitude = (block_dots(q, codes).double().abs() * d.double()[None] * dx.double()[:, None]).sum(-1) + (
        m.double().abs()[None] * mx.double().abs()[:, None]
    ).sum(-1)
    tol = (2e-6 * k / 32 * magnitude + 1e-6) if out_dtype == torch.float32 else ref.abs() / 128 + 1e-6
    assert ((y.double() - ref).abs() <= tol).all(), float((y.double() - ref).abs().max())


def test_rows_do_not_depend_on_their_batch():
    g = torch.Generator().manual_seed(7)
    codes, d, m = quantize_q4_1(torch.randn(200, 576, generator=g))
    packed = pack_int4_weight(codes, d, m)
    x = _x(23, 576, 3)
    full = kernels.int4_linear(x, packed, 200)
    for i in (0, 9, 22):
        assert torch.equal(kernels.int4_linear(x[i : i + 1], packed, 200)[0], full[i])


def test_bad_shapes_are_refused():
    codes, d, m = quantize_q4_1(torch.randn(16, 64))
    packed = pack_int4_weight(codes, d, m)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        kernels.int4_linear(torch.randn(2, 48), packed, 16)
    with pytest.raises(RuntimeError, match="features"):
        kernels.int4_linear(torch.randn(2, 96), packed, 16)
    with pytest.raises(RuntimeError, match="n does not match"):
        kernels.int4_linear(torch.randn(2, 64), packed, 17)

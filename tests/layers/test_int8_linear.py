"""The int8 linear against a float reference, with error bounds derived from the quantization steps."""

from __future__ import annotations

import pytest
import torch

from kvserve.layers.linear import Linear
from kvserve.layers.quant.apply import model_weight_bytes, quantize_linears
from kvserve.layers.quant.int8_linear import (
    ACTIVATION_LEVELS,
    Int8Linear,
    quantize_per_channel,
    quantize_rows,
    rotation_matrix,
    rotation_signs,
)

SHAPES = [(64, 96), (576, 960), (1536, 576)]  # (in, out)


def _weights(k: int, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05
    w[0] = 0.0  # an all-zero channel
    w[1, 3] = 2.0  # an outlier channel
    return w, torch.randn(n, generator=g)


def test_per_channel_codes_within_half_a_step():
    w, _ = _weights(576, 960, 0)
    codes, scale = quantize_per_channel(w)
    assert codes.dtype == torch.int8 and codes.abs().max() <= 127
    assert scale[0] == 1.0 and not codes[0].any()
    err = (codes.float() * scale[:, None] - w).abs()
    assert (err <= scale[:, None] / 2 + 1e-5 * w.abs()).all()  # plus fp32 rounding


def _hadamard_rotation(k: int) -> torch.Tensor:
    """The block rotation written out independently: [k, k] block-diagonal, each block diag(signs) H_64 / 8."""
    h = torch.tensor([[1.0]], dtype=torch.float64)
    for _ in range(6):
        h = torch.kron(torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64), h)
    block = rotation_signs().double()[:, None] * h / 8.0
    return torch.block_diag(*[block] * (k // 64))


def test_rotation_is_orthogonal_hadamard():
    r = rotation_matrix().double()
    assert torch.allclose(r @ r.t(), torch.eye(64, dtype=torch.float64), atol=1e-6)
    assert torch.allclose(r, _hadamard_rotation(64), atol=1e-7)
    assert set(rotation_signs().tolist()) == {-1.0, 1.0}


IMPLS = [pytest.param(True, id="kernel"), pytest.param(False, id="native")]


@pytest.mark.parametrize("use_kernel", IMPLS)
@pytest.mark.parametrize("k,n", SHAPES + [(40, 24)])
@pytest.mark.parametrize("rows", [1, 3, 17, 64])
def test_int8_linear_within_quantization_bound(k, n, rows, use_kernel):
    """In the basis the layer quantizes in (x' = x R, W' = W R per 64-feature block when rotated; R orthogonal, so
    x' W'^T = x W^T): |y - x W^T - b| <= sum_i |x'_i| e_w + e_x |W'_ji| + e_x e_w, with e_w = s_j / 2 (weight half
    step of output channel j) and e_x = r / 127 / 2 (activation half step: the row's max |x'| r over 127 levels
    each side), plus fp32 rounding."""
    w, b = _weights(k, n, k + n)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)) * torch.linspace(0.1, 10, rows)[:, None]
    layer = Int8Linear.from_float(w, b, use_kernel=use_kernel)
    assert layer.rotated == (k % 64 == 0)
    y = layer(x)
    ref = x.double() @ w.double().t() + b.double()
    rot = _hadamard_rotation(k) if layer.rotated else torch.eye(k, dtype=torch.float64)
    xr, wr = x.double() @ rot, w.double() @ rot
    _, scale = quantize_per_channel(wr)
    e_w = scale.double()[None, :] / 2  # [1, n]
    e_x = xr.abs().amax(1, keepdim=True) / ACTIVATION_LEVELS / 2  # [rows, 1]
    bound = xr.abs().sum(1, keepdim=True) * e_w + e_x * wr.abs().sum(1)[None, :] + k * e_x * e_w
    err = (y.double() - ref).abs()
    assert (err <= bound * 1.001 + 1e-4 * ref.abs() + 1e-5).all(), float((err / bound).max())
    # ... and the bound is not vacuous: the typical error is far below the output's scale.
    assert err.mean() < 0.02 * ref.abs().mean()


@pytest.mark.parametrize("use_kernel", IMPLS)
def test_rotation_cuts_the_error_of_outlier_features(use_kernel):
    """Rows with a few features 30x the rest (as LLM activations have): rotating the 64-blocks first spreads them,
    so the 8-bit per-row range fits the other features better and the error drops several-fold."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(256, 576, generator=g) * 0.05
    x = torch.randn(32, 576, generator=g)
    x[:, [7, 300, 301]] *= 30.0
    ref = x.double() @ w.double().t()
    errors = {}
    for rotate in (False, True):
        y = Int8Linear.from_float(w, rotate=rotate, use_kernel=use_kernel)(x)
        errors[rotate] = float((y.double() - ref).pow(2).mean().sqrt())
    assert errors[True] < errors[False] / 3, errors


def _kernels():
    kernels = Int8Linear.from_float(torch.randn(8, 64)).kernels
    if kernels is None:
        pytest.skip("no C++ kernels")
    return kernels


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_quantization_matches_the_torch_reference(dtype):
    kernels = _kernels()
    x = (torch.randn(11, 192) * torch.linspace(0.01, 100, 11)[:, None]).to(dtype)
    x[3] = 0.0
    x[5, 7] = float("inf")
    x[6, 9] = float("nan")
    for signs, k in ((rotation_signs(), 192), (None, 40)):
        xi = x[:, :k]
        q, scale = kernels.int8_quantize_rows(xi, signs)
        want_q, want_scale = quantize_rows(xi, rotate=signs is not None)
        xf = xi.double() @ _hadamard_rotation(k) if signs is not None else xi.double()
        assert torch.allclose(want_scale.double()[[0, 1, 2, 4, 7]], xf.abs().amax(1)[[0, 1, 2, 4, 7]] / 127, rtol=1e-6)
        # the FWHT and torch's matmul round differently: a code may sit one step off at a rounding boundary
        assert (q.int() - want_q.int()).abs().max() <= 1 and (q != want_q).float().mean() < 0.01
        finite = torch.isfinite(want_scale)
        assert torch.allclose(scale[finite], want_scale[finite], rtol=1e-6)
        assert scale[3] == 0 and not q[3].any()  # an all-zero row
        assert scale[5].isnan() and want_scale[5].isnan()  # inf and nan must not pass as numbers
        assert scale[6].isnan() and want_scale[6].isnan()
        assert q.abs().max() <= 127
    # strided rows (a view into a wider tensor) are read in place
    wide = torch.randn(5, 256).to(dtype)
    q1, s1 = kernels.int8_quantize_rows(wide[:, :192], rotation_signs())
    q2, s2 = kernels.int8_quantize_rows(wide[:, :192].contiguous(), rotation_signs())
    assert torch.equal(q1, q2) and torch.equal(s1, s2)


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k,n", [(7, 3), (40, 24), (64, 96), (576, 200), (1540, 33)])
def test_kernel_is_exact_integer_arithmetic(k, n, out_dtype):
    """The GEMV (1 row) and the tiled GEMM (full tiles and tails) against the int64 reference of the same codes:
    sum_k q codes, times the row and channel scales, plus bias. K not a multiple of 4 and N not of a panel pad."""
    kernels = _kernels()
    g = torch.Generator().manual_seed(k * n)
    codes = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)
    codes[0] = -127  # the extremes: pairs of 127 x 127 products must not saturate
    scale = torch.rand(n, generator=g) * 0.01
    bias = torch.randn(n, generator=g)
    for rows in (1, 5, 13, 40):
        x = torch.randn(rows, k, generator=g)
        x[0, 0] = -50.0  # this row's code -127 meets the channel of -127s
        for b in (None, bias):
            layer = Int8Linear(codes, scale, b, out_dtype=out_dtype)
            q, row_scale = kernels.int8_quantize_rows(x, None)
            ref = (q.long() @ codes.long().t()).double() * (row_scale.double()[:, None] * scale.double()[None, :])
            if b is not None:
                ref += b.double()
            y = layer(x)
            assert y.dtype == out_dtype
            tol = 1e-6 if out_dtype == torch.float32 else 4e-3
            assert torch.allclose(y.double(), ref, rtol=tol, atol=tol * ref.abs().max()), (rows, b is None)


def test_native_and_kernel_agree_bitwise_without_rotation():
    """Without the rotation (and a bias) both paths quantize with the same fp32 operations and sum exactly, so they
    agree to the bit: forward_native is the kernel's reference."""
    _kernels()
    w, b = _weights(200, 77, 9)
    x = torch.randn(6, 200) * 3
    kernel = Int8Linear.from_float(w, rotate=False)
    native = Int8Linear.from_float(w, rotate=False, use_kernel=False)
    assert kernel.impl == "cpu" and native.impl == "native"
    assert torch.equal(kernel(x), native(x))
    # with a bias the kernel adds it in a fused multiply-add (one rounding), torch in two
    kernel, native = Int8Linear.from_float(w, b, rotate=False), Int8Linear.from_float(w, b, False, use_kernel=False)
    assert torch.allclose(kernel(x), native(x), rtol=1e-6, atol=1e-6)


def test_packed_codes_round_trip_and_minus_128_is_refused():
    codes = torch.randint(-127, 128, (70, 45), dtype=torch.int8)
    layer = Int8Linear(codes, torch.rand(70))
    got, _, _ = layer.unpack()
    assert torch.equal(got, codes)
    codes[3, 4] = -128
    with pytest.raises(ValueError, match="-127, 127"):
        Int8Linear(codes, torch.rand(70))


@pytest.mark.parametrize("use_kernel", IMPLS)
def test_rows_do_not_depend_on_their_batch(use_kernel):
    """Per-token activation quantization: a row's output is bitwise the same alone or among others."""
    w, b = _weights(576, 960, 1)
    layer = Int8Linear.from_float(w, b, use_kernel=use_kernel)
    x = torch.randn(27, 576)
    x[4] *= 100.0  # an outlier token must not change the others' quantization
    y = layer(x)
    for i in (0, 4, 8, 26):
        assert torch.equal(layer(x[i : i + 1]), y[i : i + 1])
    # row tiles of other sizes (27 rows: 9 + 9 + 9 on AVX-512; 13: 7 + 6)
    for lo, hi in ((2, 6), (2, 15), (0, 13)):
        assert torch.equal(layer(x[lo:hi]), y[lo:hi])


def test_dequantize_returns_the_weight_in_the_input_basis():
    w, _ = _weights(576, 96, 5)
    layer = Int8Linear.from_float(w)
    _, scale = quantize_per_channel(w.double() @ _hadamard_rotation(576))
    # per row, the rotated error is within half a step per element; the rotation keeps the row's norm
    row_err = (layer.dequantize().double() - w.double()).norm(dim=1)
    assert (row_err <= scale.double() / 2 * 576**0.5 + 1e-5).all()


def test_given_codes_are_kept_exactly_and_dtype_follows_input():
    codes = torch.randint(-127, 128, (96, 64), dtype=torch.int8)
    scale = torch.rand(96) * 0.01 + 1e-3
    layer = Int8Linear(codes, scale)
    got_codes, got_scale, bias = layer.unpack()
    assert torch.equal(got_codes, codes) and torch.allclose(got_scale, scale) and bias is None
    x = torch.randn(5, 64)
    assert layer(x.bfloat16()).dtype == torch.bfloat16
    y = layer(x)
    assert (layer(x.bfloat16()).float() - y).abs().max() <= 0.03 * y.abs().max()  # bf16 input rounding
    with pytest.raises(ValueError, match="int8 codes"):
        Int8Linear(codes.float(), scale)


def test_quantize_linears_replaces_every_linear_and_a_tied_head_gets_its_own_copy():
    model = torch.nn.Module()
    model.embed = torch.nn.Embedding(100, 64)
    model.proj = Linear(64, 32, bias=True)
    model.lm_head = Linear(64, 100)
    with torch.no_grad():
        model.proj.weight.normal_()
        model.proj.bias.normal_()
    model.lm_head.weight = model.embed.weight  # tied
    before = model.embed.weight.detach().clone()
    assert quantize_linears(model, "int8") == 2
    assert isinstance(model.proj, Int8Linear) and isinstance(model.lm_head, Int8Linear)
    assert torch.equal(model.embed.weight, before)  # the embedding stays a float gather
    x = torch.randn(3, 64)
    assert torch.allclose(model.lm_head(x), x @ before.t(), atol=0.05 * (x @ before.t()).abs().max())
    # the float embedding, then per output channel (padded to whole panels of at most 32 channels): int8 codes,
    # fp32 scale, int32 column sum (+ fp32 bias)
    assert model_weight_bytes(model) == 100 * 64 * 4 + model.proj.weight_bytes() + model.lm_head.weight_bytes()
    assert 32 * (64 + 8 + 4) <= model.proj.weight_bytes() <= 32 * (64 + 8 + 4) + 31 * (64 + 8)
    assert 100 * (64 + 8) <= model.lm_head.weight_bytes() <= 100 * (64 + 8) + 31 * (64 + 8)
    with pytest.raises(ValueError, match="unknown quantization"):
        quantize_linears(model, "int3")


def test_big_inputs_equal_row_by_row():
    w = torch.randn(1 << 14, 64) * 0.05  # 16384 outputs: row blocks and tiles
    layer = Int8Linear.from_float(w)
    x = torch.randn(150, 64)
    y = layer(x)
    assert torch.equal(y[64:128], layer(x[64:128])) and torch.equal(y[140:], layer(x[140:]))


@pytest.mark.parametrize("k,n", [(7, 3), (40, 24), (576, 200), (1540, 33)])
def test_amx_tiles_give_the_vectors_bits(k, n):
    """Where the CPU has AMX-INT8, batched rows run on tiles (tdpbusd) with the vectors' epilogue: integer sums are
    exact, so every row equals the vector GEMM's and the batch-1 GEMV's bit for bit (full tile steps and tails in
    k, groups of 16 rows and fewer)."""
    kernels = _kernels()
    if not kernels.int8_linear_amx_active():
        pytest.skip("no AMX-INT8 on this CPU (or Linux refused the tile registers)")
    g = torch.Generator().manual_seed(k + n)
    layer = Int8Linear(torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g), torch.rand(n, generator=g))
    x = torch.randn(100, k, generator=g)
    alone = torch.cat([layer(x[i : i + 1]) for i in range(len(x))])
    for rows in (2, 5, 16, 17, 40, 100):
        tiles = layer(x[:rows])
        was = kernels.linear_amx_set_enabled(False)
        try:
            vectors = layer(x[:rows])
        finally:
            kernels.linear_amx_set_enabled(was)
        assert torch.equal(tiles, vectors) and torch.equal(tiles, alone[:rows]), rows

"""The int4 linear layer: the packed layout round trip, Q4_1 quantization of float weights, the kernel against the
torch path, and how `quantize_linears` chooses between stored 4-bit blocks, int8 and Q4_1 quantization."""

from __future__ import annotations

import pytest
import torch

from kvserve.layers.linear import Linear
from kvserve.layers.quant.apply import model_weight_bytes, quantize_linears
from kvserve.layers.quant.int4_linear import (
    Int4Linear,
    pack_int4_weight,
    quantize_q4_1,
    unpack_int4_weight,
)
from kvserve.layers.quant.int8_linear import Int8Linear
from kvserve.layers.vocab_embedding import ParallelLMHead

IMPLS = [pytest.param(True, id="kernel"), pytest.param(False, id="native")]


def _blocks(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    d = (torch.rand(n, k // 32, generator=g) * 0.01).half().float()
    m = (torch.randn(n, k // 32, generator=g) * 0.05).half().float()
    return codes, d, m


@pytest.mark.parametrize("n,k", [(1, 32), (16, 64), (37, 576)])
def test_packed_layout_round_trips(n, k):
    codes, d, m = _blocks(n, k, n + k)
    packed = pack_int4_weight(codes, d, m)
    assert packed.shape == (-(-n // 16), k // 32, 320) and packed.dtype == torch.uint8
    got = unpack_int4_weight(packed, n)
    assert all(torch.equal(a, b) for a, b in zip(got, (codes, d, m), strict=True))
    # the documented byte order: step j of block b, byte 4 c + i: codes k = 8 j + i (low) and 8 j + 4 + i (high)
    c, b, j, i = min(n - 1, 5), k // 32 - 1, 2, 3
    byte = int(packed[0, b, 64 * j + 4 * c + i])
    assert byte & 0x0F == codes[c, 32 * b + 8 * j + i] and byte >> 4 == codes[c, 32 * b + 8 * j + 4 + i]
    assert torch.equal(packed[0, b, 256:288].view(torch.float16).float()[: min(n, 16)], d[:16, b])


def test_q4_1_quantization_is_within_half_a_step():
    w = torch.randn(64, 576) * 0.05
    w[0, :32] = 0.3  # a constant block: d = 0
    codes, d, m = quantize_q4_1(w)
    assert codes.max() <= 15 and torch.equal(d.half().float(), d) and torch.equal(m.half().float(), m)
    deq = (d[..., None] * codes.float().view(64, 18, 32) + m[..., None]).view(64, 576)
    step = d.repeat_interleave(32, dim=1)
    # half a step, plus the fp16 rounding of m (and of d, times up to 15 codes)
    slack = (w.abs() * 2e-3) + 15 * step * 1e-3
    assert ((deq - w).abs() <= step / 2 + slack).all()
    assert (deq[0, :32] - 0.3).abs().max() < 1e-3
    layer = Int4Linear.from_float(w)
    assert torch.equal(layer.dequantize(), deq)


@pytest.mark.parametrize("use_kernel", IMPLS)
@pytest.mark.parametrize("rows", [1, 4, 19])
def test_layer_is_close_to_the_float_product_of_its_weight(rows, use_kernel):
    """The activations' 8-bit rounding per block of 32 is the only error left against x @ dequantize().T."""
    codes, d, m = _blocks(96, 576, rows)
    bias = torch.randn(96)
    layer = Int4Linear.from_blocks(codes, d, m, bias, use_kernel=use_kernel)
    assert layer.impl == ("cpu" if use_kernel and layer.kernels is not None else "native")
    x = torch.randn(rows, 576)
    ref = x.double() @ layer.dequantize().double().t() + bias.double()
    y = layer(x)
    assert y.dtype == torch.float32 and y.shape == (rows, 96)
    # |error| <= sum_k |w_k| * (amax_block / 127 / 2)
    step = x.abs().view(rows, 18, 32).amax(-1).repeat_interleave(32, dim=1).double() / 127 / 2
    bound = step @ layer.dequantize().double().abs().t()
    assert ((y.double() - ref).abs() <= bound * 1.001 + 1e-4).all()
    assert layer(x.bfloat16()).dtype == torch.bfloat16


def test_kernel_and_native_paths_agree():
    codes, d, m = _blocks(200, 1536, 1)
    kernel = Int4Linear.from_blocks(codes, d, m)
    if kernel.kernels is None:
        pytest.skip("no C++ kernels")
    native = Int4Linear.from_blocks(codes, d, m, use_kernel=False)
    x = torch.randn(7, 1536)
    assert torch.allclose(kernel(x), native(x), rtol=1e-5, atol=1e-5)
    assert kernel.fused_spec() is not None and native.fused_spec() is None


def test_invalid_blocks_are_refused():
    codes, d, m = _blocks(16, 64, 0)
    with pytest.raises(ValueError, match="0..15"):
        Int4Linear(codes.clone().fill_(16), d, m)
    with pytest.raises(ValueError, match="fp16"):
        Int4Linear(codes, d + 1e-9, m)
    with pytest.raises(ValueError, match="multiple of 32"):
        Int4Linear(codes[:, :48], d[:, :1], m[:, :1])


def _model() -> torch.nn.Module:
    model = torch.nn.Module()
    model.embed = torch.nn.Embedding(100, 64)
    model.layer = torch.nn.Module()
    model.layer.qkv_proj = Linear(64, 96, bias=False)
    model.layer.down_proj = Linear(64, 32, bias=False)
    model.lm_head = ParallelLMHead(64, 100)
    with torch.no_grad():
        for lin in (model.layer.qkv_proj, model.layer.down_proj):
            lin.weight.normal_()
    return model


def test_float_checkpoint_layers_go_to_q4_1_and_the_head_to_int8():
    model = _model()
    w = model.layer.qkv_proj.weight.detach().clone()
    assert quantize_linears(model, "int4") == 3
    assert isinstance(model.layer.qkv_proj, Int4Linear) and isinstance(model.layer.down_proj, Int4Linear)
    assert isinstance(model.lm_head, Int8Linear) and model.lm_head.out_dtype == torch.float32
    assert torch.equal(model.layer.qkv_proj.dequantize(), Int4Linear.from_float(w).dequantize())
    assert model_weight_bytes(model) == (
        100 * 64 * 4
        + model.layer.qkv_proj.weight_bytes()
        + model.layer.down_proj.weight_bytes()
        + model.lm_head.weight_bytes()
    )
    assert model.layer.qkv_proj.weight_bytes() == 6 * 2 * 320  # 6 panels x 2 blocks


def test_gguf_blocks_are_kept_where_every_source_is_4_bit():
    """qkv from its q/k/v blocks, stacked by rows, exactly; down_proj's source is not 4-bit (e.g. Q6_K): int8."""
    model = _model()
    q, k, v = _blocks(64, 64, 1), _blocks(16, 64, 2), _blocks(16, 64, 3)
    blocks = {"layer.q_proj.weight": q, "layer.k_proj.weight": k, "layer.v_proj.weight": v}
    quantize_linears(model, "int4", blocks)
    assert isinstance(model.layer.qkv_proj, Int4Linear)
    got = model.layer.qkv_proj.unpack()
    for i in range(3):
        assert torch.equal(got[i], torch.cat([q[i], k[i], v[i]]))
    assert isinstance(model.layer.down_proj, Int8Linear) and isinstance(model.lm_head, Int8Linear)
    with pytest.raises(ValueError, match="4-bit blocks of shape"):
        quantize_linears(_model(), "int4", {**blocks, "layer.v_proj.weight": _blocks(32, 64, 3)})

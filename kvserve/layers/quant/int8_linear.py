"""W8A8 dynamic int8 linear layer on the CPU, through fbgemm's quantized linear (torch.ops.quantized).

Weights: int8, symmetric, one fp32 scale per output channel, prepacked once by fbgemm (the packed copy is the
only one kept). Activations: quantized per token at run time. fbgemm's dynamic op quantizes its whole input with
one (per-tensor) range, which would make a row's result depend on the other rows of the batch (another request,
another prefill chunk). So each row is divided by its own absolute maximum first; every row then lies in [-1, 1],
and the input is quantized with that fixed range (`activation_quant`: 8 bits with VNNI, 7 without). The int32
accumulation is exact, so a row's output depends only on that row: batch composition, chunked prefill and
prefix caching see the same numbers. The output is multiplied back by the row maxima.

Why fbgemm: measured per shape and batch size against oneDNN's int8 qlinear, torch._int_mm, the weight-only
torch._weight_int8pack_mm, fp32 and packed bf16 (docs/benchmarks.md), it was fastest for every layer of the
model at 1-256 rows except the vocab-wide LM head at 256 rows.
"""

from __future__ import annotations

import functools
import warnings

import torch
from torch import nn

from kvserve.platform import cpu_info


@functools.cache
def activation_quant() -> tuple[float, int]:
    """(scale, zero point) of the input quantization after per-row normalisation to [-1, 1].

    With VNNI (vpdpbusd) fbgemm sums uint8 x int8 products exactly: [-1, 1] onto uint8 [0, 255]. Without it, its
    kernels pair products into saturating int16 sums (vpmaddubsw: 2 x 255 x 127 overflows), so the input keeps
    7 bits, [-1, 1] onto [1, 127], as fbgemm's own `reduce_range` does."""
    if cpu_info().has("avx512_vnni"):
        return 1.0 / 127.5, 128
    return 1.0 / 63.0, 64


_CHUNK_OUTPUT_ELEMENTS = 1 << 20  # fp32 outputs of at most 4 MiB per fbgemm call


def quantize_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per output channel: weight [out, in] (float) -> (codes int8 [out, in], scale fp32 [out]),
    with weight ~= codes * scale[:, None] within scale / 2. An all-zero row gets scale 1 (codes 0)."""
    w = weight.detach().float()
    amax = w.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    codes = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return codes, scale


def int8_linear_available() -> bool:
    return "fbgemm" in torch.backends.quantized.supported_engines


class Int8Linear(nn.Module):
    """y = x W^T (+ b) with W = codes * scale (per output channel). Inputs of any float dtype; the output has
    the input's dtype. `from_codes` keeps the given codes exactly (a GGUF's, or quantize_per_channel's)."""

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        if codes.dtype != torch.int8 or codes.dim() != 2 or scale.shape != (codes.shape[0],):
            raise ValueError(
                f"expected int8 codes [out, in] and scale [out], got {codes.dtype} "
                f"{tuple(codes.shape)} and {tuple(scale.shape)}"
            )
        self.out_features, self.in_features = codes.shape
        zero_points = torch.zeros(self.out_features, dtype=torch.long)
        with warnings.catch_warnings():  # quantized tensors are deprecated; fbgemm's prepack still takes them
            warnings.simplefilter("ignore")
            qweight = torch._make_per_channel_quantized_tensor(codes.contiguous(), scale.double(), zero_points, 0)
        # The bias is added after the per-row rescale (the op would add it before), so fbgemm does not get it.
        self.bias = None if bias is None else bias.detach().float().clone()  # [out]
        self._packed = torch.ops.quantized.linear_prepack(qweight, None)

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None = None) -> Int8Linear:
        codes, scale = quantize_per_channel(weight)
        return cls(codes, scale, bias)

    def unpack(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(codes int8 [out, in], scale fp32 [out], bias) as held by the packed weight (for tests and reports)."""
        qweight, _ = torch.ops.quantized.linear_unpack(self._packed)
        return qweight.int_repr(), qweight.q_per_channel_scales().float(), self.bias

    def weight_bytes(self) -> int:
        """Bytes the packed weight holds: the int8 codes, plus per channel an fp32 scale and an int32 column sum."""
        return self.out_features * (self.in_features + 8) + (0 if self.bias is None else 4 * self.out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        # fbgemm slows down once its fp32 output outgrows the caches (the LM head at 256 rows: 49 ms in one call,
        # 25 ms in four); rows are independent, so big inputs go through in chunks.
        chunk = max(64, _CHUNK_OUTPUT_ELEMENTS // self.out_features)
        if xf.shape[0] > chunk:
            y = torch.cat([self._matmul(part) for part in xf.split(chunk)])
        else:
            y = self._matmul(xf)
        if self.bias is not None:
            y = y.add_(self.bias)
        return y.to(x.dtype)

    def _matmul(self, xf: torch.Tensor) -> torch.Tensor:
        row_max = torch.linalg.vector_norm(xf, float("inf"), dim=1, keepdim=True).clamp_min_(1e-30)  # [T, 1]
        scale, zero_point = activation_quant()
        y = torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32(
            xf / row_max, scale, zero_point, self._packed
        )
        return y.mul_(row_max)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, bias={self.bias is not None}, int8 fbgemm"

"""W8A8 dynamic int8 linear layer on the CPU, through fbgemm's quantized linear (torch.ops.quantized).

Weights: int8, symmetric, one fp32 scale per output channel, prepacked once by fbgemm (the packed copy is the
only one kept). Activations: quantized per token at run time. fbgemm's dynamic op quantizes its whole input with
one (per-tensor) range, which would make a row's result depend on the other rows of the batch (another request,
another prefill chunk). So each row is divided by its own absolute maximum first; every row then lies in [-1, 1],
and the input is quantized with that fixed range (`activation_quant`: 8 bits with VNNI, 7 without). The int32
accumulation is exact, so a row's output depends only on that row: batch composition, chunked prefill and
prefix caching see the same numbers. The output is multiplied back by the row maxima.

Rotation: an LLM's activations carry a few outlier features (10-25x a row's RMS here), and one 8-bit range per
row then leaves the other features only a few levels; on SmolLM2 that cost +4.2% perplexity over fp32 (+16% where
fbgemm has no VNNI and quantizes to 7 bits), and +0.5% (+1.4%) with the rotation. Where in_features is a multiple
of 64, each block of 64 input features is rotated by R = diag(signs) H_64 / 8 (a Hadamard matrix with fixed random
signs; orthogonal): x W^T = (x R)(W R)^T. The weight is rotated once before it is quantized; the input is rotated
per row at run time (a fast Walsh-Hadamard transform, in the same pass as the division by the row maximum).
Rotated rows have their outliers spread over the block, so the 8-bit range fits them far better
(docs/benchmarks.md has the figures).

Why fbgemm: measured per shape and batch size against oneDNN's int8 qlinear, torch._int_mm, the weight-only
torch._weight_int8pack_mm, fp32 and packed bf16 (docs/benchmarks.md), it was fastest for every layer of the
model at 1-256 rows except the vocab-wide LM head at 256 rows.
"""

from __future__ import annotations

import functools
import warnings

import torch

from kvserve.layers.custom_op import CustomOp
from kvserve.platform import cpu_info

ROTATION_BLOCK = 64


@functools.cache
def activation_quant() -> tuple[float, int]:
    """(scale, zero point) of the input quantization after per-row normalisation to [-1, 1].

    With VNNI (vpdpbusd) fbgemm sums uint8 x int8 products exactly: [-1, 1] onto uint8 [0, 255]. Without it, its
    kernels pair products into saturating int16 sums (vpmaddubsw: 2 x 255 x 127 overflows), so the input keeps
    7 bits, [-1, 1] onto [1, 127], as fbgemm's own `reduce_range` does."""
    if cpu_info().has("avx512_vnni"):
        return 1.0 / 127.5, 128
    return 1.0 / 63.0, 64


@functools.cache
def rotation_signs() -> torch.Tensor:
    """The fixed +-1 signs [64] (fp32) of the block rotation; the same on every machine and in every run."""
    g = torch.Generator().manual_seed(20261123)
    return torch.randint(0, 2, (ROTATION_BLOCK,), generator=g).float().mul_(2).sub_(1)


@functools.cache
def rotation_matrix() -> torch.Tensor:
    """R = diag(signs) H_64 / 8 [64, 64] fp32: orthogonal, so R R^T = I. H_64 in Sylvester's (natural) order."""
    h = torch.ones(1, 1)
    while h.shape[0] < ROTATION_BLOCK:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)])
    return rotation_signs()[:, None] * h / ROTATION_BLOCK**0.5


def rotate_blocks(t: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """t [..., K] (K a multiple of 64) -> each block of 64 features times R (or R^T), in fp32."""
    r = rotation_matrix()
    shape = t.shape
    blocks = t.float().reshape(-1, ROTATION_BLOCK)
    return (blocks @ (r.t() if inverse else r)).reshape(shape)


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


class Int8Linear(CustomOp):
    """y = x W^T (+ b). Inputs of any float dtype; the output has `out_dtype`, or the input's dtype if None.

    Holds W as int8 codes with one scale per output channel: codes * scale = W R (blocks rotated, see the module
    docstring) when `rotated`, else W. `from_float` rotates where it can; the constructor keeps the given codes
    exactly."""

    def __init__(
        self,
        codes: torch.Tensor,
        scale: torch.Tensor,
        bias: torch.Tensor | None = None,
        rotated: bool = False,
        use_kernel: bool = True,
        out_dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__("cpu", use_kernel)
        self.out_dtype = out_dtype
        if codes.dtype != torch.int8 or codes.dim() != 2 or scale.shape != (codes.shape[0],):
            raise ValueError(
                f"expected int8 codes [out, in] and scale [out], got {codes.dtype} "
                f"{tuple(codes.shape)} and {tuple(scale.shape)}"
            )
        self.out_features, self.in_features = codes.shape
        if rotated and self.in_features % ROTATION_BLOCK:
            raise ValueError(f"rotated codes need in_features divisible by {ROTATION_BLOCK}, got {self.in_features}")
        self.rotated = rotated
        self._signs = rotation_signs() if rotated else None  # [64]
        zero_points = torch.zeros(self.out_features, dtype=torch.long)
        with warnings.catch_warnings():  # quantized tensors are deprecated; fbgemm's prepack still takes them
            warnings.simplefilter("ignore")
            qweight = torch._make_per_channel_quantized_tensor(codes.contiguous(), scale.double(), zero_points, 0)
        # The bias is added after the per-row rescale (the op would add it before), so fbgemm does not get it.
        self.bias = None if bias is None else bias.detach().float().clone()  # [out]
        self._packed = torch.ops.quantized.linear_prepack(qweight, None)

    @classmethod
    def from_float(
        cls,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        rotate: bool = True,
        use_kernel: bool = True,
        out_dtype: torch.dtype | None = None,
    ) -> Int8Linear:
        """Quantize a float weight [out, in]; rotated when `rotate` and in_features is a multiple of 64."""
        rotated = rotate and weight.shape[1] % ROTATION_BLOCK == 0
        codes, scale = quantize_per_channel(rotate_blocks(weight) if rotated else weight)
        return cls(codes, scale, bias, rotated, use_kernel, out_dtype)

    def unpack(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(codes int8 [out, in], scale fp32 [out], bias) as held by the packed weight (rotated if `rotated`)."""
        qweight, _ = torch.ops.quantized.linear_unpack(self._packed)
        return qweight.int_repr(), qweight.q_per_channel_scales().float(), self.bias

    def dequantize(self) -> torch.Tensor:
        """The weight this layer multiplies by, [out, in] fp32, in the input's (unrotated) basis."""
        codes, scale, _ = self.unpack()
        w = codes.float() * scale[:, None]
        return rotate_blocks(w, inverse=True) if self.rotated else w

    def weight_bytes(self) -> int:
        """Bytes the packed weight holds: the int8 codes, plus per channel an fp32 scale and an int32 column sum."""
        return self.out_features * (self.in_features + 8) + (0 if self.bias is None else 4 * self.out_features)

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.reshape(-1, self.in_features).float()
        if self.rotated:
            xf = rotate_blocks(xf)
        row_max = xf.abs().amax(1, keepdim=True)  # [T, 1]
        return self._int8_matmul(xf / row_max.clamp_min(1e-30), row_max, x)

    def forward_cpu(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)
        if x2.dtype not in (torch.float32, torch.bfloat16) or x2.stride(1) != 1:
            return self.forward_native(x)
        normalized, row_max = self.kernels.rotate_normalize(x2, self._signs)
        return self._int8_matmul(normalized, row_max, x)

    def _int8_matmul(self, normalized: torch.Tensor, row_max: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """normalized [T, in] fp32 in [-1, 1], row_max [T, 1] -> (normalized * row_max) W^T (+ b), shaped like x,
        in out_dtype (or x's dtype)."""
        rows = normalized.shape[0]
        dtype = self.out_dtype or x.dtype
        # fbgemm slows down once its fp32 output outgrows the caches (the LM head at 256 rows: 49 ms in one call,
        # 25 ms in four); rows are independent, so big inputs go through in chunks.
        chunk = max(64, _CHUNK_OUTPUT_ELEMENTS // self.out_features)
        if rows <= chunk:
            out = self._finish(self._fbgemm(normalized), row_max, dtype)
        else:
            out = torch.empty(rows, self.out_features, dtype=dtype)
            for start in range(0, rows, chunk):
                end = min(start + chunk, rows)
                self._finish(self._fbgemm(normalized[start:end]), row_max[start:end], dtype, out[start:end])
        return out.view(*x.shape[:-1], self.out_features)

    def _fbgemm(self, normalized: torch.Tensor) -> torch.Tensor:
        scale, zero_point = activation_quant()
        return torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32(
            normalized, scale, zero_point, self._packed
        )

    def _finish(
        self, y: torch.Tensor, row_max: torch.Tensor, dtype: torch.dtype, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """y * row_max (+ bias) in `dtype`, in one pass (in place when the output is fp32)."""
        if out is None:
            out = y if dtype == torch.float32 else torch.empty(y.shape, dtype=dtype)
        if self.bias is None:
            return torch.mul(y, row_max, out=out)
        return torch.addcmul(self.bias, y, row_max, out=out)

    def extra_repr(self) -> str:
        return (
            f"in={self.in_features}, out={self.out_features}, bias={self.bias is not None}, "
            f"rotated={self.rotated}, out_dtype={self.out_dtype}, int8 fbgemm, impl={self.impl}"
        )

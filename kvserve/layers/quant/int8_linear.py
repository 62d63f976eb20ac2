"""W8A8 dynamic int8 linear layer on the CPU.

Weights: int8 codes in [-127, 127], symmetric, one fp32 scale per output channel, held once (in the C++ kernel's
panel layout when the kernels are loaded). Activations: quantized per token at run time, each row with its own
range: q = round(x * 127 / max|x|). The int32 dot products are exact, so a row's output depends only on that row:
batch composition, chunked prefill and prefix caching see the same numbers. The output is
(q . codes) * (max|x| / 127) * scale (+ bias).

Rotation: an LLM's activations carry a few outlier features (10-25x a row's RMS here), and one 8-bit range per
row then leaves the other features only a few levels; on SmolLM2 that cost +4.2% perplexity over fp32, and +0.5%
with the rotation. Where in_features is a multiple of 64, each block of 64 input features is rotated by
R = diag(signs) H_64 / 8 (a Hadamard matrix with fixed random signs; orthogonal): x W^T = (x R)(W R)^T. The weight
is rotated once before it is quantized; the input is rotated per row at run time (a fast Walsh-Hadamard transform,
in the same pass as its quantization). Rotated rows have their outliers spread over the block, so the 8-bit range
fits them far better (docs/benchmarks.md has the figures).

Kernels: kvserve's own (kernels/csrc/int8_linear.cpp: quantization, int8 GEMM/GEMV with VNNI or AVX2, rescale in
one call; the fused decoder layer calls it too). torch's fbgemm dynamic quantized linear was the first choice and
is measured against it in docs/benchmarks.md: its separate passes cost more than the weights' streaming at batch 1,
and its opaque packed weight cannot be called from the fused layer. Without the kernels, `forward_native` does the
same arithmetic in torch (exact int32 products through fp32 matmuls of short k-chunks).
"""

from __future__ import annotations

import functools

import torch

from kvserve.layers.custom_op import CustomOp

ROTATION_BLOCK = 64


ACTIVATION_LEVELS = 127  # q = round(x * 127 / max|x|): 255 levels, symmetric


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


def rotate_rows(x: torch.Tensor) -> torch.Tensor:
    """x [T, K] fp32 (K a multiple of 64) -> each block of 64 features times R, as a fast Walsh-Hadamard transform
    (the kernel's method, quant.cpp). Elementwise butterflies give every row the same bits whatever the number of
    rows, where a matmul's kernel (and so its rounding) follows the shape (MKL's, with the AVX2 cap on an Intel
    CPU)."""
    shape = x.shape
    b = (x.reshape(-1, ROTATION_BLOCK) * rotation_signs()).reshape(-1, ROTATION_BLOCK)
    h = 1
    while h < ROTATION_BLOCK:
        pairs = b.view(-1, ROTATION_BLOCK // (2 * h), 2, h)
        b = torch.stack((pairs[:, :, 0] + pairs[:, :, 1], pairs[:, :, 0] - pairs[:, :, 1]), dim=2)
        b = b.reshape(-1, ROTATION_BLOCK)
        h *= 2
    return (b * (1.0 / ROTATION_BLOCK**0.5)).reshape(shape)


def quantize_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per output channel: weight [out, in] (float) -> (codes int8 [out, in], scale fp32 [out]),
    with weight ~= codes * scale[:, None] within scale / 2. An all-zero row gets scale 1 (codes 0)."""
    w = weight.detach().float()
    amax = w.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    codes = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return codes, scale


# An fp32 matmul of int8 values is exact while every partial sum stays below 2^24: 1024 products of at most
# 127 * 127 do.
_EXACT_FP32_TERMS = 1024


def int8_dot(q: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """q [T, K] int8 @ codes [N, K]^T -> [T, N] int32, exactly, on every CPU. (torch._int_mm goes through oneDNN,
    whose kernels without VNNI pair products into saturating int16 sums.)"""
    acc = torch.zeros(q.shape[0], codes.shape[0], dtype=torch.int32)
    for k0 in range(0, q.shape[1], _EXACT_FP32_TERMS):
        part = q[:, k0 : k0 + _EXACT_FP32_TERMS].float() @ codes[:, k0 : k0 + _EXACT_FP32_TERMS].float().t()
        acc += part.to(torch.int32)
    return acc


def quantize_rows(x: torch.Tensor, rotate: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] float -> (q [T, K] int8, scale [T] fp32) with q * scale ~= x (rotated per 64-block when `rotate`),
    as the kernel's quantization does: an all-zero row gives zeros and scale 0, a row with inf/nan scale nan."""
    xf = x.float()
    if rotate:
        xf = rotate_rows(xf)
    row_max = xf.abs().amax(1)  # [T]
    finite = torch.isfinite(row_max)
    inv = torch.where(finite & (row_max > 0), ACTIVATION_LEVELS / row_max, torch.zeros_like(row_max))
    q = torch.round(xf * inv[:, None]).nan_to_num_(0.0).to(torch.int8)
    scale = torch.where(finite, row_max / ACTIVATION_LEVELS, torch.full_like(row_max, float("nan")))
    return q, scale


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
        if codes.numel() and int(codes.min()) < -127:
            raise ValueError("int8 codes must lie in [-127, 127] (symmetric; -128 has no positive counterpart)")
        self.out_features, self.in_features = codes.shape
        if rotated and self.in_features % ROTATION_BLOCK:
            raise ValueError(f"rotated codes need in_features divisible by {ROTATION_BLOCK}, got {self.in_features}")
        self.rotated = rotated
        self._signs = rotation_signs() if rotated else None  # [64]
        self.bias = None if bias is None else bias.detach().float().clone()  # [out]
        scale = scale.detach().float()
        # One form of the weight: the kernel's panels (with column sums and the scale padded to whole panels), or
        # the plain codes for forward_native.
        self._codes: torch.Tensor | None = None
        self._panels: torch.Tensor | None = None
        self._colsum: torch.Tensor | None = None
        if self.kernels is not None:
            self._panels, self._colsum = self.kernels.pack_int8_weight(codes.contiguous())
            self._scale = torch.zeros(self._colsum.numel())
            self._scale[: self.out_features] = scale
        else:
            self._codes = codes.contiguous().clone()
            self._scale = scale.clone()

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
        """(codes int8 [out, in], scale fp32 [out], bias) as held (rotated if `rotated`)."""
        if self._codes is not None:
            return self._codes, self._scale, self.bias
        codes = self.kernels.unpack_int8_weight(self._panels, self.out_features, self.in_features)
        return codes, self._scale[: self.out_features].clone(), self.bias

    def dequantize(self) -> torch.Tensor:
        """The weight this layer multiplies by, [out, in] fp32, in the input's (unrotated) basis."""
        codes, scale, _ = self.unpack()
        w = codes.float() * scale[:, None]
        return rotate_blocks(w, inverse=True) if self.rotated else w

    def weight_bytes(self) -> int:
        """Bytes of the weight as held: the int8 codes (padded to whole panels), the scales, column sums, bias."""
        held = [self._codes, self._panels, self._colsum, self._scale, self.bias]
        return sum(t.numel() * t.element_size() for t in held if t is not None)

    def fused_spec(self) -> list[torch.Tensor] | None:
        """This layer as the fused C++ decoder layer takes an int8 linear (decoder_layer.cpp's apply_linear), or
        None without the kernels."""
        if self._panels is None:
            return None
        spec = [self._panels, self._scale, self._colsum]
        return spec + [self._signs] if self.rotated else spec

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        codes, scale, bias = self.unpack()
        q, row_scale = quantize_rows(x.reshape(-1, self.in_features), self.rotated)
        y = int8_dot(q, codes).float() * (row_scale[:, None] * scale[None, :])
        if bias is not None:
            y = y + bias
        return y.to(self.out_dtype or x.dtype).view(*x.shape[:-1], self.out_features)

    def forward_cpu(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)
        if x2.dtype not in (torch.float32, torch.bfloat16) or x2.stride(1) != 1:
            x2 = x2.float().contiguous()
        dtype = self.out_dtype or x.dtype
        y = self.kernels.int8_linear(
            x2,
            self._panels,
            self._scale,
            self._colsum,
            self.out_features,
            self._signs,
            self.bias,
            dtype if dtype in (torch.float32, torch.bfloat16) else torch.float32,
        )
        return y.to(dtype).view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (
            f"in={self.in_features}, out={self.out_features}, bias={self.bias is not None}, "
            f"rotated={self.rotated}, out_dtype={self.out_dtype}, impl={self.impl}"
        )

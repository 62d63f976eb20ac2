"""4-bit block linear layer on the CPU (GGUF Q4_0 / Q4_1 weights kept as they are stored).

Weights: per output channel n and block b of 32 input features, codes c in 0..15, an fp16 scale d and an fp16
offset m: w[n, k] = d[n, b] * c[n, k] + m[n, b]. This is Q4_1 as GGUF stores it; Q4_0 (w = d * (q - 8)) is the
same form with c = q + 8 and m = -8 d, exactly. `Int4Linear.from_blocks` takes a GGUF tensor's own codes and
factors (no re-quantization: `dequantize()` is bitwise gguf's dequantization); `from_float` quantizes a float
weight to the Q4_1 form (asymmetric, min/max per block, factors rounded to fp16 first, as ggml does).

Activations: quantized per row and per block of 32 to int8 (as llama.cpp's Q8_1): q = round(x * 127 / amax), dx =
amax / 127, mx = dx * sum(q). The output is, with exact integer dot products per block and fp32 across blocks,
    y[r, n] = sum_b dot_b(c[n], q[r]) * d[n, b] * dx[r, b] + m[n, b] * mx[r, b]   (+ bias)
so a row's output depends only on that row. Kernel: kernels/csrc/int4_linear.cpp (VNNI / AVX-512BW / AVX2 /
generic); without it `forward_native` does the same arithmetic in torch.
"""

from __future__ import annotations

import torch

from kvserve.layers.custom_op import CustomOp

QK = 32  # input features per block
PANEL = 16  # output channels per panel of the packed layout
ACTIVATION_LEVELS = 127


def quantize_q4_1(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Float weight [N, K] (K a multiple of 32) -> (codes uint8 [N, K] in 0..15, d, m fp32 [N, K / 32], both
    fp16-representable), asymmetric per block: d = (max - min) / 15, m = min, c = round((w - m) / d). Every weight
    is then within d / 2 of d * c + m (plus the fp16 rounding of the factors)."""
    n, k = weight.shape
    if k % QK:
        raise ValueError(f"int4 needs in_features divisible by {QK}, got {k}")
    w = weight.detach().float().reshape(n, k // QK, QK)
    lo, hi = w.amin(-1), w.amax(-1)
    d = ((hi - lo) / 15).half().float()
    m = lo.half().float()
    safe = torch.where(d > 0, d, torch.ones_like(d))
    codes = torch.round((w - m[..., None]) / safe[..., None]).clamp_(0, 15).to(torch.uint8)
    return codes.reshape(n, k), d, m


def pack_int4_weight(codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """(codes uint8 [N, K] 0..15, d, m [N, K / 32]) -> packed uint8 [ceil(N / 16), K / 32, 320], the layout that
    int4_linear.cpp documents (channels past N zero). d and m are stored as fp16 (they must be representable)."""
    n, k = codes.shape
    kb = k // QK
    p = -(-n // PANEL)
    c = torch.zeros(p * PANEL, k, dtype=torch.uint8)
    c[:n] = codes
    # [P, 16 ch, KB, 4 steps, 2 halves, 4] -> [P, KB, 4 steps, 16 ch, 4]: low nibble = first half, high = second.
    c = c.view(p, PANEL, kb, 4, 2, 4).permute(0, 2, 3, 1, 4, 5)
    qs = (c[..., 0, :] | (c[..., 1, :] << 4)).reshape(p, kb, 256)
    factors = []
    for f in (d, m):
        padded = torch.zeros(p * PANEL, kb, dtype=torch.float16)
        padded[:n] = f.half()
        factors.append(padded.view(p, PANEL, kb).transpose(1, 2).contiguous().view(torch.uint8))  # [P, KB, 32]
    return torch.cat([qs, *factors], dim=2).contiguous()


def unpack_int4_weight(packed: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The inverse of pack_int4_weight: -> (codes uint8 [n, K], d, m fp32 [n, K / 32])."""
    p, kb, _ = packed.shape
    qs = packed[:, :, :256].reshape(p, kb, 4, PANEL, 4)
    c = torch.stack([qs & 0x0F, qs >> 4], dim=4)  # [P, KB, 4, 16, 2, 4]
    codes = c.permute(0, 3, 1, 2, 4, 5).reshape(p * PANEL, kb * QK)[:n].contiguous()
    d, m = (
        packed[:, :, lo : lo + 32].contiguous().view(torch.float16).transpose(1, 2).reshape(p * PANEL, kb)[:n].float()
        for lo in (256, 288)
    )
    return codes, d, m


def quantize_rows_q8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [T, K] float -> (q int8 [T, K], dx, mx fp32 [T, K / 32]) as the kernel quantizes: per block of 32,
    q = round(x * (127 / amax)) (half to even), dx = amax / 127, mx = dx * sum(q); an all-zero block gives zeros,
    a block with an inf or nan q = 0 and dx = mx = nan."""
    t, k = x.shape
    xb = x.float().reshape(t, k // QK, QK)
    finite = torch.isfinite(xb).all(-1)
    amax = torch.where(finite, xb.abs().amax(-1), torch.zeros_like(xb[..., 0]))
    ok = amax > 0
    inv = torch.where(ok, ACTIVATION_LEVELS / torch.where(ok, amax, torch.ones_like(amax)), torch.zeros_like(amax))
    q = torch.round(torch.where(ok[..., None], xb, 0.0) * inv[..., None]).to(torch.int8)
    dx = torch.where(ok, amax / ACTIVATION_LEVELS, torch.zeros_like(amax))
    mx = dx * q.sum(-1, dtype=torch.int32).float()
    nan = torch.full_like(dx, float("nan"))
    return q.reshape(t, k), torch.where(finite, dx, nan), torch.where(finite, mx, nan)


def block_dots(q: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """q int8 [T, K] x codes uint8 [N, K] -> int32 [T, N, K / 32]: the exact dot product of every block (fp32 sums
    of 32 products of at most 127 * 15 are exact)."""
    t, k = q.shape
    qb = q.float().reshape(t, k // QK, QK)
    cb = codes.float().reshape(codes.shape[0], k // QK, QK)
    return torch.einsum("tbk,nbk->tnb", qb, cb).to(torch.int32)


class Int4Linear(CustomOp):
    """y = x W^T (+ b) with W in 4-bit blocks (module docstring). Inputs of any float dtype; the output has
    `out_dtype`, or the input's dtype if None. Holds the weight once, in the kernel's packed layout."""

    def __init__(
        self,
        codes: torch.Tensor,
        d: torch.Tensor,
        m: torch.Tensor,
        bias: torch.Tensor | None = None,
        use_kernel: bool = True,
        out_dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__("cpu", use_kernel)
        self.out_features, self.in_features = codes.shape
        kb = self.in_features // QK
        if self.in_features % QK or d.shape != (self.out_features, kb) or m.shape != d.shape:
            raise ValueError(
                f"expected codes [out, in] (in a multiple of {QK}) and d, m [out, in / {QK}], got "
                f"{tuple(codes.shape)}, {tuple(d.shape)}, {tuple(m.shape)}"
            )
        if codes.dtype != torch.uint8 or (codes.numel() and int(codes.max()) > 15):
            raise ValueError("int4 codes must be uint8 in 0..15")
        for f in (d, m):
            if not torch.equal(f.float().half().float(), f.float()):
                raise ValueError("int4 block factors must be representable in fp16")
        self.out_dtype = out_dtype
        self.bias = None if bias is None else bias.detach().float().clone()  # [out]
        self._packed = pack_int4_weight(codes, d.float(), m.float())  # [P, KB, 320] uint8

    @classmethod
    def from_blocks(
        cls,
        codes: torch.Tensor,
        d: torch.Tensor,
        m: torch.Tensor,
        bias: torch.Tensor | None = None,
        use_kernel: bool = True,
        out_dtype: torch.dtype | None = None,
    ) -> Int4Linear:
        """A GGUF Q4_0 / Q4_1 tensor's own codes and factors (the constructor keeps them exactly)."""
        return cls(codes, d, m, bias, use_kernel, out_dtype)

    @classmethod
    def from_float(
        cls,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        use_kernel: bool = True,
        out_dtype: torch.dtype | None = None,
    ) -> Int4Linear:
        """Quantize a float weight [out, in] to the Q4_1 form (quantize_q4_1)."""
        return cls(*quantize_q4_1(weight), bias, use_kernel, out_dtype)

    def unpack(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(codes uint8 [out, in], d, m fp32 [out, in / 32]) as held."""
        return unpack_int4_weight(self._packed, self.out_features)

    def dequantize(self) -> torch.Tensor:
        """The weight this layer multiplies by, [out, in] fp32: d * c + m per block (for a GGUF tensor, bitwise
        what gguf.quants.dequantize gives)."""
        codes, d, m = self.unpack()
        c = codes.float().reshape(self.out_features, -1, QK)
        return (d[..., None] * c + m[..., None]).reshape(self.out_features, self.in_features)

    def weight_bytes(self) -> int:
        held = [self._packed, self.bias]
        return sum(t.numel() * t.element_size() for t in held if t is not None)

    def fused_spec(self) -> list[torch.Tensor] | None:
        """This layer as the fused C++ decoder layer takes a 4-bit linear: [packed] (uint8)."""
        return [self._packed] if self.impl == "cpu" else None

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        codes, d, m = self.unpack()
        x2 = x.reshape(-1, self.in_features)
        out = torch.empty(x2.shape[0], self.out_features)
        for r0 in range(0, x2.shape[0], 8):  # row chunks: the per-block dots are [rows, out, blocks]
            q, dx, mx = quantize_rows_q8(x2[r0 : r0 + 8])
            dots = block_dots(q, codes).float()
            terms = dots * (d[None] * dx[:, None, :]) + m[None] * mx[:, None, :]
            out[r0 : r0 + 8] = terms.sum(-1)
        if self.bias is not None:
            out = out + self.bias
        return out.to(self.out_dtype or x.dtype).view(*x.shape[:-1], self.out_features)

    def forward_cpu(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)
        if x2.dtype not in (torch.float32, torch.bfloat16) or x2.stride(1) != 1:
            x2 = x2.float().contiguous()
        dtype = self.out_dtype or x.dtype
        y = self.kernels.int4_linear(
            x2,
            self._packed,
            self.out_features,
            self.bias,
            dtype if dtype in (torch.float32, torch.bfloat16) else torch.float32,
        )
        return y.to(dtype).view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (
            f"in={self.in_features}, out={self.out_features}, bias={self.bias is not None}, "
            f"out_dtype={self.out_dtype}, impl={self.impl}"
        )

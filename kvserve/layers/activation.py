"""Activations: gated (SiluAndMul) and plain (BLOOM's tanh GELU)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvserve.layers.custom_op import CustomOp


class SiluAndMul(CustomOp):
    """x [..., 2 * d] = [gate | up] along the last dim -> silu(gate) * up [..., d]."""

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up

    def forward_cpu(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2 or not x.is_contiguous():  # the fused kernel takes contiguous [T, 2 * d] rows
            return self.forward_native(x)
        assert self.kernels is not None
        return self.kernels.silu_and_mul(x)

    def forward_cuda(self, x: torch.Tensor) -> torch.Tensor:
        # fp32 keeps torch's kernels (bitwise HF parity); half types take one fused launch instead of three.
        if x.dtype == torch.float32 or x.dim() != 2 or x.stride(-1) != 1:
            return self.forward_native(x)
        from kvserve.kernels import triton_ops

        return triton_ops.silu_and_mul(x)


class BloomGelu(CustomOp):
    """GELU's tanh approximation exactly as HF's BLOOM computes it (its constant 0.79788456 for sqrt(2 / pi), so
    not F.gelu(approximate="tanh") to the bit)."""

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        return x * 0.5 * (1.0 + torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x)))

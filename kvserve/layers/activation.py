"""Gated activations."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvserve.kernels.cpu import load_cpu_kernels


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x = [gate | up] along the last dim -> silu(gate) * up (one fused pass on CPU when the kernels built)."""
    kernels = load_cpu_kernels()
    if kernels is not None and x.device.type == "cpu" and x.dim() == 2 and x.is_contiguous():
        return kernels.silu_and_mul(x)
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up

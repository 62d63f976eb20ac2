"""RMSNorm, optionally fused with the residual add that precedes it."""

from __future__ import annotations

import torch
from torch import nn

from kvserve.kernels.cpu import load_cpu_kernels


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self._kernels = load_cpu_kernels()

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """With `residual`, computes norm(x + residual) and also returns x + residual (the next residual).

        NOTE: the fused kernel works in place on `x` and `residual` (both are the layer's own temporaries);
        without a residual it works on a copy, since the caller may keep `x` (the first layer's residual).
        """
        k = self._kernels
        if k is not None and x.device.type == "cpu" and x.is_contiguous():
            if residual is None:
                out = x.clone()
                k.rms_norm_(out, None, self.weight, self.eps)
                return out
            k.rms_norm_(x, residual, self.weight, self.eps)
            return x, residual
        if residual is not None:
            x = x + residual
            residual = x
        # Statistics in fp32 and the weight applied after casting back, exactly as HF does.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        out = self.weight * xf.to(x.dtype)
        return out if residual is None else (out, residual)

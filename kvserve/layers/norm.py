"""RMSNorm, optionally fused with the residual add that precedes it; LayerNorm (BLOOM)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.layers.custom_op import CustomOp


class RMSNorm(CustomOp):
    """forward(x) -> norm(x); forward(x, residual) -> (norm(x + residual), x + residual), the next residual.

    NOTE: the cpu and cuda (half types) paths work in place on `x` and `residual` (both are the layer's own
    temporaries); without a residual they write a new tensor, since the caller may keep `x` (the first layer's
    residual).
    """

    def __init__(
        self, hidden_size: int, eps: float, device: torch.device | str | None = None, use_kernel: bool = True
    ) -> None:
        super().__init__(device, use_kernel)
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward_native(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is not None:
            x = x + residual
            residual = x
        # Statistics in fp32 and the weight applied after casting back, exactly as HF does.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        out = self.weight * xf.to(x.dtype)
        return out if residual is None else (out, residual)

    def forward_cpu(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if not x.is_contiguous():  # the kernel walks contiguous rows
            return self.forward_native(x, residual)
        assert self.kernels is not None
        if residual is None:
            out = x.clone()
            self.kernels.rms_norm_(out, None, self.weight, self.eps)
            return out
        self.kernels.rms_norm_(x, residual, self.weight, self.eps)
        return x, residual

    def forward_cuda(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        # fp32 keeps torch's own kernels: its agreement with HF to the bit is what the fp32 parity checks hold.
        if x.dtype == torch.float32 or x.dim() != 2 or x.stride(-1) != 1:
            return self.forward_native(x, residual)
        if residual is not None and (residual.shape != x.shape or residual.stride(-1) != 1):
            return self.forward_native(x, residual)
        from kvserve.kernels import triton_ops

        # One launch instead of six or more (add, pow, mean, rsqrt, the casts, the weight): in place like the cpu path.
        return triton_ops.rms_norm(x, self.weight, self.eps, residual)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}, impl={self.impl}"


class QKNorm(CustomOp):
    """Qwen3's per-head RMSNorm of q and k before RoPE, in place on the fused qkv rows: forward(qkv, q_norm,
    k_norm, num_heads, num_kv_heads) normalises each query head with `q_norm` and each key head with `k_norm`
    (RMSNorm layers over head_dim, which hold the weights). Holds no parameters of its own.

    The cuda path (half types) is one Triton launch; the others reshape, call the two norms and write back, which
    on a GPU is six launches a layer (two copies out, two norms, two copies back).
    """

    def forward_native(
        self, qkv: torch.Tensor, q_norm: RMSNorm, k_norm: RMSNorm, num_heads: int, num_kv_heads: int
    ) -> None:
        t, head_dim = qkv.shape[0], q_norm.weight.shape[0]
        q_size, k_end = num_heads * head_dim, (num_heads + num_kv_heads) * head_dim
        qkv[:, :q_size] = q_norm(qkv[:, :q_size].reshape(-1, head_dim)).view(t, -1)
        qkv[:, q_size:k_end] = k_norm(qkv[:, q_size:k_end].reshape(-1, head_dim)).view(t, -1)

    def forward_cuda(
        self, qkv: torch.Tensor, q_norm: RMSNorm, k_norm: RMSNorm, num_heads: int, num_kv_heads: int
    ) -> None:
        # fp32 keeps torch's kernels (HF parity to the bit), as RMSNorm does.
        if qkv.dtype == torch.float32 or qkv.stride(-1) != 1 or q_norm.eps != k_norm.eps:
            return self.forward_native(qkv, q_norm, k_norm, num_heads, num_kv_heads)
        from kvserve.kernels import triton_ops

        triton_ops.qk_norm_(qkv, q_norm.weight, k_norm.weight, q_norm.eps, num_heads, num_kv_heads)


class LayerNorm(CustomOp):
    """LayerNorm with a weight and a bias over the last dim (BLOOM's norms): torch's own kernel on every device, so
    fp32 results equal HF's to the bit. forward(x) -> norm(x); never in place."""

    def __init__(
        self, hidden_size: int, eps: float, device: torch.device | str | None = None, use_kernel: bool = True
    ) -> None:
        super().__init__(device, use_kernel)
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.bias = nn.Parameter(torch.zeros(hidden_size))
        self.eps = eps

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, self.eps)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}, impl={self.impl}"

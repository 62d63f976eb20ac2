"""Rotary position embeddings (rotate-half / NeoX layout, as HF Llama and Qwen use), with Llama-3 scaling."""

from __future__ import annotations

import math

import torch

from kvserve.layers.custom_op import CustomOp


def compute_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    # Same arithmetic as HF (int64 arange cast to fp32) so fp32 angles match bit for bit.
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    rope_type = (scaling or {}).get("rope_type", "default")
    if rope_type == "default":
        return inv_freq
    assert scaling is not None
    factor = float(scaling["factor"])
    if rope_type == "linear":
        return inv_freq / factor
    if rope_type == "llama3":
        low = float(scaling["low_freq_factor"])
        high = float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        low_wavelen = old_len / low
        high_wavelen = old_len / high
        wavelen = 2 * math.pi / inv_freq
        # Long wavelengths are stretched by `factor`, short ones kept, the band between interpolated.
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return torch.where(is_medium, smoothed, scaled)
    raise ValueError(f"unsupported rope_type {rope_type!r}")


class RotaryEmbedding(CustomOp):
    """In place: `rotate_(positions, x, num_heads)` (also its `forward`) rotates the first `num_heads` heads of
    each row of x [T, >= num_heads * head_dim], a view into the fused qkv output (q heads then k heads, rows of
    any stride)."""

    def __init__(
        self,
        head_dim: int,
        max_position: int,
        theta: float,
        scaling: dict | None,
        dtype: torch.dtype,
        device: torch.device | str | None = None,
        use_kernel: bool = True,
    ) -> None:
        super().__init__(device, use_kernel)
        inv_freq = compute_inv_freq(head_dim, theta, scaling)
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
        # NOTE: cached in the model dtype because HF casts cos/sin to it before use.
        self.register_buffer("cos", freqs.cos().to(dtype), persistent=False)  # [max_position, head_dim // 2]
        self.register_buffer("sin", freqs.sin().to(dtype), persistent=False)

    def rotate_(self, positions: torch.Tensor, x: torch.Tensor, num_heads: int) -> None:
        self._forward_impl(positions, x, num_heads)

    def forward_native(self, positions: torch.Tensor, x: torch.Tensor, num_heads: int) -> None:
        head_dim = 2 * self.cos.shape[1]
        heads = x[:, : num_heads * head_dim].view(x.shape[0], num_heads, head_dim)
        cos = self.cos[positions].unsqueeze(1)  # [T, 1, D/2]
        sin = self.sin[positions].unsqueeze(1)
        heads.copy_(_rotate(heads, cos, sin))

    def forward_cpu(self, positions: torch.Tensor, x: torch.Tensor, num_heads: int) -> None:
        if x.stride(-1) != 1:  # the kernel takes rows of any stride but contiguous within a row
            self.forward_native(positions, x, num_heads)
            return
        assert self.kernels is not None
        self.kernels.rotary_(x, positions, self.cos, self.sin, num_heads, 2 * self.cos.shape[1])

    def forward_cuda(self, positions: torch.Tensor, x: torch.Tensor, num_heads: int) -> None:
        # fp32 keeps torch's kernels (bitwise HF parity); half types take one launch instead of a gather, four
        # products, a cat and a copy.
        if x.dtype == torch.float32 or x.stride(-1) != 1:
            self.forward_native(positions, x, num_heads)
            return
        from kvserve.kernels import triton_ops

        triton_ops.rotary_(positions, x, self.cos, self.sin, num_heads)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

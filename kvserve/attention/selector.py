"""Picks the attention backend for this machine: the C++ kernel backend where the kernels load, else the torch
reference. The model runner asks here; models only see the AttentionBackend interface."""

from __future__ import annotations

import torch

from kvserve.attention.base import AttentionBackend
from kvserve.attention.cpu_kernels import CpuKernelAttentionBackend
from kvserve.attention.torch_ref import TorchRefAttentionBackend
from kvserve.kernels.cpu import load_cpu_kernels


def get_attn_backend(num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> AttentionBackend:
    kernels = load_cpu_kernels()
    if kernels is not None:
        return CpuKernelAttentionBackend(num_heads, num_kv_heads, head_dim, dtype, kernels)
    return TorchRefAttentionBackend(num_heads, num_kv_heads, head_dim, dtype)

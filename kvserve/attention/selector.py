"""Picks the attention backend for the device the model runs on: Triton kernels on a GPU; on the CPU the C++
kernel backend where the kernels load, else the torch reference. `name` forces one ("triton" on the CPU runs the
kernels in Triton's interpreter: tests only, with TRITON_INTERPRET=1 set before the first import). The model
runner asks here; models only see the AttentionBackend interface.

`deterministic` (ModelConfig.deterministic): True asks for a batch-invariant backend and is refused where none
runs (the Triton kernels, the torch reference); False and None let the C++ backend send big chunks to SDPA where
that is faster (fp32 and the standard layout; the pair-packed bf16 layout is batch-invariant and fastest in either
case: docs/benchmarks.md, "Deterministic inference")."""

from __future__ import annotations

import os

import torch

from kvserve.attention.base import AttentionBackend
from kvserve.attention.cpu_kernels import CpuKernelAttentionBackend
from kvserve.attention.torch_ref import TorchRefAttentionBackend
from kvserve.kernels.cpu import load_cpu_kernels


def get_attn_backend(
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    name: str = "auto",
    deterministic: bool | None = None,
    kv_cache_dtype: torch.dtype | None = None,
) -> AttentionBackend:
    """`kv_cache_dtype`: what the KV cache holds, the model's `dtype` (None) or fp8 (attention/kv_dtype.py)."""
    device = torch.device(device)
    if name == "triton" or (name == "auto" and device.type == "cuda"):
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError("attention_backend triton needs a GPU, or TRITON_INTERPRET=1 (Triton's interpreter)")
        if deterministic:
            raise ValueError("deterministic inference: the Triton attention kernels are not batch-invariant yet")
        # Imported here: Triton is needed only on this path.
        from kvserve.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend(num_heads, num_kv_heads, head_dim, dtype, device, kv_cache_dtype=kv_cache_dtype)
    if device.type != "cpu":
        raise ValueError(f"attention_backend {name} runs on the CPU only, not on {device}")
    if name == "torch":
        if deterministic:
            raise ValueError("deterministic inference: the torch reference attention is not batch-invariant")
        return TorchRefAttentionBackend(num_heads, num_kv_heads, head_dim, dtype, kv_cache_dtype)
    kernels = load_cpu_kernels()
    if kernels is not None:
        return CpuKernelAttentionBackend(
            num_heads,
            num_kv_heads,
            head_dim,
            dtype,
            kernels,
            deterministic=bool(deterministic),
            kv_cache_dtype=kv_cache_dtype,
        )
    if name == "cpu":
        raise ValueError("attention_backend cpu: the C++ CPU kernels did not build (see the log); use auto or torch")
    if deterministic:
        raise ValueError(
            "deterministic inference needs the C++ CPU kernels, which did not build here (see the log), or are "
            "turned off by KVSERVE_CPU_KERNELS=0"
        )
    return TorchRefAttentionBackend(num_heads, num_kv_heads, head_dim, dtype, kv_cache_dtype)

"""The KV cache's element type: the model's dtype ("auto") or one-byte fp8 (vLLM's kv_cache_dtype "fp8_e4m3" and
"fp8_e5m2"), and the one conversion every backend stores with.

fp8 caches have no scale (vLLM's uncalibrated default, k_scale = v_scale = 1.0): a value is stored as itself,
rounded to nearest even and saturated to the format's largest finite value (e4m3: 448, e5m2: 57344); NaN is stored
as 0 (as the bf16/fp32 caches do, so that one broken request cannot poison the blocks others reuse). Reads widen
exactly. `quantize_kv` is that store in torch: the reference the C++ and Triton write kernels are tested against.
What the cache stores of the keys is centred first (key_centering.py), which no reader needs to know.
"""

from __future__ import annotations

import torch

# CacheConfig.cache_dtype -> the torch dtype of the cache tensors.
FP8_DTYPES: dict[str, torch.dtype] = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def kv_cache_torch_dtype(cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype of the K/V cache tensors for CacheConfig.cache_dtype ("auto": the model's)."""
    if cache_dtype == "auto":
        return model_dtype
    if cache_dtype not in FP8_DTYPES:
        raise ValueError(f"unknown KV cache dtype {cache_dtype!r}")
    return FP8_DTYPES[cache_dtype]


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in (torch.float8_e4m3fn, torch.float8_e5m2)


def quantize_kv(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x as the cache stores it: non-finite values replaced (NaN -> 0, +-inf -> the largest finite), and for fp8
    saturated to the format's range, then rounded to nearest even."""
    x = torch.nan_to_num(x)
    if is_fp8(dtype):
        limit = torch.finfo(dtype).max
        x = x.float().clamp(-limit, limit)
    return x.to(dtype)

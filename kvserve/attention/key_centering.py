"""Key centering for fp8 KV caches: each layer's keys are stored minus a fixed per-layer offset, the mean key.

Why: the keys of most models carry channels with a large, nearly constant value (|mean| 5-16 on SmolLM2, against a
median |key| of ~1). fp8 rounds relative to an element's magnitude, so those channels lose the most absolute
precision, and q . k errs by q times that. Subtracting a constant vector mu from every key of a layer changes each
score q . k by the same q . mu for all keys of a query, which softmax ignores: attention is unchanged in exact
arithmetic, and the stored values are small where the rounding hurt. The readers (every attention kernel) need
nothing: they attend over the centred keys as they are. On the embedded SmolLM2-135M this halves the fp8 e4m3
cache's perplexity cost (docs/benchmarks.md).

mu is each kv head's mean key after RoPE (vLLM calibrates its fp8 scales in a forward pass the same way), over one
forward of CALIBRATION_TOKENS token ids drawn with a fixed seed: tokenizer-free, the same on every rank and
instance of a model, and about as good as real text here (the per-layer constant is what matters). Every block of
one sequence must be written with the same mu, so the layout id names the recipe (`layout_tag`); instances on
different CPU kinds compute mu to within the same rounding as the keys themselves.

KVSERVE_FP8_KEY_CENTERING=0 turns it off (A/B runs).
"""

from __future__ import annotations

import os
from typing import Any

import torch

from kvserve.attention.common import context_mask, sdpa
from kvserve.attention.kv_dtype import is_fp8

CALIBRATION_TOKENS = 512  # fewer where the model's context is shorter
CALIBRATION_SEED = 0


def calibration_ids(vocab_size: int, max_model_len: int) -> torch.Tensor:
    n = min(CALIBRATION_TOKENS, max_model_len)
    return torch.randint(0, vocab_size, (n,), generator=torch.Generator().manual_seed(CALIBRATION_SEED))


def layout_tag(ids: torch.Tensor) -> str:
    """What the layout id says of the keys' offsets: the calibration recipe (`calibration_ids`' length and seed)."""
    return f"k_centered=rand{len(ids)}s{CALIBRATION_SEED}"


def key_centering_enabled(kv_dtype: torch.dtype) -> bool:
    return is_fp8(kv_dtype) and os.environ.get("KVSERVE_FP8_KEY_CENTERING", "1") != "0"


class _MeanKeyBackend:
    """Stands in for the attention backend during the calibration forward: plain causal attention over the
    forward's own tokens (no cache), and each call's keys summed per layer (calls come in layer order)."""

    def __init__(self) -> None:
        self.sums: list[torch.Tensor] = []

    def fused_layer_args(self, metadata: Any) -> None:
        return None  # the module path, so that every layer's keys pass through forward

    def rotate_and_write(self, *args) -> bool:
        return False  # the layer rotates, and forward sees the rotated keys

    def forward(self, q, k, v, kv_cache, metadata, scale, sliding_window=None, alibi_slopes=None) -> torch.Tensor:
        n = q.shape[0]
        self.sums.append(k.float().sum(0).flatten())
        plain = sliding_window is None and alibi_slopes is None  # sdpa's own causal mask then
        mask = None if plain else context_mask(n, n, 0, sliding_window, alibi_slopes, q.dtype)
        return sdpa(q, k, v, mask, scale).reshape(n, -1)


def attention_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's attention modules in layer order: those that take a key offset (`k_offset`)."""
    return [m for m in model.modules() if hasattr(m, "k_offset") and hasattr(m, "backend")]


@torch.inference_mode()
def calibrate_key_offsets(model: torch.nn.Module, ids: torch.Tensor, dtype: torch.dtype) -> list[torch.Tensor]:
    """Each attention module's mean key after RoPE ([kv heads * head dim] of this rank, in `dtype`), from one
    forward over `ids` (`calibration_ids`) on the model's device. The modules' offsets must be unset (None)."""
    modules = attention_modules(model)
    assert all(m.k_offset is None for m in modules), "calibrate before setting offsets"
    n = len(ids)
    device = next(model.parameters()).device
    capture = _MeanKeyBackend()
    saved = [m.backend for m in modules]
    for m in modules:
        m.backend = capture
    try:
        model(ids.to(device), torch.arange(n, device=device), [None] * len(modules), None)
    finally:
        for m, backend in zip(modules, saved, strict=True):
            m.backend = backend
    return [(s / n).to(dtype).contiguous() for s in capture.sums]


def set_key_offsets(model: torch.nn.Module, offsets: list[torch.Tensor] | None) -> None:
    """Install (or with None, remove) the per-layer key offsets; the attention modules subtract them from the keys
    they write (models/llama.py, models/bloom.py and the fused C++ layer)."""
    modules = attention_modules(model)
    if offsets is not None and len(offsets) != len(modules):
        raise ValueError(f"{len(offsets)} key offsets for {len(modules)} attention layers")
    for i, m in enumerate(modules):
        m.k_offset = None if offsets is None else offsets[i]

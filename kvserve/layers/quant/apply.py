"""Put int8 linears into a loaded model: every `Linear` (the LM head too) is replaced by an `Int8Linear` built
from its weights. The embedding stays a gather in the model's dtype; a tied LM head gets its own int8 copy.

The LM head's output (fp32 inside the int8 kernel) stays fp32: the logits are wanted in fp32, and rounding them to
bf16 first would only add ties (bf16 steps are 0.125 at logits of 16-32) and two passes over [rows, vocab]."""

from __future__ import annotations

import os

import torch
from torch import nn

from kvserve.layers.linear import Linear
from kvserve.layers.quant.int8_linear import Int8Linear
from kvserve.layers.vocab_embedding import ParallelLMHead

QUANTIZATION_METHODS = ("int8",)


def quantize_linears(model: nn.Module, method: str) -> int:
    """Replace the model's Linear modules in place; returns how many were replaced."""
    if method not in QUANTIZATION_METHODS:
        raise ValueError(f"unknown quantization {method!r}; supported: {', '.join(QUANTIZATION_METHODS)}")
    # KVSERVE_INT8_ROTATE=0 quantizes without the block rotation: only to reproduce the quality comparison in
    # docs/benchmarks.md (perplexity +4.2% without, +0.46% with).
    rotate = os.environ.get("KVSERVE_INT8_ROTATE", "1") != "0"
    targets = [(name, m) for name, m in model.named_modules() if isinstance(m, Linear)]
    for name, linear in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        out_dtype = torch.float32 if isinstance(linear, ParallelLMHead) else None
        setattr(parent, child, Int8Linear.from_float(linear.weight, linear.bias, rotate=rotate, out_dtype=out_dtype))
    return len(targets)


def model_weight_bytes(model: nn.Module) -> int:
    """Resident bytes of the model's weights: parameters and buffers (tied ones once) and int8 packed weights."""
    seen: set[int] = set()
    total = 0
    for t in list(model.parameters()) + list(model.buffers()):
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    for m in model.modules():
        if isinstance(m, Int8Linear):
            total += m.weight_bytes()
        elif isinstance(m, Linear):
            for held in (m._packed, m._panels):  # the weight forms kept outside the parameters
                if held is not None:
                    total += held.numel() * held.element_size()
    return total

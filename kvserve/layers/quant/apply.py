"""Put quantized linears into a loaded model. The embedding stays a gather in the model's dtype; a tied LM head
gets its own quantized copy.

int8: every `Linear` (the LM head too) is replaced by an `Int8Linear` built from its weights.
int4: a linear whose checkpoint tensors are all GGUF Q4_0 / Q4_1 (`q4_blocks`, fused q/k/v and gate/up
concatenated by rows) becomes an `Int4Linear` of exactly those blocks; other GGUF tensors (Q8_0, Q6_K, f16, ...)
are not re-quantized to 4 bits but take the int8 path, as does the LM head of a float checkpoint (its 4-bit error
would land directly on the logits); the layer matrices of a float checkpoint are quantized to the Q4_1 form
(int4_linear.quantize_q4_1: asymmetric, per block of 32).

The LM head's output (fp32 inside the int8 kernel) stays fp32: the logits are wanted in fp32, and rounding them to
bf16 first would only add ties (bf16 steps are 0.125 at logits of 16-32) and two passes over [rows, vocab]."""

from __future__ import annotations

import os

import torch
from torch import nn

from kvserve.layers.linear import Linear
from kvserve.layers.quant.int4_linear import Int4Linear
from kvserve.layers.quant.int8_linear import Int8Linear
from kvserve.layers.vocab_embedding import ParallelLMHead

QUANTIZATION_METHODS = ("int8", "int4")

# A fused linear's module name suffix -> the checkpoint (HF) matrices it stacks by rows, in order.
_FUSED_SOURCES = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}

Q4Blocks = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # codes uint8 [rows, K], d, m fp32 [rows, K / 32]


def _source_names(module_name: str, tied: bool) -> list[str]:
    """The HF tensor names a Linear module was loaded from."""
    if module_name == "lm_head":
        return ["model.embed_tokens.weight" if tied else "lm_head.weight"]
    prefix, _, last = module_name.rpartition(".")
    if last in _FUSED_SOURCES:
        return [f"{prefix}.{src}.weight" for src in _FUSED_SOURCES[last]]
    return [f"{module_name}.weight"]


def _int4_blocks(linear: Linear, names: list[str], q4_blocks: dict[str, Q4Blocks]) -> Q4Blocks | None:
    """The linear's weight as stored 4-bit blocks, or None if any of its source tensors is not Q4_0 / Q4_1."""
    if not all(n in q4_blocks for n in names):
        return None
    parts = [q4_blocks[n] for n in names]
    blocks = tuple(torch.cat([p[i] for p in parts]) for i in range(3))
    if blocks[0].shape != linear.weight.shape:
        raise ValueError(
            f"{names}: 4-bit blocks of shape {tuple(blocks[0].shape)} for a weight of {tuple(linear.weight.shape)}"
        )
    return blocks


def quantize_linears(model: nn.Module, method: str, q4_blocks: dict[str, Q4Blocks] | None = None) -> int:
    """Replace the model's Linear modules in place; returns how many were replaced. `q4_blocks` (int4 from a GGUF):
    the file's Q4_0 / Q4_1 matrices by HF name (loader.gguf_weights.iterate_gguf_q4_blocks)."""
    if method not in QUANTIZATION_METHODS:
        raise ValueError(f"unknown quantization {method!r}; supported: {', '.join(QUANTIZATION_METHODS)}")
    # KVSERVE_INT8_ROTATE=0 quantizes without the block rotation: only to reproduce the quality comparison in
    # docs/benchmarks.md (perplexity +4.2% without, +0.46% with).
    rotate = os.environ.get("KVSERVE_INT8_ROTATE", "1") != "0"
    tied = bool(getattr(getattr(model, "config", None), "tie_word_embeddings", False))
    targets = [(name, m) for name, m in model.named_modules() if isinstance(m, Linear)]
    for name, linear in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        is_head = isinstance(linear, ParallelLMHead)
        out_dtype = torch.float32 if is_head else None
        new: torch.nn.Module | None = None
        if method == "int4" and q4_blocks is not None:
            blocks = _int4_blocks(linear, _source_names(name, tied), q4_blocks)
            if blocks is not None:
                new = Int4Linear.from_blocks(*blocks, linear.bias, out_dtype=out_dtype)
        elif method == "int4" and not is_head:
            new = Int4Linear.from_float(linear.weight, linear.bias, out_dtype=out_dtype)
        if new is None:
            new = Int8Linear.from_float(linear.weight, linear.bias, rotate=rotate, out_dtype=out_dtype)
        setattr(parent, child, new)
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
        if isinstance(m, (Int8Linear, Int4Linear)):
            total += m.weight_bytes()
        elif isinstance(m, Linear):
            for held in (m._packed, m._panels):  # the weight forms kept outside the parameters
                if held is not None:
                    total += held.numel() * held.element_size()
    return total

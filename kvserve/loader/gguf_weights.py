"""Read a single GGUF file: metadata -> ArchConfig, tensors dequantized (by the `gguf` package) to HF names."""

from __future__ import annotations

import functools
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvserve.config import ArchConfig
from kvserve.loader.arch_config import arch_config_from_gguf

# GGUF tensor name -> HF name (`{i}` is the layer index).
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


# The tokenizer's arrays: transformers reads them itself; here they would only cost parse time and objects.
_VOCAB_FIELDS = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type", "tokenizer.ggml.scores")


@dataclass(frozen=True)
class _Tensor:
    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # as gguf lists them: innermost first
    data: np.ndarray  # a view of the file's memory map


@dataclass(frozen=True)
class _File:
    fields: dict[str, Any]  # scalar and small array metadata, decoded
    tensors: list[_Tensor]


@functools.lru_cache(maxsize=2)
def _read(path: str) -> _File:
    """One parse per file (~3 s for SmolLM2's 49k-token vocabulary), shared by config and weight loading. The cache
    keeps what the loaders use, not the GGUFReader: the reader holds a numpy memmap with its own dict for every part
    of every vocabulary entry (~500k objects the collector tracks for the embedded model), which every full garbage
    collection would walk for as long as the process lives (batch-1 decode ~8% slower in an offline engine)."""
    import gguf

    reader = gguf.GGUFReader(path)
    fields = {key: field.contents() for key, field in reader.fields.items() if key not in _VOCAB_FIELDS}
    tensors = [
        _Tensor(t.name, t.tensor_type, tuple(int(d) for d in t.shape), np.asarray(t.data)) for t in reader.tensors
    ]
    return _File(fields, tensors)


def read_gguf_metadata(path: str) -> tuple[dict[str, Any], set[str]]:
    """Scalar metadata fields (the big tokenizer arrays are skipped) and the tensor names."""
    parsed = _read(path)
    return dict(parsed.fields), {t.name for t in parsed.tensors}


def gguf_arch_config(path: str) -> ArchConfig:
    fields, names = read_gguf_metadata(path)
    return arch_config_from_gguf(fields, names)


def gguf_linears_quantized(path: str) -> bool:
    """Whether the file's layer matrices are stored in a quantized block format (not F32/F16/BF16)."""
    import gguf

    float_types = {gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.BF16}
    return any(
        t.tensor_type not in float_types for t in _read(path).tensors if t.name.startswith("blk.") and len(t.shape) == 2
    )


def hf_name(gguf_name: str) -> str:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _LAYER_RE.fullmatch(gguf_name)
    if m is None or m.group(2) not in _LAYER_NAMES:
        raise ValueError(f"unknown GGUF tensor {gguf_name!r}")
    return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.{m.group(3)}"


def undo_rope_permutation(w: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's converter reorders each head's q/k rows from HF's rotate-half layout to interleaved pairs;
    put them back so one RoPE implementation serves both formats."""
    half = w.shape[0] // num_heads // 2
    return w.reshape(num_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def iterate_gguf(path: str, cfg: ArchConfig) -> Iterator[tuple[str, torch.Tensor]]:
    import gguf

    parsed = _read(path)
    # Only the llama architecture is permuted by the converter; qwen2/qwen3 keep the HF (NeoX) layout.
    permuted = parsed.fields["general.architecture"] == "llama"
    for t in parsed.tensors:
        w = gguf.quants.dequantize(t.data, t.tensor_type)
        name = hf_name(t.name)
        if permuted and name.endswith("q_proj.weight"):
            w = undo_rope_permutation(w, cfg.num_attention_heads)
        elif permuted and name.endswith("k_proj.weight"):
            w = undo_rope_permutation(w, cfg.num_key_value_heads)
        w = np.ascontiguousarray(w, dtype=np.float32)
        if not w.flags.writeable:  # F32 tensors come back as views of the read-only memory map
            w = w.copy()
        yield name, torch.from_numpy(w)


Q4_TYPES = ("Q4_0", "Q4_1")


def iterate_gguf_q4_blocks(path: str, cfg: ArchConfig) -> Iterator[tuple[str, tuple[torch.Tensor, ...]]]:
    """The file's Q4_0 / Q4_1 matrices as stored, HF-named: (codes uint8 [rows, cols] in 0..15, d, m fp32
    [rows, cols / 32]) with w = d * codes + m per block of 32 (Q4_0: codes = q + 8, m = -8 d, exactly), rows in the
    order `iterate_gguf` gives (q/k un-permuted). d * codes + m is bitwise gguf.quants.dequantize's value."""
    from kvserve.loader.gguf_blocks import decode_blocks

    parsed = _read(path)
    permuted = parsed.fields["general.architecture"] == "llama"
    for t in parsed.tensors:
        if t.tensor_type.name not in Q4_TYPES or len(t.shape) != 2:
            continue
        shape = (int(t.shape[1]), int(t.shape[0]))  # gguf lists dims innermost first
        blocks = decode_blocks(t.data, t.tensor_type.name, shape)
        codes, d = blocks.codes, blocks.scale
        if blocks.offset is None:  # Q4_0: d * q with q in -8..7
            codes, m = (codes + np.int8(8)).astype(np.uint8), np.float32(-8.0) * d
        else:
            codes, m = codes.astype(np.uint8), blocks.offset
        name = hf_name(t.name)
        heads = None
        if permuted and name.endswith("q_proj.weight"):
            heads = cfg.num_attention_heads
        elif permuted and name.endswith("k_proj.weight"):
            heads = cfg.num_key_value_heads
        parts = [codes, d, m]
        if heads is not None:  # a row permutation: blocks run along the columns, so they move with their rows
            parts = [undo_rope_permutation(a, heads) for a in parts]
        yield name, tuple(torch.from_numpy(np.ascontiguousarray(a)) for a in parts)

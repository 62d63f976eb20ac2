"""Frozen configuration dataclasses. Each component receives only the sub-config it needs.

Derived values are computed once by `kvserve.engine.arg_utils.EngineArgs`; nothing here is mutated after
start-up. Pure Python (no torch), so core/ may import it.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ArchConfig:
    """Architecture hyper-parameters of a decoder-only model (HF config.json names)."""

    architecture: str  # HF class name, e.g. "LlamaForCausalLM"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    rope_scaling: dict | None = field(default=None, hash=False)
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2: q/k/v projections carry a bias
    qk_norm: bool = False  # Qwen3: per-head RMSNorm on q and k before RoPE
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class ModelConfig:
    model: str  # what the user asked for (path or embedded model name)
    path: str  # resolved: a folder (HF) or a .gguf file
    format: str  # "hf" | "gguf"
    tokenizer: str  # folder or .gguf file the tokenizer is read from
    dtype: str  # "float32" | "bfloat16"
    max_model_len: int
    arch: ArchConfig
    seed: int = 0
    quantization: str | None = None  # resolved: "int8" (int8 linears and LM head) or None (weights in dtype)


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    # Bytes for K and V of all layers; None means a default derived from available memory.
    kv_cache_memory: int | None = None
    # Exact number of blocks (overrides kv_cache_memory), like vLLM's num_gpu_blocks_override.
    num_kv_blocks: int | None = None
    enable_prefix_caching: bool = True
    # Fault the KV pool's pages in at start-up: "off" (on first use), "sync" (before the engine is ready) or
    # "background" (a daemon thread; what `kvserve serve` does).
    kv_prefault: str = "off"


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    enable_chunked_prefill: bool = True


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig

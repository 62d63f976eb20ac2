"""Turn an HF config.json or GGUF metadata into an ArchConfig (pure Python)."""

from __future__ import annotations

import json
import logging
import os
from typing import Any

from kvserve.config import ArchConfig

logger = logging.getLogger(__name__)

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "BloomForCausalLM",
)
_SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def arch_config_from_hf(config: dict[str, Any], generation_config: dict[str, Any] | None = None) -> ArchConfig:
    archs = config.get("architectures") or []
    arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None:
        raise ValueError(
            f"unsupported model architecture {archs or config.get('model_type')!r}; "
            f"kvserve supports {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    eos = _as_ids(config.get("eos_token_id"))
    if generation_config:
        eos = _merge_ids(eos, _as_ids(generation_config.get("eos_token_id")))
    if arch == "BloomForCausalLM":
        return bloom_arch_config(config, eos)
    act = config.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"unsupported hidden_act {act!r} (only silu)")
    num_heads = config["num_attention_heads"]
    hidden = config["hidden_size"]
    rope_theta, rope_scaling = _rope_from_hf(config)
    return ArchConfig(
        architecture=arch,
        vocab_size=config["vocab_size"],
        hidden_size=hidden,
        intermediate_size=config["intermediate_size"],
        num_hidden_layers=config["num_hidden_layers"],
        num_attention_heads=num_heads,
        num_key_value_heads=config.get("num_key_value_heads") or num_heads,
        head_dim=config.get("head_dim") or hidden // num_heads,
        rms_norm_eps=config.get("rms_norm_eps", 1e-6),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=config.get("max_position_embeddings", 2048),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        attention_bias=arch == "Qwen2ForCausalLM" or bool(config.get("attention_bias", False)),
        qk_norm=arch == "Qwen3ForCausalLM",
        bos_token_id=config.get("bos_token_id"),
        eos_token_ids=eos,
        sliding_windows=layer_windows(config),
    )


def bloom_arch_config(config: dict[str, Any], eos_token_ids: tuple[int, ...]) -> ArchConfig:
    """BLOOM (HF's BloomConfig, older configs' names too: n_embed, num_attention_heads): ALiBi attention with every
    head its own KV head, LayerNorms with biases, a 4x GELU MLP, the LM head tied to the embedding by default. BLOOM
    has no position limit (ALiBi extrapolates); its training length, `seq_length` (2048 if absent), bounds
    max_model_len."""
    hidden = int(config.get("hidden_size") or config["n_embed"])
    num_heads = int(config.get("n_head") or config["num_attention_heads"])
    if hidden % num_heads:
        raise ValueError(f"BLOOM: hidden_size {hidden} is not a multiple of n_head {num_heads}")
    return ArchConfig(
        architecture="BloomForCausalLM",
        vocab_size=int(config["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=int(config.get("n_layer") or config["num_hidden_layers"]),
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        head_dim=hidden // num_heads,
        rms_norm_eps=float(config.get("layer_norm_epsilon", 1e-5)),
        rope_theta=10000.0,  # unused: no RoPE
        max_position_embeddings=int(config.get("seq_length") or 2048),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", True)),
        attention_bias=True,
        bos_token_id=config.get("bos_token_id"),
        eos_token_ids=eos_token_ids,
        alibi=True,
        residual_post_layernorm=bool(config.get("apply_residual_connection_post_layernorm", False)),
    )


def layer_windows(config: dict[str, Any]) -> tuple[int | None, ...]:
    """Each layer's attention window as HF's modelling code applies it (transformers 5), or () when no layer has
    one:

    - Mistral: `sliding_window` on every layer (HF's Mistral ignores `layer_types`);
    - Qwen2, Qwen3: only with `use_sliding_window`; the layers named "sliding_attention" in `layer_types`, or,
      in configs without that list, the layers from `max_window_layers` on;
    - Llama: none (HF's Llama has no sliding window).
    A layer type other than "sliding_attention" / "full_attention" is refused (ValueError)."""
    num_layers = int(config["num_hidden_layers"])
    model_type = config.get("model_type")
    window = config.get("sliding_window")
    if window is None or model_type not in ("mistral", "qwen2", "qwen3"):
        return ()
    if model_type != "mistral" and not config.get("use_sliding_window", False):
        return ()
    if int(window) < 1:
        raise ValueError(f"sliding_window must be >= 1, got {window!r}")
    types = config.get("layer_types")
    if model_type == "mistral":
        types = None
    if types is None:
        first = int(config.get("max_window_layers", 0)) if model_type != "mistral" else 0
        types = ["sliding_attention" if i >= first else "full_attention" for i in range(num_layers)]
    if len(types) != num_layers or any(t not in ("sliding_attention", "full_attention") for t in types):
        raise ValueError(
            f"unsupported layer_types {types!r}: kvserve runs one of 'sliding_attention' or 'full_attention' per "
            f"layer, for each of the {num_layers} layers"
        )
    windows = tuple(int(window) if t == "sliding_attention" else None for t in types)
    return windows if any(w is not None for w in windows) else ()


def _rope_from_hf(config: dict[str, Any]) -> tuple[float, dict | None]:
    # transformers >= 5 writes `rope_parameters` (theta inside); older configs have rope_theta + rope_scaling.
    params = config.get("rope_parameters")
    if isinstance(params, dict) and "rope_theta" in params:
        theta = float(params["rope_theta"])
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    else:
        theta = float(config.get("rope_theta", 10000.0))
        scaling = dict(config.get("rope_scaling") or {})
    rope_type = scaling.get("rope_type") or scaling.get("type") or "default"
    if rope_type not in _SUPPORTED_ROPE_TYPES:
        raise ValueError(f"unsupported rope scaling type {rope_type!r} (supported: {_SUPPORTED_ROPE_TYPES})")
    if rope_type == "default":
        return theta, None
    scaling["rope_type"] = rope_type
    scaling.pop("type", None)
    return theta, scaling


def _as_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _merge_ids(a: tuple[int, ...], b: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(dict.fromkeys(a + b))


def read_hf_folder_config(folder: str) -> tuple[dict[str, Any], dict[str, Any] | None]:
    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    gen_path = os.path.join(folder, "generation_config.json")
    generation = None
    if os.path.exists(gen_path):
        with open(gen_path) as f:
            generation = json.load(f)
    return config, generation


# GGUF architecture name -> HF architecture name.
_GGUF_ARCHS = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}


def arch_config_from_gguf(fields: dict[str, Any], tensor_names: set[str]) -> ArchConfig:
    """`fields` maps GGUF metadata keys to plain Python values."""
    gguf_arch = fields.get("general.architecture")
    if gguf_arch not in _GGUF_ARCHS:
        raise ValueError(f"unsupported GGUF architecture {gguf_arch!r} (supported: {sorted(_GGUF_ARCHS)})")

    def key(name: str, default: Any = None) -> Any:
        return fields.get(f"{gguf_arch}.{name}", default)

    num_heads = int(key("attention.head_count"))
    hidden = int(key("embedding_length"))
    num_kv_heads = key("attention.head_count_kv", num_heads)
    vocab = key("vocab_size") or len(fields.get("tokenizer.ggml.tokens", []))
    head_dim = key("attention.key_length") or key("rope.dimension_count") or hidden // num_heads
    rope_scaling = None
    if key("rope.scaling.type") == "linear":
        rope_scaling = {"rope_type": "linear", "factor": float(key("rope.scaling.factor"))}
    eos = fields.get("tokenizer.ggml.eos_token_id")
    return ArchConfig(
        architecture=_GGUF_ARCHS[gguf_arch],
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(key("feed_forward_length")),
        num_hidden_layers=int(key("block_count")),
        num_attention_heads=num_heads,
        num_key_value_heads=int(num_kv_heads),
        head_dim=int(head_dim),
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(key("rope.freq_base", 10000.0)),
        rope_scaling=rope_scaling,
        max_position_embeddings=int(key("context_length", 2048)),
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias=gguf_arch == "qwen2",
        qk_norm=gguf_arch == "qwen3",
        bos_token_id=fields.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=(int(eos),) if eos is not None else (),
    )

"""HF architecture name -> model class."""

from __future__ import annotations

from torch import nn

from kvserve.models.bloom import BloomForCausalLM
from kvserve.models.llama import LlamaForCausalLM
from kvserve.models.qwen2 import Qwen2ForCausalLM
from kvserve.models.qwen3 import Qwen3ForCausalLM

# Every class takes (ArchConfig, AttentionBackend, dtype) and offers load_weights, prepare_for_inference, forward
# and compute_logits as LlamaForCausalLM does.
MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "BloomForCausalLM": BloomForCausalLM,
}


def get_model_class(architecture: str) -> type[nn.Module]:
    try:
        return MODEL_REGISTRY[architecture]
    except KeyError:
        raise ValueError(f"unsupported architecture {architecture!r}; supported: {', '.join(MODEL_REGISTRY)}") from None

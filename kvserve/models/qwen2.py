"""Qwen2: the Llama decoder with biases on the q/k/v projections (ArchConfig.attention_bias)."""

from kvserve.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    pass

"""Qwen3: the Llama decoder with per-head RMSNorm on q and k before RoPE (ArchConfig.qk_norm), no biases,
and a head_dim that need not equal hidden_size / num_heads."""

from kvserve.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    pass

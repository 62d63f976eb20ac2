"""BLOOM (HF's BloomForCausalLM): the ALiBi model family.

Differences from the Llama decoder: no RoPE, each head's ALiBi slope passed to the attention backend instead
(kvserve/layers/alibi.py); LayerNorms with biases (and one right after the embedding); biases on every linear; a
non-gated 4x MLP with BLOOM's tanh GELU; the LM head tied to the embedding. Every head has its own KV head.

HF stores q/k/v as one `query_key_value` matrix interleaved per head ([num_heads, 3, head_dim] rows);
`load_weights` splits it into kvserve's q, k and v shards, which QKVParallelLinear then slices per rank like any
other model's. The slopes follow the rank's query heads. Checkpoints saved from the bare BloomModel (names without
the `transformer.` prefix, e.g. bigscience/bloom-560m) load too.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from kvserve.attention.base import AttentionBackend, KVCache
from kvserve.config import ArchConfig
from kvserve.distributed.parallel_state import get_tp_group
from kvserve.host_memory import LargeFloat32
from kvserve.layers.activation import BloomGelu
from kvserve.layers.alibi import alibi_slopes
from kvserve.layers.linear import Linear
from kvserve.layers.norm import LayerNorm
from kvserve.layers.parallel_linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from kvserve.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding, gather_logits
from kvserve.models.llama import load_fused_weights


class BloomAttention(nn.Module):
    def __init__(self, cfg: ArchConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.qkv_proj = QKVParallelLinear(
            cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads, bias=True
        )
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.head_dim = cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5
        self.dense = RowParallelLinear(
            cfg.num_attention_heads * cfg.head_dim, cfg.hidden_size, bias=True, input_slice=self.qkv_proj.q_input_slice
        )
        first = self.qkv_proj.heads.first_head
        slopes = alibi_slopes(cfg.num_attention_heads)[first : first + self.num_heads]
        # [num_heads] fp32, this rank's heads; a buffer so that it follows the model's device.
        self.register_buffer("alibi_slopes", slopes.contiguous().to(torch.get_default_device()), persistent=False)
        self.backend = backend
        # [kv_size]: subtracted from the keys with an fp8 cache (attention/key_centering.py), else None.
        self.k_offset: torch.Tensor | None = None

    def forward(self, x: torch.Tensor, kv_cache: KVCache, attn_metadata: Any) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.qkv_proj(x)  # [T, q_size + 2 * kv_size]
        q = qkv[:, : self.q_size].view(t, self.num_heads, self.head_dim)
        k = qkv[:, self.q_size : self.q_size + self.kv_size].view(t, self.num_kv_heads, self.head_dim)
        v = qkv[:, self.q_size + self.kv_size :].view(t, self.num_kv_heads, self.head_dim)
        if self.k_offset is not None:
            k.sub_(self.k_offset.view(self.num_kv_heads, self.head_dim))
        out = self.backend.forward(q, k, v, kv_cache, attn_metadata, self.scale, None, self.alibi_slopes)
        return self.dense(out)


class BloomMLP(nn.Module):
    def __init__(self, cfg: ArchConfig) -> None:
        super().__init__()
        self.dense_h_to_4h = ColumnParallelLinear(cfg.hidden_size, [cfg.intermediate_size], bias=True)
        self.gelu = BloomGelu()
        self.dense_4h_to_h = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dense_4h_to_h(self.gelu(self.dense_h_to_4h(x)))


class BloomBlock(nn.Module):
    def __init__(self, cfg: ArchConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.input_layernorm = LayerNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attention = BloomAttention(cfg, backend)
        self.post_attention_layernorm = LayerNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = BloomMLP(cfg)
        self.residual_post_layernorm = cfg.residual_post_layernorm

    def forward(self, x: torch.Tensor, kv_cache: KVCache, attn_metadata: Any) -> torch.Tensor:
        h = self.input_layernorm(x)
        x = self.self_attention(h, kv_cache, attn_metadata) + (h if self.residual_post_layernorm else x)
        h = self.post_attention_layernorm(x)
        return self.mlp(h) + (h if self.residual_post_layernorm else x)


class BloomModel(nn.Module):
    def __init__(self, cfg: ArchConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.word_embeddings = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.word_embeddings_layernorm = LayerNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.h = nn.ModuleList(BloomBlock(cfg, backend) for _ in range(cfg.num_hidden_layers))
        self.ln_f = LayerNorm(cfg.hidden_size, cfg.rms_norm_eps)


class BloomForCausalLM(nn.Module):
    def __init__(self, cfg: ArchConfig, backend: AttentionBackend, dtype: torch.dtype) -> None:
        super().__init__()
        self.config = cfg
        self.transformer = BloomModel(cfg, backend)
        self.tp = get_tp_group()
        self.lm_head = ParallelLMHead(cfg.hidden_size, cfg.vocab_size)
        self._to_float32 = LargeFloat32()  # a big batch's logits reuse one buffer (host_memory.py)
        if cfg.tie_word_embeddings:
            # Registered after `transformer`, so named_parameters() lists it once, as the embedding.
            self.lm_head.weight = self.transformer.word_embeddings.weight

    def prepare_for_inference(self) -> None:
        """After loading: pack every Linear for the CPU matmul kernels (a tied LM head gets its own packed copy)."""
        for module in self.modules():
            if isinstance(module, Linear):
                module.pack_for_cpu()

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T], unused: ALiBi needs only the attention's own key and query positions
        kv_caches: list[KVCache],
        attn_metadata: Any,
        layer_hooks: Any = None,
    ) -> torch.Tensor:
        """Returns the last layer's output before the final norm, [T, hidden] (`compute_logits` applies it);
        `layer_hooks` as in LlamaForCausalLM.forward."""
        x = self.transformer.word_embeddings_layernorm(self.transformer.word_embeddings(input_ids))
        for i, (layer, kv_cache) in enumerate(zip(self.transformer.h, kv_caches, strict=True)):
            if layer_hooks is not None:
                layer_hooks.before_layer(i)
            x = layer(x, kv_cache, attn_metadata)
            if layer_hooks is not None:
                layer_hooks.after_layer(i)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] (pre-norm) -> logits [N, vocab] in fp32."""
        logits = self._to_float32(self.lm_head(self.transformer.ln_f(hidden)))
        return gather_logits(logits, self.config.vocab_size, self.tp)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """HF BLOOM tensors into the parameters: `query_key_value` split into q/k/v, every parameter filled once."""
        tied = self.config.tie_word_embeddings
        load_fused_weights(
            self,
            self._split_qkv(weights),
            skip=lambda name: tied and name == "lm_head.weight",
            what=type(self).__name__,
        )

    def _split_qkv(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        cfg = self.config
        for name, tensor in weights:
            if not name.startswith(("transformer.", "lm_head.")):
                name = f"transformer.{name}"  # saved from the bare BloomModel
            if ".query_key_value." not in name:
                yield name, tensor
                continue
            # Rows [num_heads, 3, head_dim]: head h's q, k, v rows in turn.
            per_head = tensor.view(cfg.num_attention_heads, 3, cfg.head_dim, *tensor.shape[1:])
            for i, part in enumerate(("q_proj", "k_proj", "v_proj")):
                rows = per_head[:, i].reshape(cfg.num_attention_heads * cfg.head_dim, *tensor.shape[1:])
                yield name.replace(".query_key_value.", f".{part}."), rows

"""Llama-family decoder (Llama 2/3, SmolLM2, Mistral without sliding window), also the base of Qwen2/Qwen3.

Differences between the family members are flags on ArchConfig: `attention_bias` (Qwen2's q/k/v biases) and
`qk_norm` (Qwen3's per-head RMSNorm on q and k before RoPE). q/k/v and gate/up projections are fused into one
matmul each; `load_weights` maps HF tensor names onto the fused shards.

Tensor parallelism (kvserve/layers/parallel_linear.py): q/k/v and gate/up are column-parallel, o_proj and
down_proj row-parallel (one all-reduce each per layer), the embedding and LM head vocabulary-parallel. The layers
read the process's TP group when they are built; with a group of one they are plain linears. Each parameter loads
its own slice of a checkpoint tensor through its `weight_loader`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from kvserve.attention.base import AttentionBackend, KVCache
from kvserve.config import ArchConfig
from kvserve.distributed.parallel_state import get_tp_group
from kvserve.host_memory import LargeFloat32
from kvserve.kernels.cpu import load_cpu_kernels
from kvserve.layers.activation import SiluAndMul
from kvserve.layers.linear import Linear
from kvserve.layers.norm import QKNorm, RMSNorm
from kvserve.layers.parallel_linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    default_weight_loader,
)
from kvserve.layers.quant.int4_linear import Int4Linear
from kvserve.layers.quant.int8_linear import Int8Linear
from kvserve.layers.rotary import RotaryEmbedding
from kvserve.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding, gather_logits

logger = logging.getLogger(__name__)

# The linears whose `_panels` the C++ layer reads (not subclasses that compute differently).
_PANEL_LINEAR_TYPES = (QKVParallelLinear, RowParallelLinear, MergedColumnParallelLinear)


def _fused_linear_spec(m: nn.Module) -> list[torch.Tensor] | None:
    """A linear as the fused C++ layer takes it ([float or bf16 pair panels], or an int8 layer's panels, scales,
    column sums and rotation signs, or an int4 layer's packed blocks), or None where the fused layer cannot run it
    (no panels; sharded over ranks)."""
    if isinstance(m, (Int8Linear, Int4Linear)):
        return m.fused_spec() if m.impl == "cpu" else None
    if type(m) not in _PANEL_LINEAR_TYPES or m._panels is None or m.tp.world_size != 1:
        return None
    return [m._panels]


class LlamaAttention(nn.Module):
    def __init__(
        self, cfg: ArchConfig, backend: AttentionBackend, rotary: RotaryEmbedding, layer_index: int = 0
    ) -> None:
        super().__init__()
        self.qkv_proj = QKVParallelLinear(
            cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.attention_bias
        )
        # This rank's heads (all of them without tensor parallelism).
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.head_dim = cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5
        self.o_proj = RowParallelLinear(
            cfg.num_attention_heads * cfg.head_dim, cfg.hidden_size, bias=False, input_slice=self.qkv_proj.q_input_slice
        )
        self.qk_norm = cfg.qk_norm
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.qk_norm_op = QKNorm()
        self.rotary = rotary  # shared by all layers
        self.backend = backend
        self.sliding_window = cfg.sliding_window(layer_index)  # None: the whole context
        # [kv_size]: subtracted from the keys after RoPE with an fp8 cache (attention/key_centering.py), else None.
        self.k_offset: torch.Tensor | None = None

    def forward(self, positions: torch.Tensor, x: torch.Tensor, kv_cache: KVCache, attn_metadata: Any) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.qkv_proj(x)  # [T, q_size + 2 * kv_size]
        qk_size = self.q_size + self.kv_size
        if self.qk_norm:
            # Qwen3: per-head RMSNorm of q and k before RoPE, in place so RoPE can rotate them in place.
            self.qk_norm_op(qkv, self.q_norm, self.k_norm, self.num_heads, self.num_kv_heads)
        # The backend may rotate and write the new K/V in one launch (not with fp8 key centering in between).
        written = self.k_offset is None and self.backend.rotate_and_write(
            self.rotary, positions, qkv, self.num_heads, self.num_kv_heads, kv_cache, attn_metadata
        )
        if not written:
            self.rotary.rotate_(positions, qkv[:, :qk_size], self.num_heads + self.num_kv_heads)
        q = qkv[:, : self.q_size].view(t, self.num_heads, self.head_dim)
        k = qkv[:, self.q_size : qk_size].view(t, self.num_kv_heads, self.head_dim)
        v = qkv[:, qk_size:].view(t, self.num_kv_heads, self.head_dim)
        if self.k_offset is not None:
            k.sub_(self.k_offset.view(self.num_kv_heads, self.head_dim))
        extra: dict[str, Any] = {"kv_written": True} if written else {}
        out = self.backend.forward(q, k, v, kv_cache, attn_metadata, self.scale, self.sliding_window, **extra)
        return self.o_proj(out)


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ArchConfig) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(
            cfg.hidden_size, [cfg.intermediate_size, cfg.intermediate_size], bias=False
        )
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.down_proj.takes_silu_mul = True
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        # Batch 1 on a GPU, where it won at load: the SiLU-and-mul inside the down projection's GEMV launch (a
        # quantized down projection, swapped in after __init__, has no such path; isinstance, not a getattr that
        # would raise inside nn.Module for every layer of every step).
        down = self.down_proj
        fused = down.forward_silu_mul(gate_up) if isinstance(down, RowParallelLinear) else None
        return fused if fused is not None else down(self.act_fn(gate_up))


class LlamaDecoderLayer(nn.Module):
    # The whole layer in one C++ call where it can run (see `prepare_fused`); off while ops are timed one by one.
    use_fused = True

    def __init__(
        self, cfg: ArchConfig, backend: AttentionBackend, rotary: RotaryEmbedding, layer_index: int = 0
    ) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(cfg, backend, rotary, layer_index)
        self.mlp = LlamaMLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self._fused: tuple | None = None  # the C++ layer's fixed arguments, when it can run this layer

    def prepare_fused(self) -> None:
        """After packing: use kernels/csrc/decoder_layer.cpp for this layer if every op of it runs on the C++
        kernels with panel weights (fp32, bf16, int8 or int4), on one rank, without Qwen3's q/k norms. The C++ layer
        calls the same kernels in the same order, so results are bitwise the module path's."""
        attn, mlp = self.self_attn, self.mlp
        linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        # An EAGLE-1 head's layer has no input norm (spec_decode/eagle.py deletes it): the C++ layer then takes an
        # empty one and uses its input as it is.
        input_norm = getattr(self, "input_layernorm", None)
        post_norm = self.post_attention_layernorm
        ops = tuple(op for op in (input_norm, post_norm, attn.rotary, mlp.act_fn) if op is not None)
        layer = attn.backend.fused_layer()
        specs = [_fused_linear_spec(m) for m in linears]
        if (
            layer is None
            or any(spec is None for spec in specs)
            or attn.qk_norm
            or any(m.bias is not None for m in linears[1:])
            or any(op.impl != "cpu" for op in ops)
            or (input_norm is not None and input_norm.eps != post_norm.eps)
        ):
            self._fused = None
            return
        no_norm = post_norm.weight.new_empty(0)
        self._fused = (
            layer,
            [no_norm if input_norm is None else input_norm.weight, post_norm.weight],
            specs,
            attn.qkv_proj.bias,
            [m.out_features for m in linears] + [attn.num_heads, attn.num_kv_heads, attn.head_dim],
            post_norm.eps,
            attn,  # held here (not as a submodule) so that a step reads its attributes without nn.Module lookups
            attn.rotary,
        )

    def fused_args(self, attn_metadata: Any) -> tuple | None:
        """The step's own arguments for the C++ layer (the same for every layer), or None where the modules run."""
        if self._fused is None or not self.use_fused:
            return None
        return self.self_attn.backend.fused_layer_args(attn_metadata)

    def forward_fused(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        kv_cache: KVCache,
        fused_args: tuple,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        assert self._fused is not None
        layer, norms, linears, qkv_bias, sizes, eps, attn, rotary = self._fused
        slot_mapping, block_table, seq_lens, packed, hidden_keys, chunks = fused_args
        return layer(
            x,
            residual,
            norms,
            linears,
            qkv_bias,
            sizes,
            eps,
            positions,
            rotary.cos,
            rotary.sin,
            *kv_cache,
            slot_mapping,
            block_table,
            seq_lens,
            attn.scale,
            packed,
            attn.sliding_window or 0,
            attn.k_offset,
            hidden_keys,
            chunks,
        )

    def forward(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        kv_cache: KVCache,
        attn_metadata: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        fused_args = self.fused_args(attn_metadata)
        if fused_args is not None:
            return self.forward_fused(positions, x, residual, kv_cache, fused_args)
        if residual is None:
            residual = x
            x = self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, x, kv_cache, attn_metadata)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaModel(nn.Module):
    def __init__(self, cfg: ArchConfig, backend: AttentionBackend, dtype: torch.dtype) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
        rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling, dtype)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, backend, rotary, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ArchConfig, backend: AttentionBackend, dtype: torch.dtype) -> None:
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg, backend, dtype)
        self.tp = get_tp_group()
        self.lm_head = ParallelLMHead(cfg.hidden_size, cfg.vocab_size)
        self._to_float32 = LargeFloat32()  # a big batch's logits reuse one buffer (host_memory.py)
        self._all_fused = False  # every layer runs the C++ layer where it can (prepare_for_inference decides)
        self._stack: Any = None  # ... and then all of them in one call (_layer_stack)
        if cfg.tie_word_embeddings:
            # Registered after `model`, so named_parameters() lists it once, as model.embed_tokens.weight.
            self.lm_head.weight = self.model.embed_tokens.weight

    def prepare_for_inference(self) -> None:
        """After loading: pack every Linear for the CPU matmul kernels (a tied LM head gets its own packed copy;
        the embedding keeps the plain matrix for lookups)."""
        for module in self.modules():
            if isinstance(module, Linear):
                module.pack_for_cpu()
        for layer in self.model.layers:
            layer.prepare_fused()
        self._all_fused = all(layer._fused is not None for layer in self.model.layers)
        self._stack = self._layer_stack() if self._all_fused else None

    def _layer_stack(self) -> Any:
        """Every layer's fixed C++ arguments in one kernels.LlamaLayerStack (kernels/csrc/decoder_layer.h), so that
        a step crosses into C++ once rather than once per layer; None where the layers are not the CPU kernels'."""
        kernels = load_cpu_kernels()
        layers = self.model.layers
        if kernels is None or any(layer._fused[0] is not kernels.llama_decoder_layer for layer in layers):
            return None
        stack = kernels.LlamaLayerStack()
        for layer in layers:
            _, norms, linears, qkv_bias, sizes, eps, attn, rotary = layer._fused
            stack.add_layer(
                norms, linears, qkv_bias, sizes, eps, rotary.cos, rotary.sin, attn.scale, attn.sliding_window or 0
            )
        return stack

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: list[KVCache],
        attn_metadata: Any,
        layer_hooks: Any = None,
    ) -> torch.Tensor:
        """Returns the last layer's hidden states before the final norm, and the residual stream summed in:
        [T, hidden]. `compute_logits` applies the final norm only to the rows that are sampled. `layer_hooks`
        (the runner's KV I/O, worker/kv_io.py): `before_layer(i)` runs before layer i reads its KV cache and
        `after_layer(i)` once it has written it, so a KV connector's loads and saves overlap the other layers."""
        x = self.model.embed_tokens(input_ids)
        residual = None
        layers = self.model.layers
        fused_args = layers[0].fused_args(attn_metadata) if layer_hooks is None and self._all_fused else None
        if fused_args is not None:
            # Key offsets (fp8 caches) are set after loading and are not in the stack: per-layer calls then.
            if self._stack is not None and layers[0]._fused[6].k_offset is None:
                slot_mapping, block_table, seq_lens, packed, hidden_keys, chunks = fused_args
                x, residual = self._stack.forward(
                    x, positions, kv_caches, slot_mapping, block_table, seq_lens, packed, hidden_keys, chunks
                )
                return x + residual
            # Every layer in one C++ call each, without nn.Module's call path (~10 us a layer at batch 1).
            for layer, kv_cache in zip(layers, kv_caches, strict=True):
                x, residual = layer.forward_fused(positions, x, residual, kv_cache, fused_args)
            return x + residual
        for i, (layer, kv_cache) in enumerate(zip(self.model.layers, kv_caches, strict=True)):
            if layer_hooks is not None:
                layer_hooks.before_layer(i)
            x, residual = layer(positions, x, residual, kv_cache, attn_metadata)
            if layer_hooks is not None:
                layer_hooks.after_layer(i)
        return x + residual

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] (pre-norm) -> logits [N, vocab] in fp32."""
        logits = self._to_float32(self.lm_head(self.model.norm(hidden)))
        return gather_logits(logits, self.config.vocab_size, self.tp)

    # ------------------------------------------------------------------ weights

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors into the (fused) parameters; every parameter must be filled exactly once."""
        tied = self.config.tie_word_embeddings
        load_fused_weights(
            self,
            weights,
            skip=lambda name: "rotary_emb.inv_freq" in name or (tied and name == "lm_head.weight"),
            what=type(self).__name__,
        )


# HF name fragment -> (fused parameter fragment, shard index: q/k/v = 0/1/2, gate/up = 0/1)
_STACKED = {
    ".q_proj.": (".qkv_proj.", 0),
    ".k_proj.": (".qkv_proj.", 1),
    ".v_proj.": (".qkv_proj.", 2),
    ".gate_proj.": (".gate_up_proj.", 0),
    ".up_proj.": (".gate_up_proj.", 1),
}
_NUM_SHARDS = {".qkv_proj.": 3, ".gate_up_proj.": 2}


def load_fused_weights(
    module: nn.Module, weights: Iterable[tuple[str, torch.Tensor]], skip: Callable[[str], bool], what: str
) -> None:
    """Copy HF-named tensors into `module`'s parameters, q/k/v and gate/up into their fused ones, each through its
    `weight_loader` (which takes this rank's slice); every parameter (every shard of a fused one) must be filled.
    `skip(name)` drops checkpoint tensors the module has no use for."""
    params = dict(module.named_parameters())
    filled: set[str] = set()
    for name, tensor in weights:
        if skip(name):
            continue
        target, shard = name, None
        for frag, (fused, idx) in _STACKED.items():
            if frag in name:
                target, shard = name.replace(frag, fused), idx
                break
        param = params.get(target)
        if param is None:
            raise ValueError(f"checkpoint tensor {name!r} has no place in {what}")
        loader = getattr(param, "weight_loader", default_weight_loader)
        with torch.no_grad():
            try:
                loader(param, tensor, shard)
            except ValueError as e:
                raise ValueError(f"shape mismatch for {name}: {e}") from None
        filled.add(f"{target}#{shard}")
    missing = []
    for pname in params:
        shards = next((n for frag, n in _NUM_SHARDS.items() if frag in pname), None)
        if shards is None:
            missing += [pname] if f"{pname}#None" not in filled else []
        else:
            missing += [f"{pname}[{i}]" for i in range(shards) if f"{pname}#{i}" not in filled]
    if missing:
        more = " ..." if len(missing) > 8 else ""
        raise ValueError(f"checkpoint lacks weights for {what}: {', '.join(missing[:8])}{more}")

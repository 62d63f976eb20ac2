"""EAGLE proposer (Li et al. 2024, EAGLE-1 layout): one decoder layer that extrapolates the target's features.

The head sees, at position i, the embedding of token i + 1 and the target's last hidden state at i (after the
final norm): x = fc(concat(embedding, hidden)), then one Llama decoder layer whose input norm is absent (as in
the published checkpoints), and its output h'_i is both the predicted feature of position i + 1 and, through
the target's LM head (shared, no extra norm), the distribution of token i + 2. The embedding is the target's too.

Checkpoint layout (safetensors or pytorch_model.bin in a folder): `fc.weight` [hidden, 2 * hidden], optional
`fc.bias`, `layers.0.{self_attn.{q,k,v,o}_proj, mlp.{gate,up,down}_proj, post_attention_layernorm}.*`; a
`layers.0.input_layernorm.weight`, `embed_tokens.weight` or `lm_head.weight` there is ignored (the target's are
used). The layer has the target's shape (hidden size, heads, intermediate size).

Per target step: the head runs over the target's step positions with the inputs shifted by one (its KV mirrors
the target's, see kvserve.spec_decode.model_proposer); the row of each request's last accepted position gives the
first draft, and K - 1 single-token steps feed each draft back with the head's own output as the feature.
With `draft_vocab_size` the LM head of the drafts covers the most frequent tokens only (draft_vocab.py).
"""

from __future__ import annotations

import glob
import os
from collections.abc import Iterable, Iterator

import numpy as np
import torch
from torch import nn

from kvserve.attention.base import AttentionBackend, KVCache
from kvserve.config import ArchConfig
from kvserve.layers.linear import Linear
from kvserve.layers.quant.apply import quantize_linears
from kvserve.layers.rotary import RotaryEmbedding
from kvserve.loader.default_model import cache_dir
from kvserve.loader.safetensors_weights import iterate_safetensors
from kvserve.models.llama import LlamaDecoderLayer, LlamaForCausalLM, load_fused_weights
from kvserve.spec_decode.base import DraftProposal, DraftStepInputs
from kvserve.spec_decode.draft_vocab import DraftVocab
from kvserve.spec_decode.eagle_tree import propose_trees
from kvserve.spec_decode.model_proposer import ModelProposer

_IGNORED = ("layers.0.input_layernorm.weight", "embed_tokens.weight", "lm_head.weight")


def default_head_dir(model_name: str) -> str:
    """Where scripts/train_eagle_head.py puts the head it fits for an embedded model."""
    return os.path.join(cache_dir(), "eagle", model_name.lower())


class EagleHead(nn.Module):
    def __init__(self, cfg: ArchConfig, backend: AttentionBackend, dtype: torch.dtype, fc_bias: bool) -> None:
        super().__init__()
        self.config = cfg
        self.fc = Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=fc_bias)
        rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling, dtype)
        self.layers = nn.ModuleList([LlamaDecoderLayer(cfg, backend, rotary)])
        # EAGLE-1's first layer has no input norm: the fc output enters attention directly.
        del self.layers[0].input_layernorm

    def forward(
        self,
        embeds: torch.Tensor,  # [T, hidden] embeddings of the next tokens
        features: torch.Tensor,  # [T, hidden] target hidden states (after its final norm) or the head's own
        positions: torch.Tensor,  # [T]
        kv_cache: KVCache,
        attn_metadata: object,
    ) -> torch.Tensor:
        """-> [T, hidden] predicted features (the target's LM head turns them into logits)."""
        layer = self.layers[0]
        residual = self.fc(torch.cat([embeds, features.to(embeds.dtype)], dim=-1))
        fused_args = layer.fused_args(attn_metadata)
        if fused_args is not None:  # the C++ layer in one call (without an input norm), as the target's layers
            out, residual = layer.forward_fused(positions, residual, None, kv_cache, fused_args)
            return out + residual
        x = layer.self_attn(positions, residual, kv_cache, attn_metadata)
        x, residual = layer.post_attention_layernorm(x, residual)
        return layer.mlp(x) + residual

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        load_fused_weights(self, weights, skip=lambda n: n in _IGNORED or "rotary_emb" in n, what="the EAGLE head")


def iterate_head_checkpoint(folder: str) -> Iterator[tuple[str, torch.Tensor]]:
    if glob.glob(os.path.join(folder, "*.safetensors")):
        yield from iterate_safetensors(folder)
        return
    bins = sorted(glob.glob(os.path.join(folder, "*.bin")))
    if not bins:
        raise FileNotFoundError(f"no EAGLE head (*.safetensors or *.bin) in {folder}")
    for path in bins:
        yield from torch.load(path, map_location="cpu", weights_only=True).items()


def load_eagle_head(
    folder: str,
    cfg: ArchConfig,
    backend: AttentionBackend,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    quantization: str | None = None,
) -> EagleHead:
    """The head in `dtype`, or with int8 linears (`quantization` "int8", layers/quant/apply.py: the head reads its
    ~8 MB of layer weights four times in a tree step, half of that in int8)."""
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"EAGLE head folder {folder} does not exist")
    names = {name for name, _ in iterate_head_checkpoint(folder)}
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        # Built on its device, like the target (each op picks its implementation from the default device).
        with torch.device(device):
            head = EagleHead(cfg, backend, dtype, fc_bias="fc.bias" in names)
    finally:
        torch.set_default_dtype(prev)
    head.load_weights(iterate_head_checkpoint(folder))
    if quantization is not None:
        quantize_linears(head, quantization)
    for module in head.modules():
        if isinstance(module, Linear):
            module.pack_for_cpu()
    head.layers[0].prepare_fused()
    head.eval()
    head.requires_grad_(False)
    return head


class EagleProposer(ModelProposer):
    def __init__(
        self,
        head_dir: str,
        target: LlamaForCausalLM,
        backend: AttentionBackend,
        num_speculative_tokens: int,
        block_size: int,
        dtype: torch.dtype,
        max_model_len: int,
        generator: torch.Generator,
        device: torch.device,
        draft_vocab_size: int = 0,
        tree: tuple[int, int] | None = None,
        quantization: str | None = None,
    ) -> None:
        """`draft_vocab_size` > 0: the drafts' logits cover only that many most frequent tokens (draft_vocab.py;
        the counts file is in `head_dir`). `tree` = (depth, top_k): EAGLE-2 draft trees of at most
        `num_speculative_tokens` nodes (eagle_tree.py) instead of chains. `quantization` "int8": the head's
        linears and the draft vocabulary's LM head in int8 (SpeculativeConfig.quantization)."""
        self.tree = tree
        cfg = target.config
        self.head = load_eagle_head(head_dir, cfg, backend, dtype, device, quantization)
        self.target = target
        # The head has the target's attention shape, so the target's backend and step metadata serve it too.
        super().__init__(
            head_dir,
            num_speculative_tokens,
            backend,
            1,
            block_size,
            dtype,
            cfg.vocab_size,
            max_model_len,
            generator,
            device,
        )
        if draft_vocab_size:
            self.draft_vocab = DraftVocab(target, head_dir, draft_vocab_size, dtype, device, quantization)

    reads_target_hidden = True

    @property
    def mirror_gives_first_draft(self) -> bool:
        return True

    def mirror(self, step: DraftStepInputs, last_rows: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        batch = step.batch
        token_rows = np.repeat(step.rows, np.diff(step.query_start_loc))
        # Position i takes token i + 1: the next prompt token, or (after verification) the emitted one. Past a
        # request's last accepted position these are stale drafts; those positions are overwritten later.
        next_ids = batch.token_ids[token_rows, np.minimum(step.positions + 1, batch.max_model_len - 1)]
        embeds = self.target.model.embed_tokens(self.to_device(next_ids))
        features = self.target.model.norm(step.hidden)
        # A step replayed from a CUDA graph has its metadata in the graph's buffers only: build the eager one.
        md = step.attn_metadata if step.attn_metadata is not None else self.backend.build_metadata(step.attn_inputs)
        out = self.head(embeds, features, self.to_device(step.positions), self.kv_caches[0], md)
        last = out[self.to_device(last_rows)]
        return self._logits(last), last

    def _propose(self, step: DraftStepInputs) -> DraftProposal:
        if self.tree is None:
            return super()._propose(step)
        return propose_trees(self, step, *self.tree)

    def decode(
        self, token_ids: torch.Tensor, positions: np.ndarray, attn_metadata: object, features: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        assert features is not None
        embeds = self.target.model.embed_tokens(token_ids)
        out = self.head(embeds, features, self.to_device(positions), self.kv_caches[0], attn_metadata)
        return self._logits(out), out

    def draft_logits(self, features: torch.Tensor) -> torch.Tensor:
        """[A, V] fp32 logits of the head's predicted features (over the draft vocabulary's columns if set)."""
        return self._logits(features)

    def _logits(self, features: torch.Tensor) -> torch.Tensor:
        if self.draft_vocab is not None:
            return self.draft_vocab.logits(features)
        return self.target.lm_head(features).float()

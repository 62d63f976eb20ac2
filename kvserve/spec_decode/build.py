"""The proposer a SpeculativeConfig asks for."""

from __future__ import annotations

import torch

from kvserve.attention.base import AttentionBackend
from kvserve.config import SpeculativeConfig
from kvserve.models.llama import LlamaForCausalLM
from kvserve.spec_decode.base import Proposer
from kvserve.spec_decode.ngram import NgramProposer


def build_proposer(
    config: SpeculativeConfig,
    target: LlamaForCausalLM,
    backend: AttentionBackend,
    block_size: int,
    dtype: torch.dtype,
    max_model_len: int,
    generator: torch.Generator,
    device: torch.device,
) -> Proposer:
    """`block_size`: the target's KV pool's; a model proposer's own pool mirrors that pool's blocks, and is
    allocated when it is sized (ModelProposer.allocate_kv_cache)."""
    k = config.num_speculative_tokens
    if config.method == "ngram":
        return NgramProposer(k, config.prompt_lookup_min, config.prompt_lookup_max)
    assert config.draft is not None, "EngineArgs resolves the draft's config"
    if config.method == "draft_model":
        from kvserve.spec_decode.draft_model import DraftModelProposer

        return DraftModelProposer(config.draft, k, block_size, max_model_len, generator, config.draft_vocab_size)
    from kvserve.spec_decode.eagle import EagleProposer

    return EagleProposer(
        config.draft.path,
        target,
        backend,
        k,
        block_size,
        dtype,
        max_model_len,
        generator,
        device,
        config.draft_vocab_size,
        (config.tree_depth, config.tree_topk) if config.tree_depth is not None and config.tree_topk else None,
        config.quantization,
    )

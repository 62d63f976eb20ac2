"""Draft-model proposer: a smaller model of the same vocabulary drafts K tokens, one decode step each.

Per target step: one forward of the draft over the target's input tokens (its KV then mirrors the target's, see
kvserve.spec_decode.model_proposer), then K single-token steps starting from each request's last emitted token.
"""

from __future__ import annotations

import numpy as np
import torch

from kvserve.attention.selector import get_attn_backend
from kvserve.config import ModelConfig
from kvserve.loader.model_loader import load_model
from kvserve.spec_decode.base import DraftStepInputs
from kvserve.spec_decode.draft_vocab import DraftVocab
from kvserve.spec_decode.model_proposer import ModelProposer


class DraftModelProposer(ModelProposer):
    def __init__(
        self,
        draft_config: ModelConfig,
        num_speculative_tokens: int,
        block_size: int,
        max_model_len: int,
        generator: torch.Generator,
        draft_vocab_size: int = 0,
    ) -> None:
        """`draft_vocab_size` > 0: the drafts' logits cover only that many most frequent tokens (draft_vocab.py;
        the counts file is beside the draft model)."""
        arch = draft_config.arch
        dtype = getattr(torch, draft_config.dtype)
        # The draft config carries the target's device and attention backend choice (draft_model_config).
        device = torch.device(draft_config.device)
        backend = get_attn_backend(
            arch.num_attention_heads,
            arch.num_key_value_heads,
            arch.head_dim,
            dtype,
            device,
            draft_config.attention_backend,
        )
        self.model = load_model(draft_config, backend)
        super().__init__(
            draft_config.path,
            num_speculative_tokens,
            backend,
            arch.num_hidden_layers,
            block_size,
            dtype,
            arch.vocab_size,
            max_model_len,
            generator,
            device,
        )
        if draft_vocab_size:
            self.draft_vocab = DraftVocab(self.model, draft_config.path, draft_vocab_size, dtype, device)

    @property
    def mirror_gives_first_draft(self) -> bool:
        return False

    def mirror(self, step: DraftStepInputs, last_rows: np.ndarray) -> tuple[None, None]:
        # Only the KV is wanted: the last position's logits would predict the token the target already emitted.
        md = self.backend.build_metadata(step.attn_inputs)
        self.model(self.to_device(step.input_ids), self.to_device(step.positions), self.kv_caches, md)
        return None, None

    def decode(
        self, token_ids: torch.Tensor, positions: np.ndarray, attn_metadata: object, features: torch.Tensor | None
    ) -> tuple[torch.Tensor, None]:
        hidden = self.model(token_ids, self.to_device(positions), self.kv_caches, attn_metadata)
        if self.draft_vocab is not None:
            return self.draft_vocab.logits(self.model.model.norm(hidden)), None
        return self.model.compute_logits(hidden), None

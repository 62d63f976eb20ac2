"""The scheduler's side of speculative decoding: how many of a request's drafts to verify this step, and counters.

Verifying k drafts costs k more query tokens in the step. While a step is memory-bound (reading the weights
dominates) those tokens are nearly free, but past some number of tokens per step the forward becomes
compute-bound and every draft token costs its share; a rejected one is then pure loss. The adaptive rule
(measured on this CPU, figures in docs/benchmarks.md):

* a step verifies at most `draft_token_budget(num_decodes)` draft tokens in all: `FLAT_STEP_TOKENS` minus the
  decodes, so drafts only fill the part of the step that costs about the same as a plain decode step; from
  `FLAT_STEP_TOKENS` decodes on, no drafts at all;
* a request whose recent drafts were mostly rejected (acceptance EMA below `MIN_ACCEPTANCE`) gets a single draft
  token as a probe, so it can recover when its text becomes predictable again;
* the budget goes to requests in order of their acceptance EMA, best first.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvserve.config import SpeculativeConfig

# Query tokens per step up to which a forward costs about as much as one decode (see the module docstring).
FLAT_STEP_TOKENS = 32
MIN_ACCEPTANCE = 0.2
_EMA_WEIGHT = 0.3  # weight of the newest step in a request's acceptance EMA


@dataclass
class SpecDecodingStats:
    """Cumulative counters (vLLM's definitions): a draft is one request's drafts in one step."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per verified draft: accepted ones plus the one the target adds."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        per_pos = self.num_accepted_tokens_per_pos
        if len(per_pos) < num_draft_tokens:
            per_pos.extend([0] * (num_draft_tokens - len(per_pos)))
        for i in range(num_accepted):
            per_pos[i] += 1


class SpecDecodePolicy:
    """Decides each step how many of each request's proposed drafts are verified."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config

    def draft_token_budget(self, num_decodes: int) -> int:
        config = self.config
        if config.disable_by_batch_size is not None and num_decodes > config.disable_by_batch_size:
            return 0
        if not config.adaptive:
            return num_decodes * config.num_speculative_tokens
        return max(0, FLAT_STEP_TOKENS - num_decodes)

    def limit(self, acceptance_ema: float) -> int:
        """Most drafts for a request with this acceptance EMA (before the step budget)."""
        if self.config.adaptive and acceptance_ema < MIN_ACCEPTANCE:
            return 1
        return self.config.num_speculative_tokens

    @staticmethod
    def update_ema(ema: float, num_draft_tokens: int, num_accepted: int) -> float:
        return (1 - _EMA_WEIGHT) * ema + _EMA_WEIGHT * (num_accepted / num_draft_tokens)

"""The scheduler's side of speculative decoding: how many of a request's drafts to verify this step, and counters.

Verifying k drafts costs k more query tokens in the step. While a step is memory-bound (reading the weights
dominates) those tokens are nearly free, but past some number of tokens per step the forward becomes
compute-bound and every draft token costs its share; a rejected one is then pure loss. The adaptive rule
(measured on this CPU with scripts/measure_step_cost.py, figures in docs/benchmarks.md):

* the measured step cost is about b * (STEP_OVERHEAD_TOKENS + T) for T query tokens: a fixed part, then a near
  constant cost per query token, drafts or decodes alike (docs/benchmarks.md, "step cost"). With R
  decodes a draft token costs b and earns its acceptance probability times the step's cost per emitted token,
  b * (STEP_OVERHEAD_TOKENS + R) / R, so it pays only while the request's acceptance EMA exceeds
  `break_even_acceptance(R)` = R / (STEP_OVERHEAD_TOKENS + R): 0.05 at R = 1, 0.44 at 16, 0.76 at 64;
* a request under that (or under `MIN_ACCEPTANCE`) gets a single draft token as a probe, so it can recover when
  its text becomes predictable again, but only while probes are cheap (at most `PROBE_MAX_DECODES` decodes);
* a step verifies at most `draft_token_budget(num_decodes)` draft tokens in all: `FLAT_STEP_TOKENS` minus the
  decodes (a cap against long verification steps; from `FLAT_STEP_TOKENS` decodes on, no drafts at all);
* the budget goes to requests in order of their acceptance EMA, best first.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvserve.config import SpeculativeConfig

# Most query tokens (decodes + drafts) in a step that verifies drafts (see the module docstring).
FLAT_STEP_TOKENS = 32
# The fixed part of a step's cost in units of one query token's cost (docs/benchmarks.md, step cost).
STEP_OVERHEAD_TOKENS = 20
PROBE_MAX_DECODES = 4
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

    def limit(self, acceptance_ema: float, num_decodes: int = 1) -> int:
        """Most drafts for a request with this acceptance EMA in a step of `num_decodes` decodes (before the step
        budget)."""
        if not self.config.adaptive:
            return self.config.num_speculative_tokens
        if acceptance_ema >= max(MIN_ACCEPTANCE, break_even_acceptance(num_decodes)):
            return self.config.num_speculative_tokens
        return 1 if num_decodes <= PROBE_MAX_DECODES else 0

    @staticmethod
    def update_ema(ema: float, num_draft_tokens: int, num_accepted: int) -> float:
        return (1 - _EMA_WEIGHT) * ema + _EMA_WEIGHT * (num_accepted / num_draft_tokens)


def break_even_acceptance(num_decodes: int) -> float:
    """The acceptance rate at which a draft token's expected gain equals its cost, with this many decodes."""
    return num_decodes / (STEP_OVERHEAD_TOKENS + num_decodes)

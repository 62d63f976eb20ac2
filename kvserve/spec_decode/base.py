"""The proposer interface: after a step, propose up to k next tokens for each request that just sampled."""

from __future__ import annotations

from abc import ABC, abstractmethod

import numpy as np


class Proposer(ABC):
    @abstractmethod
    def propose(self, token_ids: np.ndarray, num_tokens: np.ndarray, rows: np.ndarray) -> list[list[int]]:
        """`token_ids` [max_reqs, max_len] holds every request's known tokens (prompt + output) in its row, the
        first `num_tokens[row]` valid. Returns, per entry of `rows`, at most k draft tokens (possibly none)."""

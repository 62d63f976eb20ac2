"""Prompt lookup (n-gram) proposer: find the last n tokens earlier in prompt + output, propose what followed.

n goes from prompt_lookup_max down to prompt_lookup_min, and the longest suffix that occurs earlier wins. Among
its occurrences the latest one is taken whose continuation has k tokens (the most recent context is the best
guess when a text is being copied or edited), else the latest one at all.

The whole batch is searched at once with numpy: for a window ending at e (exclusive),
match_n[e] = match_{n-1}[e] and tokens[e - n] == tokens[len - n], so each n costs one comparison over a
[rows, max_len] array, with no per-request Python loop.
"""

from __future__ import annotations

import numpy as np

from kvserve.spec_decode.base import DraftProposal, DraftStepInputs, Proposer


class NgramProposer(Proposer):
    def __init__(self, num_speculative_tokens: int, min_n: int, max_n: int) -> None:
        self.k = num_speculative_tokens
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, step: DraftStepInputs) -> DraftProposal:
        rows = step.rows[step.sample_idx]
        drafts = self.propose_rows(step.batch.token_ids, step.batch.num_tokens, rows)
        return DraftProposal(drafts, [None] * len(drafts), num_pass_requests=len(rows))

    def propose_rows(self, token_ids: np.ndarray, num_tokens: np.ndarray, rows: np.ndarray) -> list[list[int]]:
        """`token_ids` [max_reqs, max_len] holds every request's known tokens (prompt + output) in its row, the
        first `num_tokens[row]` valid. Returns, per entry of `rows`, at most k draft tokens (possibly none)."""
        if len(rows) == 0:
            return []
        lens = num_tokens[rows]  # [R]
        width = int(lens.max())
        tokens = token_ids[rows, :width]  # [R, W]
        r_idx = np.arange(len(rows))
        ends = np.arange(width)[None, :]  # [1, W] candidate window ends (exclusive)
        # A window must end before the suffix does (e <= len - 1) so that at least one token follows it.
        match = ends < lens[:, None]
        best_end = np.full(len(rows), -1, dtype=np.int64)
        k = self.k
        for n in range(1, self.max_n + 1):
            if n > width - 1:
                break
            suffix_tok = tokens[r_idx, np.maximum(lens - n, 0)]  # [R]
            shifted = np.zeros_like(match)
            # shifted[:, e] = tokens[:, e - n] == suffix_tok, for e >= n
            shifted[:, n:] = tokens[:, : width - n] == suffix_tok[:, None]
            match &= shifted
            match[lens < n + 1] = False  # the suffix itself needs n tokens plus an earlier window
            if n < self.min_n:
                continue
            found = match.any(axis=1)
            if not found.any():
                break  # longer suffixes cannot match where shorter ones do not
            full = match & (ends <= (lens - k)[:, None])
            last_full = _last_true(full)
            last_any = _last_true(match)
            best_end = np.where(found, np.where(last_full >= 0, last_full, last_any), best_end)

        drafts: list[list[int]] = []
        for i in range(len(rows)):
            e = int(best_end[i])
            drafts.append([] if e < 0 else tokens[i, e : min(e + k, int(lens[i]))].tolist())
        return drafts


def _last_true(mask: np.ndarray) -> np.ndarray:
    """[R, W] bool -> [R] index of the last True per row, -1 where none."""
    width = mask.shape[1]
    idx = width - 1 - np.argmax(mask[:, ::-1], axis=1)
    return np.where(mask.any(axis=1), idx, -1)

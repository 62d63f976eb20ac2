"""What a model proposer remembers about the requests the speculation policy leaves out of its pass.

A request at limit 0 is not run through the proposer, so the draft's KV misses the positions the target computes
meanwhile; when the request is given drafts again the proposer runs over them first (it "catches up"). For that
it needs, per request, the first position without draft KV and, for a proposer that reads the target's hidden
states (EAGLE), the target's hidden rows of the positions since: at most the last CATCH_UP_WINDOW of them, since
older positions are never caught up on (their stale draft KV costs acceptance, not correctness).

At batch 64 almost every request can be asleep, so the per-step record must not cost a Python loop and a tensor
copy per request: the state lives in arrays indexed by the request's InputBatch row (stable while the request is
in the runner), and the hidden rows of every sleeping request go into one ring buffer [rows, window, hidden] in a
single indexed copy per step. Per-request Python runs only when a request falls asleep, wakes up or leaves.

At batch 1 even that is too much: right after a forward pass the caches are cold, and each of the record's dozen
array operations then costs ~10-30 us (measured, kind A: the whole record ~100 us of a 5 ms step, against ~18 us
warm). So a step in which every request is asleep and decoding only keeps references to its arrays (`defer`), and
the records are written DEFER_STEPS steps at a time, back to back while warm, or before anything reads them.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

# Most positions a request left out of the pass catches up on when it is given drafts again (probes stay cheap).
CATCH_UP_WINDOW = 64
# Most all-asleep decode steps whose record waits (each holds its [R, hidden] rows: tens of KiB at batch 64).
DEFER_STEPS = 8


class SkippedPositions:
    """Per InputBatch row: the first position whose draft KV is missing (-1: none), and the ring of hidden rows."""

    def __init__(self, keep_hidden: bool, window: int = CATCH_UP_WINDOW) -> None:
        self.keep_hidden = keep_hidden
        self.window = window
        self._first = np.zeros(0, dtype=np.int64)
        self._ring: torch.Tensor | None = None  # [rows, window, hidden], allocated at the first skip
        self._row_of: dict[str, int] = {}  # requests with a record, to clear it when they leave
        # Steps waiting to be recorded: (states, rows, positions, hidden rows), one decode per request.
        self._deferred: list[tuple[list, np.ndarray, np.ndarray, torch.Tensor]] = []

    def defer(self, states: list, rows: np.ndarray, positions: np.ndarray, hidden: torch.Tensor) -> None:
        """Record a step in which every request decoded one token (token i is request i's, at positions[i]) and
        none ran through the proposer, later: see the module docstring. `states[i].req_id` names request i."""
        if self.keep_hidden and hidden.device.type != "cpu":
            hidden = hidden.clone()  # a device's step output may live in a buffer the next step reuses (CUDA graphs)
        self._deferred.append((states, rows, positions, hidden))
        if len(self._deferred) >= DEFER_STEPS:
            self.flush()

    def flush(self) -> None:
        """Write the deferred steps' records, oldest first."""
        if not self._deferred:
            return
        pending, self._deferred = self._deferred, []
        with torch.inference_mode():
            for states, rows, positions, hidden in pending:
                start = positions.astype(np.int64)
                self.remember(lambda i, s=states: s[i].req_id, rows, np.arange(len(rows)), start, start + 1, hidden)

    def any_behind(self, rows: np.ndarray) -> bool:
        self.flush()
        if not self._row_of:
            return False
        rows = rows[rows < len(self._first)]
        return bool((self._first[rows] >= 0).any())

    def all_recorded(self, rows: np.ndarray) -> bool:
        """Every one of `rows` has a record already (then, without hidden rows to keep, a step changes none)."""
        self.flush()
        if not self._row_of or not len(rows) or int(rows.max()) >= len(self._first):
            return False
        return bool((self._first[rows] >= 0).all())

    def remember(
        self,
        req_id: Callable[[int], str],  # the request id of entry i (looked up only for requests falling asleep)
        rows: np.ndarray,  # [A] InputBatch rows of the requests left out of this step's pass
        token_start: np.ndarray,  # [A] index of each one's first token in the step
        start: np.ndarray,  # [A] position of that token
        end: np.ndarray,  # [A] its computed count after the step (positions past it are computed again later)
        hidden: torch.Tensor,  # [T, hidden] the target's hidden rows of the step's tokens
    ) -> None:
        if self._deferred:
            self.flush()
        if not self.keep_hidden and self.all_recorded(rows):
            return  # every one asleep since an earlier step: its first missing position is kept already
        kept = np.flatnonzero(end > start)  # entries that computed something this step
        rows, token_start, start, end = rows[kept], token_start[kept], start[kept], end[kept]
        if not len(rows):
            return
        self._grow(int(rows.max()) + 1, hidden)
        first = self._first[rows]
        new = first < 0
        if new.any():
            for i in np.flatnonzero(new).tolist():
                self._row_of[req_id(int(kept[i]))] = int(rows[i])
            first[new] = start[new]
        if self.keep_hidden:
            assert self._ring is not None
            if int(end[-1] - start[-1]) == 1 and bool((end - start == 1).all()):
                # Decodes, the usual step at a large batch: one position each (this runs every step, so it
                # stays a handful of array operations).
                tokens, dst_rows, positions = token_start, rows, start
            else:
                # Only the last `window` positions of each request can be caught up on: write those (a ring slot
                # is written once per step, so the copy's order does not matter).
                lo = np.maximum(start, end - self.window)
                counts = end - lo
                offsets = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
                positions = np.repeat(lo, counts) + offsets
                tokens = np.repeat(token_start - start, counts) + positions
                dst_rows = np.repeat(rows, counts)
            flat = torch.from_numpy(dst_rows * self.window + positions % self.window).to(hidden.device)
            if int(tokens[-1] - tokens[0]) == len(tokens) - 1 and bool((np.diff(tokens) == 1).all()):
                src = hidden[int(tokens[0]) : int(tokens[-1]) + 1]  # consecutive rows (decodes come first)
            else:
                src = hidden[torch.from_numpy(tokens).to(hidden.device)]
            self._ring.view(-1, self._ring.shape[-1]).index_copy_(0, flat, src.to(self._ring.dtype))
            first = np.maximum(first, end - self.window)
        self._first[rows] = first

    def take(self, req_id: str, row: int, start: int) -> tuple[int, torch.Tensor | None] | None:
        """Clear the request's record as it is given drafts again; None when it has none, else (first position
        to catch up on, hidden rows of positions first..start-1 when kept). `start`: its first position in the
        step (every position before it was computed while it was left out, from the recorded one on)."""
        self.flush()
        if row >= len(self._first) or self._first[row] < 0:
            return None
        assert self._row_of.get(req_id) == row, (req_id, row)
        first = max(int(self._first[row]), start - self.window)
        self._clear(req_id, row)
        if not self.keep_hidden:
            return first, None
        assert self._ring is not None
        slots = torch.arange(first, start, device=self._ring.device) % self.window
        return first, self._ring[row, slots]

    def forget(self, req_id: str) -> None:
        self.flush()
        row = self._row_of.get(req_id)
        if row is not None:
            self._clear(req_id, row)

    def _clear(self, req_id: str, row: int) -> None:
        self._first[row] = -1
        self._row_of.pop(req_id, None)

    def _grow(self, num_rows: int, hidden: torch.Tensor) -> None:
        # Rows are handed out lowest first, so the highest row in use bounds what the ring needs.
        num_rows = max(8, 1 << (num_rows - 1).bit_length())
        if len(self._first) < num_rows:
            self._first = np.concatenate([self._first, np.full(num_rows - len(self._first), -1, dtype=np.int64)])
        if self.keep_hidden and (self._ring is None or self._ring.shape[0] < num_rows):
            ring = hidden.new_zeros((num_rows, self.window, hidden.shape[-1]))
            if self._ring is not None:
                ring[: self._ring.shape[0]] = self._ring
            self._ring = ring

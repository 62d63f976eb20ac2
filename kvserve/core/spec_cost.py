"""What speculation costs and earns, as pure functions of measured numbers (no torch, no engine state).

The speculation policy (core/spec_policy.py) asks two questions each step, and both are answered here:

* what a step costs: `StepCostModel`, a curve of the measured seconds of a decode-only target step against its
  number of query tokens T (decodes plus the drafts verified). On a CPU the curve is flat while a step is
  memory-bound (a few tokens at batch 1 cost what one does) and then rises about linearly; a step with R decodes
  costs f(R), and verifying k more drafts adds f(T + k) - f(T). The runner times each step and the proposer's
  passes and hands the seconds up as plain numbers (`outputs.SpecStepTiming`);
* whether k drafts pay: `best_num_drafts`. With per-position acceptance a_i (the chance that draft i is accepted
  when drafts 1..i-1 were), k drafts earn 1 + sum_{i<=k} prod(a_1..a_i) tokens for the request in the step. Their
  cost is the request's share of a plain step plus what proposing and verifying them adds; k is worth it only
  where tokens per second beat the plain step's 1 / share by a margin. A draft tree's size and depth are chosen the
  same way (`best_tree_shape`), from the expected accepted path of its best n nodes at each depth.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Sequence

_WINDOW = 9  # measurements of a step-cost bucket or a proposer cost that their median is taken over


def expected_tokens(acceptance: Sequence[float], num_drafts: int) -> float:
    """Tokens a request emits in a step that verifies `num_drafts` drafts: the bonus token plus each draft that
    is reached and accepted, 1 + sum_{i<=k} prod(a_1..a_i)."""
    total, reach = 1.0, 1.0
    for a in acceptance[:num_drafts]:
        reach *= a
        total += reach
    return total


def best_num_drafts(
    acceptance: Sequence[float], plain_seconds: float, extra_seconds: Sequence[float], margin: float
) -> int:
    """The number of drafts k in 0..len(extra_seconds) with the most expected tokens per second for one request.

    `acceptance[i]`: the chance that draft i + 1 is accepted after drafts 1..i were (at least len(extra_seconds)
    entries). `plain_seconds`: the request's share of a step without drafts. `extra_seconds[k - 1]`: what
    proposing and verifying k drafts adds to the step. k > 0 is chosen only where its rate beats the plain rate,
    1 / plain_seconds, by the factor 1 + margin (measurements are noisy; a loss is worse than a missed gain).
    """
    if plain_seconds <= 0:
        return 0
    best_k, best_rate = 0, (1.0 + margin) / plain_seconds
    total, reach = 1.0, 1.0
    for k, extra in enumerate(extra_seconds, start=1):
        reach *= acceptance[k - 1]
        total += reach
        rate = total / (plain_seconds + max(extra, 0.0))
        if rate > best_rate:
            best_k, best_rate = k, rate
    return best_k


def best_tree_shape(
    lengths: Sequence[Sequence[float]],
    plain_seconds: float,
    verify_seconds: Sequence[float],
    propose_seconds: Sequence[float],
    margin: float,
) -> tuple[int, int]:
    """The tree (n nodes, depth d) with the most expected tokens per second for one request, or (0, 0) for none.

    `lengths[d - 1][n - 1]`: the expected accepted path of the tree grown d levels deep and cut to its best n nodes,
    which earns 1 + that many tokens (a row may stop short of K where a depth holds fewer nodes);
    `verify_seconds[n - 1]`: what verifying n more rows adds to the step;
    `propose_seconds[d - 1]`: what growing a tree d levels deep costs (the expansions, whatever n). As in
    best_num_drafts, a tree is chosen only where its rate beats the plain rate by the factor 1 + margin."""
    if plain_seconds <= 0:
        return 0, 0
    best, best_rate = (0, 0), (1.0 + margin) / plain_seconds
    for d, (row, propose) in enumerate(zip(lengths, propose_seconds, strict=True), start=1):
        for n, (length, verify) in enumerate(zip(row, verify_seconds[: len(row)], strict=True), start=1):
            rate = (1.0 + length) / (plain_seconds + max(verify + propose, 0.0))
            if rate > best_rate:
                best, best_rate = (n, d), rate
    return best


def bucket(num_tokens: int) -> int:
    """The step-cost bucket of T query tokens: T itself up to 32, then 8 buckets per doubling."""
    if num_tokens <= 32:
        return num_tokens
    shift = num_tokens.bit_length() - 4
    return (num_tokens >> shift) << shift


class RecentMedian:
    """The median of the last `size` measurements, ignoring the very first one (a shape's first step pays for
    kernel selection and warm-up: tens of times the usual cost on a CPU). None until one is kept. A median,
    not a mean: one slow step (a page fault, another process) must not turn speculation off for long."""

    __slots__ = ("_samples", "_seen", "_value")

    def __init__(self, size: int = _WINDOW) -> None:
        self._samples: deque[float] = deque(maxlen=size)
        self._seen = 0
        self._value: float | None = None

    def add(self, x: float) -> None:
        self._seen += 1
        if self._seen == 1:
            return
        self._samples.append(x)
        ordered = sorted(self._samples)
        self._value = ordered[len(ordered) // 2]

    @property
    def value(self) -> float | None:
        return self._value


class StepCostModel:
    """Seconds of a decode-only target step as a function of its query tokens T, learnt from measured steps.

    Each bucket of T keeps the median of its recent seconds (T: the bucket's mean). `seconds(T)` interpolates
    linearly between the measured buckets, is flat below the smallest, and above the largest follows the slope
    of the two largest (never below 0), or T / T_max times the largest's cost while only one is measured (a
    compute-bound guess: pessimistic where the step is still flat, so the first probes, not the guess, find
    the flat part).
    """

    def __init__(self) -> None:
        self._buckets: dict[int, tuple[list[int], RecentMedian]] = {}
        self._points: list[tuple[float, float]] | None = []  # sorted (T, seconds), rebuilt lazily
        self._xs: list[float] = []  # their T, for bisect (the policy asks for ~10 costs a step)

    @property
    def empty(self) -> bool:
        return not self.points()

    def observe(self, num_tokens: int, seconds: float) -> None:
        if num_tokens <= 0 or seconds <= 0:
            return
        key = bucket(num_tokens)
        entry = self._buckets.get(key)
        if entry is None:
            entry = self._buckets[key] = ([0, 0], RecentMedian())
        tokens, secs = entry
        tokens[0] += num_tokens
        tokens[1] += 1
        secs.add(seconds)
        self._points = None

    def points(self) -> list[tuple[float, float]]:
        if self._points is None:
            pts = []
            for (total, count), secs in self._buckets.values():
                if secs.value is not None:
                    pts.append((total / count, secs.value))
            self._points = sorted(pts)
            self._xs = [p[0] for p in self._points]
        return self._points

    def seconds(self, num_tokens: float) -> float | None:
        """The estimated seconds of a decode-only step of `num_tokens` query tokens; None before any step."""
        pts = self.points()
        if not pts:
            return None
        xs = self._xs
        i = bisect.bisect_left(xs, num_tokens)
        if i < len(pts) and xs[i] == num_tokens:
            return pts[i][1]
        if i == 0:
            return pts[0][1]
        if i == len(pts):
            t_hi, s_hi = pts[-1]
            if len(pts) == 1:
                return s_hi * num_tokens / t_hi
            t_lo, s_lo = pts[-2]
            slope = max(0.0, (s_hi - s_lo) / (t_hi - t_lo))
            return s_hi + slope * (num_tokens - t_hi)
        (t0, s0), (t1, s1) = pts[i - 1], pts[i]
        return s0 + (s1 - s0) * (num_tokens - t0) / (t1 - t0)

    def measured_up_to(self) -> float:
        """The largest step size (query tokens) with a measured cost; 0 before any."""
        pts = self.points()
        return pts[-1][0] if pts else 0.0

    def extra_seconds(self, num_tokens: int, num_more: int) -> float | None:
        """What `num_more` query tokens add to a step of `num_tokens` (never below 0)."""
        base, more = self.seconds(num_tokens), self.seconds(num_tokens + num_more)
        if base is None or more is None:
            return None
        return max(0.0, more - base)


class ProposerCostModel:
    """The proposer's measured costs: per request it runs over in a step (a model proposer's pass over the
    step's tokens, which gives EAGLE its first draft; the n-gram search), and per draft token of its draft
    steps. None until measured."""

    def __init__(self) -> None:
        self.per_request = RecentMedian()
        self.per_draft_token = RecentMedian()

    def observe(self, pass_seconds: float, num_requests: int, draft_seconds: float, num_draft_tokens: int) -> None:
        if num_requests > 0:
            self.per_request.add(pass_seconds / num_requests)
        if num_draft_tokens > 0:
            self.per_draft_token.add(draft_seconds / num_draft_tokens)

    @property
    def measured(self) -> bool:
        return self.per_request.value is not None

    def seconds(self, num_drafts: int) -> float | None:
        """Proposing `num_drafts` drafts for one request (0 for none: the request is left out of the pass)."""
        if num_drafts == 0:
            return 0.0
        if self.per_request.value is None:
            return None
        return self.per_request.value + num_drafts * (self.per_draft_token.value or 0.0)

"""The scheduler's side of speculative decoding: how many drafts each request gets, and the counters.

The cost-aware policy (`adaptive`, the default) decides per step and per request how many drafts k (0..K) to
propose and verify, from three measured things (core/spec_cost.py):

* the request's acceptance: a moving average per draft position i of "draft i accepted, given drafts before it
  were" (positions not yet observed take the last observed one's value). A new request starts from the
  engine-wide average of every request's (PRIOR_ACCEPTANCE before any);
* the proposer's cost: seconds per request it runs over (a model proposer's pass over the step's tokens, which
  for EAGLE gives the first draft; the n-gram search) and per draft token of its draft steps;
* the target's step cost against its query tokens, from decode-only steps.

Each step the running requests are taken in order of first-position acceptance, best first; each gets the k
that maximises its expected tokens per second (`best_num_drafts`), with its verification charged at the step's size
so far (f(T + k) - f(T), T = decodes + drafts already given). A draft tree gets its best n nodes for the n that
maximises the same rate (`best_tree_size`): trees are flattened best node first (spec_decode/tree.py), so its
acceptance is kept per size, the expected accepted path of its best n nodes, learnt from each verified tree's
accepted path (`TreeAcceptance`), and its proposing costs what a whole tree's does whatever n. k = 0
leaves the request out of the proposer altogether (a model proposer catches up on its KV when the request is
given drafts again: see spec_decode/model_proposer.py), so a proposer that does not pay costs (almost) nothing.

Exploration: a request at k = 0 is probed with one draft (a whole tree with trees) once its probe interval has
passed (8 steps, doubling after each failed probe up to 256, back to 8 after an accepted one), so that one whose
text becomes predictable is tried again. Probes are paid from a credit that grows by `PROBE_BUDGET` of every
step's measured time and that each probe spends its estimated cost from, so exploration costs at most about that
share of throughput. Nobody is probed where no number of drafts would pay at the current batch size and costs even
if every draft were accepted (a tree at batch 8 or more on a small CPU): such a probe could never lead to a grant.

The limit the scheduler sends with step N (`SchedulerOutput.spec_draft_limits`) is what the proposer drafts
after N, and what step N + 1 verifies at most: the decision is made once, with the acceptance known when N is
scheduled. With `adaptive` off every request gets K every step (tests that need a fixed K).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvserve.config import SpeculativeConfig
from kvserve.core.spec_cost import ProposerCostModel, StepCostModel, best_num_drafts, best_tree_size

# Speculate only where expected tokens per second beat a plain step's by this factor (noise in the costs).
MARGIN = 0.05
# Share of the measured step time that probes of requests at k = 0 may cost, on average.
PROBE_BUDGET = 0.01
MIN_PROBE_INTERVAL = 8
# What a request is assumed to accept at each position before anything is observed.
PRIOR_ACCEPTANCE = 0.5
MAX_PROBE_INTERVAL = 256
# While every request is left out, the decision is taken again only this often (or at once when a request arrives
# or a verification is observed): sleeping requests' acceptance cannot change, only the measured costs drift.
QUIET_REDECIDE_INTERVAL = 8
_REQUEST_WEIGHT = 0.3  # weight of the newest verification in a request's acceptance
_ENGINE_WEIGHT = 0.05  # ... in the engine-wide acceptance that new requests start from


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


class Acceptance:
    """A chain's acceptance: moving averages of per-position acceptance, starting from a prior (PRIOR_ACCEPTANCE,
    or the engine-wide estimate); a position reached for the first time starts from the last observed position's
    value."""

    __slots__ = ("values", "num_observed", "weight")

    def __init__(self, k: int, weight: float, start: Acceptance | None = None) -> None:
        self.weight = weight
        self.values = start.effective(k) if start is not None else [PRIOR_ACCEPTANCE] * k
        self.num_observed = start.num_observed if start is not None else 0

    def effective(self, k: int) -> list[float]:
        n = self.num_observed
        if n == 0 or n >= k:
            return list(self.values[:k])
        return self.values[:n] + [self.values[n - 1]] * (k - n)

    def observe(self, num_drafts: int, num_accepted: int) -> None:
        """Drafts 1..num_accepted were accepted; draft num_accepted + 1 (if any) was rejected; later ones were
        never reached."""
        reached = min(num_drafts, num_accepted + 1)
        for i in range(reached):
            hit = 1.0 if i < num_accepted else 0.0
            if 0 < self.num_observed <= i:
                self.values[i] = self.values[self.num_observed - 1]
            self.values[i] = (1 - self.weight) * self.values[i] + self.weight * hit
        self.num_observed = max(self.num_observed, reached)


class TreeAcceptance:
    """A tree's acceptance: moving averages of the accepted path's length had the tree been cut to its best n
    nodes, n = 1..K. Nodes are in rank order and every path node comes after its parent, so the path that a cut to n
    nodes would have accepted is the verified path's nodes below index n: one verified tree of m nodes measures every
    size up to m. Sizes never measured keep their start (the engine-wide estimate, or PRIOR_ACCEPTANCE per level)."""

    __slots__ = ("values", "num_observed", "weight")

    def __init__(self, k: int, depth: int, weight: float, start: TreeAcceptance | None = None) -> None:
        self.weight = weight
        if start is not None:
            self.values, self.num_observed = list(start.values[:k]), start.num_observed
        else:
            self.values = [sum(PRIOR_ACCEPTANCE**d for d in range(1, min(n, depth) + 1)) for n in range(1, k + 1)]
            self.num_observed = 0

    def effective(self, k: int) -> list[float]:
        """Per size 1..k; never shorter for a larger tree (it holds the smaller one)."""
        out, best = [], 0.0
        for v in self.values[:k]:
            best = max(best, v)
            out.append(best)
        return out

    def observe(self, num_nodes: int, path: list[int]) -> None:
        """A tree of `num_nodes` nodes was verified and accepted `path` (node indices, root to leaf)."""
        w = self.weight
        for n in range(1, min(num_nodes, len(self.values)) + 1):
            accepted = sum(1 for j in path if j < n)
            self.values[n - 1] = (1 - w) * self.values[n - 1] + w * accepted
        self.num_observed = max(self.num_observed, num_nodes)


def accepted_nodes(draft_ids: list[int], parents: list[int], emitted: list[int]) -> list[int]:
    """The node indices of a verified tree's accepted path, from its tokens, its parents and the tokens the step
    emitted (the accepted ones, then the target's own): siblings are distinct tokens, so each emitted token names
    one child of the last accepted node."""
    path: list[int] = []
    node = -1
    for token in emitted[:-1]:
        child = [j for j, (t, p) in enumerate(zip(draft_ids, parents, strict=False)) if p == node and t == token]
        if not child:  # not a path of this tree (cannot happen): what was matched, rather than a failed step
            break
        node = child[0]
        path.append(node)
    return path


@dataclass
class SpecRequestState:
    """The policy's per-request state (kept on the scheduler's Request)."""

    acceptance: Acceptance | TreeAcceptance
    next_probe_step: int
    probe_interval: int = MIN_PROBE_INTERVAL
    limit: int = 0  # drafts granted with the last step: the proposer drafts this many, the next step verifies them
    probing: bool = False  # `limit` is a probe
    verifying_probe: bool = False  # the drafts the step verifies are a probe


class SpecDecodePolicy:
    """Decides each step how many drafts each request gets (see the module docstring)."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self.k = config.num_speculative_tokens
        # Drafts that can be accepted in one step: K for a chain, tree_depth for a tree of K nodes (its accepted
        # path is one root-to-leaf walk). A tree of n nodes is its best n (spec_decode/tree.py): it is grown with
        # the same expansions whatever n, so its proposing is costed as a whole tree's and only its verification
        # rows depend on n. Its probes are whole trees, which measure every size at once.
        self.tree = config.tree
        self.depth = config.tree_depth if config.tree_depth is not None else self.k
        self.probe_size = self.k if self.tree else 1
        self.step_cost = StepCostModel()
        self.proposer_cost = ProposerCostModel()
        self.engine_acceptance: Acceptance | TreeAcceptance = (
            TreeAcceptance(self.k, self.depth, _ENGINE_WEIGHT) if self.tree else Acceptance(self.k, _ENGINE_WEIGHT)
        )
        self._probe_credit = 0.0
        self._only_probes = False  # the last grant gave drafts to probes only
        # The proposer's part of the probe estimates the last grant took from the credit: what a probe-only step's
        # measured proposer seconds replace. (Their verification, in the next step, stays charged at its estimate.)
        self._charged = 0.0
        # (step id, number of requests) of the last decision that left every request out; None after any change.
        self._quiet: tuple[int, int] | None = None
        # (step id, number of requests) where _probe_can_pay last said no.
        self._probe_refused: tuple[int, int] | None = None

    def new_state(self, step_id: int) -> SpecRequestState:
        engine = self.engine_acceptance
        if isinstance(engine, TreeAcceptance):
            start: Acceptance | TreeAcceptance = TreeAcceptance(self.k, self.depth, _REQUEST_WEIGHT, engine)
        else:
            start = Acceptance(self.k, _REQUEST_WEIGHT, engine)
        # Nothing measured yet: probe at the first chance (only probes measure); else after the usual interval.
        first_probe = step_id if not self.proposer_cost.measured else step_id + MIN_PROBE_INTERVAL
        self._quiet = None
        return SpecRequestState(start, first_probe)

    # ------------------------------------------------------------------ decisions

    def grant(self, states: list[SpecRequestState], samples: list[bool], step_id: int) -> list[int]:
        """Set and return each running request's limit for the drafts proposed after this step. `samples[i]`:
        the request samples in this step (only those can be probed; the others keep their decision)."""
        k = self.k
        self._only_probes = False
        if self.config.disable_by_batch_size is not None and len(states) > self.config.disable_by_batch_size:
            for s in states:
                s.limit, s.probing = 0, False
            return [0] * len(states)
        if not self.config.adaptive:
            for s in states:
                s.limit, s.probing = k, False
            return [k] * len(states)
        limits = self._decide_quietly(states, step_id)
        due = []
        for i, (s, n) in enumerate(zip(states, limits, strict=True)):
            if n == 0 and s.limit > 0 and not s.probing:  # left out from now on: its first probe an interval later
                s.next_probe_step = step_id + s.probe_interval
            s.limit, s.probing = n, False
            if n == 0 and samples[i] and step_id >= s.next_probe_step:
                due.append(i)
        # Where only probes run the proposer after this step, the step's measured proposer seconds are what their
        # proposing cost (with a new shape's warm-up, which the medians leave out): observe_step swaps the proposer
        # part of the estimate charged here for them; their verification stays charged at its estimate (refunding
        # it too let a tree's 12-row probes spend ~2% of a batch-1 run against the 1% budget).
        # Each probe is charged its estimate as it is granted, so that many requests due at once (a batch that
        # arrived together) are probed a few per step, not all in one burst.
        regular = any(limits)
        self._only_probes = False
        self._charged = 0.0
        if due and (self._probe_credit < 0 or not self._probe_can_pay(len(states), step_id)):
            # Left due: they are probed once the credit allows and a probe could pay again (the batch shrinks, the
            # costs drift).
            due = []
        if due:
            due.sort(key=lambda i: states[i].next_probe_step)
            cost = self._probe_cost(len(states))
            propose_cost = self._probe_propose_cost()
            for i in due:
                if self._probe_credit < 0:
                    break
                states[i].limit, states[i].probing = self.probe_size, True
                states[i].next_probe_step = step_id + states[i].probe_interval
                limits[i] = self.probe_size
                # NOTE: only a step that runs probes and nothing else swaps its estimate for the measured seconds;
                # a step with no drafts at all still measures the sleeping proposer's bookkeeping (~0.3 ms for
                # EAGLE), which is no probe's cost: charged to the credit every step, it kept the credit negative
                # and a model proposer never probed, never measured, never turned on.
                self._only_probes = not regular
                if cost is None:
                    break  # nothing measured yet: one probe per step until something is
                self._probe_credit -= cost
                self._charged += propose_cost
        return limits

    def _decide_quietly(self, states: list[SpecRequestState], step_id: int) -> list[int]:
        """`decide`, skipped while every request has been left out for less than QUIET_REDECIDE_INTERVAL steps
        and nothing it depends on but the costs changed (at batch 1 a decision costs ~3% of a 5 ms step)."""
        quiet = self._quiet
        if quiet is not None and quiet[1] == len(states) and 0 <= step_id - quiet[0] < QUIET_REDECIDE_INTERVAL:
            return [0] * len(states)
        limits = self.decide([s.acceptance.effective(self.k) for s in states], len(states))
        measured = self.proposer_cost.measured and not self.step_cost.empty
        self._quiet = (step_id, len(states)) if measured and not any(limits) else None
        return limits

    def num_to_verify(self, state: SpecRequestState, num_proposed: int) -> int:
        """How many of the drafts proposed after the last step this step verifies: at most the limit granted."""
        n = min(num_proposed, state.limit)
        state.verifying_probe = state.probing and n > 0
        return n

    def decide(self, acceptance: list[list[float]], num_decodes: int) -> list[int]:
        """Drafts for each of `num_decodes` requests (acceptance[i]: request i's per-position estimate; a tree's:
        per size, TreeAcceptance), best acceptance first, each charged the verification cost at the step's size so
        far. 0 for all while the costs are not measured yet."""
        plain = self.step_cost.seconds(num_decodes)
        out = [0] * len(acceptance)
        if plain is None or not self.proposer_cost.measured or not acceptance:
            return out
        share = plain / num_decodes
        proposer = [self._propose_seconds(n) or 0.0 for n in range(self.k + 1)]
        num_tokens = num_decodes
        # A chain's first position bounds what it can earn; a tree's largest size does.
        first = -1 if self.tree else 0
        order = sorted(range(len(acceptance)), key=lambda i: -acceptance[i][first])
        extra: list[float] = []
        extra_at = -1  # the step size `extra` was computed for: it changes only where a request gets drafts
        # Requests with the same estimates get the same answer at the same step size (at batch 64 most requests
        # that failed the same probes have the same estimates): the estimates refused at the current size.
        refused: set[tuple[float, ...]] = set()
        for i in order:
            acc = acceptance[i] if self.tree else acceptance[i][: self.depth] + [0.0] * (self.k - self.depth)
            if acc[first] <= 0.0:
                break  # sorted: nobody after it can gain anything
            key = tuple(acc)
            if key in refused:
                continue  # refused already at this step size
            if extra_at != num_tokens:
                base = self.step_cost.seconds(num_tokens)
                assert base is not None
                extra = []
                for j in range(1, self.k + 1):
                    more = self.step_cost.seconds(num_tokens + j)
                    assert more is not None
                    extra.append(max(0.0, more - base) + proposer[j])
                extra_at = num_tokens
            if self.tree:
                n = best_tree_size(acc, share, extra, MARGIN)
            else:
                n = best_num_drafts(acc, share, extra, MARGIN)
            if n:
                out[i] = n
                num_tokens += n
                refused.clear()  # the step grew: the refusals were at its old size
            else:
                refused.add(key)
        return out

    def _probe_can_pay(self, num_decodes: int, step_id: int) -> bool:
        """Whether drafts could pay at this batch size even if every one were accepted: a probe that cannot lead to
        a grant only costs. (A 12-node tree at batch 8 or 64 on a 2-core CPU: its rows and drafting cost more than
        the request's five tokens at best are worth.) True while the costs are not measured: probes measure them.
        A "no" holds for QUIET_REDECIDE_INTERVAL steps at the same batch size (requests stay due meanwhile, and the
        answer moves only with the costs)."""
        refused = self._probe_refused
        if refused is not None and refused[1] == num_decodes and 0 <= step_id - refused[0] < QUIET_REDECIDE_INTERVAL:
            return False
        can = self._probe_could_pay(num_decodes)
        self._probe_refused = None if can else (step_id, num_decodes)
        return can

    def _probe_could_pay(self, num_decodes: int) -> bool:
        plain = self.step_cost.seconds(num_decodes)
        if plain is None or not self.proposer_cost.measured:
            return True
        share = plain / num_decodes
        for n in range(1, self.k + 1):
            verify, propose = self._probe_verify_seconds(num_decodes, n), self._propose_seconds(n)
            assert verify is not None and propose is not None
            if (1 + min(n, self.depth)) * share > (1.0 + MARGIN) * (share + verify + propose):
                return True
        return False

    def _probe_cost(self, num_decodes: int) -> float | None:
        """The estimated cost of one probe: proposing it (`_probe_propose_cost`) and verifying as many more tokens
        (a tree's: probe_size rows, which at batch 1 cost more than its drafting); None before measured."""
        verify = self._probe_verify_seconds(num_decodes, self.probe_size)
        if verify is None or self._propose_seconds(self.probe_size) is None:
            return None
        return verify + self._probe_propose_cost()

    def _probe_verify_seconds(self, num_decodes: int, num_more: int) -> float | None:
        """What verifying `num_more` drafts adds to a step of `num_decodes`, as a probe is charged: 0 beyond the
        measured steps, where the curve is a pessimistic guess (T / T_max times the largest): charged, it would hold
        the credit negative for hundreds of steps, and only probes measure such steps."""
        if num_decodes + num_more > self.step_cost.measured_up_to():
            return 0.0 if not self.step_cost.empty else None
        return self.step_cost.extra_seconds(num_decodes, num_more)

    def _propose_seconds(self, num_drafts: int) -> float | None:
        """Proposing `num_drafts` drafts for one request (0: none); a tree of any size costs a whole tree's, since it
        is grown with the same expansions whatever its size."""
        if num_drafts and self.tree:
            num_drafts = self.k
        return self.proposer_cost.seconds(num_drafts)

    def _probe_propose_cost(self) -> float:
        """The proposer's part of a probe: its pass (twice: it also catches up on the positions skipped while the
        request was left out) and one draft (a whole tree)."""
        return (self._propose_seconds(self.probe_size) or 0.0) + (self.proposer_cost.per_request.value or 0.0)

    # ------------------------------------------------------------------ measurements

    def observe_verification(
        self, state: SpecRequestState, num_drafts: int, num_accepted: int, path: list[int] | None = None
    ) -> None:
        """A step verified `num_drafts` of the request's drafts and accepted the first `num_accepted` (a tree:
        `num_drafts` nodes and the accepted path's node indices, `num_accepted` of them: `accepted_nodes`)."""
        self._quiet = None
        if isinstance(state.acceptance, TreeAcceptance):
            assert path is not None, "a tree's verification comes with its accepted path"
            state.acceptance.observe(num_drafts, path)
            assert isinstance(self.engine_acceptance, TreeAcceptance)
            self.engine_acceptance.observe(num_drafts, path)
        else:
            assert isinstance(state.acceptance, Acceptance) and isinstance(self.engine_acceptance, Acceptance)
            state.acceptance.observe(num_drafts, num_accepted)
            self.engine_acceptance.observe(num_drafts, num_accepted)
        if state.verifying_probe:
            state.verifying_probe = False
            # A chain's one-draft probe succeeds when its draft is accepted, a tree's when its path is one deep.
            accepted = num_accepted > 0 if self.tree else num_accepted == num_drafts
            state.probe_interval = MIN_PROBE_INTERVAL if accepted else min(2 * state.probe_interval, MAX_PROBE_INTERVAL)

    def observe_step(
        self,
        num_query_tokens: int,
        decode_only: bool,
        step_seconds: float,
        pass_seconds: float,
        num_pass_requests: int,
        draft_seconds: float,
        num_draft_tokens: int,
    ) -> None:
        """A step's measured seconds (the runner's: target step, proposer pass, proposer draft steps)."""
        if decode_only:
            self.step_cost.observe(num_query_tokens, step_seconds)
        self.proposer_cost.observe(pass_seconds, num_pass_requests, draft_seconds, num_draft_tokens)
        total = step_seconds + pass_seconds + draft_seconds
        if self._only_probes:
            self._probe_credit += self._charged - (pass_seconds + draft_seconds)
        self._charged = 0.0
        # Credit for probes, capped at one step's time so that probes after a quiet spell do not come in a burst.
        self._probe_credit = min(self._probe_credit + PROBE_BUDGET * total, max(total, 0.0))

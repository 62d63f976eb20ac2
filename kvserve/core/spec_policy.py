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
so far (f(T + k) - f(T), T = decodes + drafts already given). A draft tree gets the depth d and the best n nodes
that maximise the same rate (`best_tree_shape`): trees are flattened best node first (spec_decode/tree.py), so its
acceptance is kept per depth and size, the expected accepted path of its best n nodes when grown d levels deep,
learnt from each verified tree's accepted path (`TreeAcceptance`); growing it costs d - 1 expansions whatever n,
verifying it n rows. (On a 2-core CPU at batch 1 a third expansion cost ~0.6 ms of a ~7 ms tree step and bought
little: a fixed depth 3 beat depth 4 by 7%.) k = 0
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
from kvserve.core.spec_cost import ProposerCostModel, StepCostModel, best_num_drafts, best_tree_shape

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
    """A tree's acceptance: moving averages of the accepted path's length had the tree been grown d levels deep and
    cut to its best n nodes, per depth d = 1..D and size n = 1..K (`values[d - 1][n - 1]`).

    Nodes are in rank order and every path node comes after its parent, so a cut to n nodes would have accepted the
    verified path's nodes below index n. A tree grown d levels deep has the deeper tree's first d levels, ranked
    in the same order (spec_decode/tree.py), so it is the deeper tree's nodes of depth <= d, in order: one verified
    tree grown D deep measures, at each d <= D, every size up to its number of nodes of depth <= d. Sizes never
    measured keep their start (the engine-wide estimate, or PRIOR_ACCEPTANCE per level). A tree d deep has at most
    top_k + (d - 1) * top_k^2 nodes (top_k children of each of top_k frontier nodes per level): its row stops there."""

    __slots__ = ("values", "num_observed", "weight")

    def __init__(self, k: int, depth: int, top_k: int, weight: float, start: TreeAcceptance | None = None) -> None:
        self.weight = weight
        if start is not None:
            self.values = [list(row[:k]) for row in start.values[:depth]]
            self.num_observed = start.num_observed
        else:
            self.values = [
                [
                    sum(PRIOR_ACCEPTANCE**level for level in range(1, min(n, d) + 1))
                    for n in range(1, min(k, top_k + (d - 1) * top_k * top_k) + 1)
                ]
                for d in range(1, depth + 1)
            ]
            self.num_observed = 0

    def effective(self, k: int) -> list[list[float]]:
        """Per depth, per size 1..k (or fewer where the depth holds fewer nodes); never shorter for a larger tree of
        the same depth (it holds the smaller one)."""
        out = []
        for row in self.values:
            best, kept = 0.0, []
            for v in row[:k]:
                best = max(best, v)
                kept.append(best)
            out.append(kept)
        return out

    def observe(self, depths: list[int], path: list[int], grown_depth: int) -> None:
        """A tree grown `grown_depth` levels deep was verified: `depths` [N] its verified nodes' depths (1: a child
        of the root), in rank order; `path` the accepted node indices, root to leaf (node path[i] is at depth i + 1)."""
        w = self.weight
        for d in range(1, min(grown_depth, len(self.values)) + 1):
            row = self.values[d - 1]
            rank, shallow = {}, 0  # node -> its rank among the nodes of depth <= d
            for j, dj in enumerate(depths):
                if dj <= d:
                    rank[j] = shallow
                    shallow += 1
            ranks = [rank[j] for j in path[:d]]
            for n in range(1, min(shallow, len(row)) + 1):
                accepted = sum(1 for r in ranks if r < n)
                row[n - 1] = (1 - w) * row[n - 1] + w * accepted
        self.num_observed = max(self.num_observed, len(depths))


def node_depths(parents: list[int]) -> list[int]:
    """[N] each node's depth (1: a child of the root) from its parent indices, parents first."""
    depths: list[int] = []
    for p in parents:
        depths.append(1 if p < 0 else depths[p] + 1)
    return depths


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
    depth: int = 0  # a tree's: the levels granted with `limit` (the proposer grows its tree this deep)
    verified_depth: int = 0  # a tree's: the levels the tree this step verifies was grown to
    probing: bool = False  # `limit` is a probe
    verifying_probe: bool = False  # the drafts the step verifies are a probe


class SpecDecodePolicy:
    """Decides each step how many drafts each request gets (see the module docstring)."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self.k = config.num_speculative_tokens
        # Drafts that can be accepted in one step: K for a chain, tree_depth for a tree of K nodes (its accepted
        # path is one root-to-leaf walk). A tree of n nodes grown d levels deep is its best n (spec_decode/tree.py):
        # its proposing costs the d - 1 expansions whatever n, its verification n rows. Its probe is the largest
        # shape that could pay (`_probe_shape`; at batch 1 a whole tree), which measures every shape it holds.
        self.tree = config.tree
        self.depth = config.tree_depth if config.tree_depth is not None else self.k
        self.top_k = config.tree_topk or 1
        self.probe_size = self.k if self.tree else 1
        self.step_cost = StepCostModel()
        self.proposer_cost = ProposerCostModel()
        self.engine_acceptance: Acceptance | TreeAcceptance = (
            TreeAcceptance(self.k, self.depth, self.top_k, _ENGINE_WEIGHT)
            if self.tree
            else Acceptance(self.k, _ENGINE_WEIGHT)
        )
        self._probe_credit = 0.0
        self._only_probes = False  # the last grant gave drafts to probes only
        # The proposer's part of the probe estimates the last grant took from the credit: what a probe-only step's
        # measured proposer seconds replace. (Their verification, in the next step, stays charged at its estimate.)
        self._charged = 0.0
        # (step id, number of requests) of the last decision that left every request out; None after any change.
        self._quiet: tuple[int, int] | None = None
        # (step id, number of requests) where _probe_shape last said no.
        self._probe_refused: tuple[int, int] | None = None

    def new_state(self, step_id: int) -> SpecRequestState:
        engine = self.engine_acceptance
        if isinstance(engine, TreeAcceptance):
            start: Acceptance | TreeAcceptance = TreeAcceptance(self.k, self.depth, self.top_k, _REQUEST_WEIGHT, engine)
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
                s.limit, s.depth, s.probing = k, self.depth, False
            return [k] * len(states)
        limits, depths = self._decide_quietly(states, step_id)
        due = []
        for i, (s, n) in enumerate(zip(states, limits, strict=True)):
            if n == 0 and s.limit > 0 and not s.probing:  # left out from now on: its first probe an interval later
                s.next_probe_step = step_id + s.probe_interval
            s.limit, s.depth, s.probing = n, depths[i], False
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
        shape = self._probe_shape(len(states), step_id) if due and self._probe_credit >= 0 else None
        if shape is None:
            # Left due: they are probed once the credit allows and a probe could pay again (the batch shrinks, the
            # costs drift).
            due = []
        if due:
            assert shape is not None
            size, depth = shape
            due.sort(key=lambda i: states[i].next_probe_step)
            cost = self._probe_cost(len(states), size, depth)
            propose_cost = self._probe_propose_cost(depth)
            for i in due:
                if self._probe_credit < 0:
                    break
                states[i].limit, states[i].depth, states[i].probing = size, depth, True
                states[i].next_probe_step = step_id + states[i].probe_interval
                limits[i] = size
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

    def _decide_quietly(self, states: list[SpecRequestState], step_id: int) -> tuple[list[int], list[int]]:
        """`decide_shapes`, skipped while every request has been left out for less than QUIET_REDECIDE_INTERVAL
        steps and nothing it depends on but the costs changed (at batch 1 a decision costs ~3% of a 5 ms step)."""
        quiet = self._quiet
        if quiet is not None and quiet[1] == len(states) and 0 <= step_id - quiet[0] < QUIET_REDECIDE_INTERVAL:
            return [0] * len(states), [0] * len(states)
        limits, depths = self.decide_shapes([s.acceptance.effective(self.k) for s in states], len(states))
        measured = self.proposer_cost.measured and not self.step_cost.empty
        self._quiet = (step_id, len(states)) if measured and not any(limits) else None
        return limits, depths

    def num_to_verify(self, state: SpecRequestState, num_proposed: int) -> int:
        """How many of the drafts proposed after the last step this step verifies: at most the limit granted."""
        n = min(num_proposed, state.limit)
        state.verifying_probe = state.probing and n > 0
        state.verified_depth = state.depth
        return n

    def decide(self, acceptance: list, num_decodes: int) -> list[int]:
        """Drafts (a tree's nodes) for each request: `decide_shapes`' first part."""
        return self.decide_shapes(acceptance, num_decodes)[0]

    def decide_shapes(self, acceptance: list, num_decodes: int) -> tuple[list[int], list[int]]:
        """Drafts for each of `num_decodes` requests and, for trees, the levels to grow them to (0 for a chain or
        none). acceptance[i]: request i's per-position estimate; a tree's: per depth and size, TreeAcceptance.
        Requests go best acceptance first, each charged the verification cost at the step's size so far. 0 for all
        while the costs are not measured yet."""
        plain = self.step_cost.seconds(num_decodes)
        out = [0] * len(acceptance)
        depths = [0] * len(acceptance)
        if plain is None or not self.proposer_cost.measured or not acceptance:
            return out, depths
        share = plain / num_decodes
        if self.tree:
            grow = [self._tree_propose_seconds(d) or 0.0 for d in range(1, self.depth + 1)]
            # A tree's best is bounded by its largest size at any depth.
            bound = [max(row[-1] for row in acc) for acc in acceptance]
        else:
            proposer = [self._propose_seconds(n) or 0.0 for n in range(self.k + 1)]
            bound = [acc[0] for acc in acceptance]  # a chain's first position bounds what it can earn
        num_tokens = num_decodes
        order = sorted(range(len(acceptance)), key=lambda i: -bound[i])
        verify: list[float] = []
        verify_at = -1  # the step size `verify` was computed for: it changes only where a request gets drafts
        # Requests with the same estimates get the same answer at the same step size (at batch 64 most requests
        # that failed the same probes have the same estimates): the estimates refused at the current size.
        refused: set[tuple] = set()
        for i in order:
            if bound[i] <= 0.0:
                break  # sorted: nobody after it can gain anything
            acc = acceptance[i]
            key = tuple(map(tuple, acc)) if self.tree else tuple(acc)
            if key in refused:
                continue  # refused already at this step size
            if verify_at != num_tokens:
                base = self.step_cost.seconds(num_tokens)
                assert base is not None
                verify = []
                for j in range(1, self.k + 1):
                    more = self.step_cost.seconds(num_tokens + j)
                    assert more is not None
                    verify.append(max(0.0, more - base))
                verify_at = num_tokens
            if self.tree:
                n, depths[i] = best_tree_shape(acc, share, verify, grow, MARGIN)
            else:
                acc = acc[: self.depth] + [0.0] * (self.k - self.depth)
                n = best_num_drafts(acc, share, [v + p for v, p in zip(verify, proposer[1:], strict=True)], MARGIN)
            if n:
                out[i] = n
                num_tokens += n
                refused.clear()  # the step grew: the refusals were at its old size
            else:
                refused.add(key)
        return out, depths

    def _probe_shape(self, num_decodes: int, step_id: int) -> tuple[int, int] | None:
        """The probe to send, (drafts, a tree's depth), or None where no drafts could pay at this batch size even if
        every one were accepted: a probe that cannot lead to a grant only costs. A chain's probe is one draft; a
        tree's is the largest shape that could pay (a whole tree at batch 1; at batch 64 on a 2-core CPU, where 12
        rows and 3 expansions cost more than five tokens are worth, the few nodes one level holds), since one
        verified tree measures every shape it holds. A whole probe while the costs are not measured: probes measure
        them. A "no" holds for QUIET_REDECIDE_INTERVAL steps at the same batch size (requests stay due meanwhile,
        and the answer moves only with the costs)."""
        refused = self._probe_refused
        if refused is not None and refused[1] == num_decodes and 0 <= step_id - refused[0] < QUIET_REDECIDE_INTERVAL:
            return None
        shape = self._probe_could_pay(num_decodes)
        self._probe_refused = None if shape is not None else (step_id, num_decodes)
        return shape

    def _probe_could_pay(self, num_decodes: int) -> tuple[int, int] | None:
        whole = (self.probe_size, self.depth)
        plain = self.step_cost.seconds(num_decodes)
        if plain is None or not self.proposer_cost.measured:
            return whole
        share = plain / num_decodes
        verify = [self._probe_verify_seconds(num_decodes, n) or 0.0 for n in range(1, self.k + 1)]

        def pays(tokens: int, seconds: float | None) -> bool:
            assert seconds is not None
            return (1 + tokens) * share > (1.0 + MARGIN) * (share + seconds)

        if not self.tree:  # n drafts emit 1 + n at best
            could = any(
                pays(min(n, self.depth), verify[n - 1] + self._propose_seconds(n)) for n in range(1, self.k + 1)
            )
            return whole if could else None
        best = None
        for d in range(1, self.depth + 1):  # a tree of n nodes grown d deep emits 1 + min(n, d) at best
            grow = self._tree_propose_seconds(d) or 0.0
            cap = min(self.k, self.top_k + (d - 1) * self.top_k * self.top_k)
            for n in range(1, cap + 1):
                if pays(min(n, d), verify[n - 1] + grow):
                    best = (n, d)
        return best

    def _probe_cost(self, num_decodes: int, size: int | None = None, depth: int | None = None) -> float | None:
        """The estimated cost of one probe (`size` drafts, a tree grown `depth` deep; default a whole one): proposing
        it (`_probe_propose_cost`) and verifying as many more tokens (a tree's rows, which at batch 1 cost more than
        its drafting); None before measured."""
        verify = self._probe_verify_seconds(num_decodes, size or self.probe_size)
        if verify is None or not self.proposer_cost.measured:
            return None
        return verify + self._probe_propose_cost(depth)

    def _probe_verify_seconds(self, num_decodes: int, num_more: int) -> float | None:
        """What verifying `num_more` drafts adds to a step of `num_decodes`, as a probe is charged: 0 beyond the
        measured steps, where the curve is a pessimistic guess (T / T_max times the largest): charged, it would hold
        the credit negative for hundreds of steps, and only probes measure such steps."""
        if num_decodes + num_more > self.step_cost.measured_up_to():
            return 0.0 if not self.step_cost.empty else None
        return self.step_cost.extra_seconds(num_decodes, num_more)

    def _propose_seconds(self, num_drafts: int) -> float | None:
        """Proposing a chain of `num_drafts` drafts for one request (0: none)."""
        return self.proposer_cost.seconds(num_drafts)

    def _tree_propose_seconds(self, depth: int) -> float | None:
        """Growing one request's tree `depth` levels deep: the pass (which gives the first level) and depth - 1
        expansions, whatever its size (a tree proposer counts expansions as its draft tokens)."""
        cost = self.proposer_cost
        if cost.per_request.value is None:
            return None
        return cost.per_request.value + (depth - 1) * (cost.per_draft_token.value or 0.0)

    def _probe_propose_cost(self, depth: int | None = None) -> float:
        """The proposer's part of a probe: its pass (twice: it also catches up on the positions skipped while the
        request was left out) and one draft (a tree grown `depth` deep, default a whole one)."""
        one = self._tree_propose_seconds(depth or self.depth) if self.tree else self._propose_seconds(self.probe_size)
        return (one or 0.0) + (self.proposer_cost.per_request.value or 0.0)

    # ------------------------------------------------------------------ measurements

    def observe_verification(
        self,
        state: SpecRequestState,
        num_drafts: int,
        num_accepted: int,
        path: list[int] | None = None,
        depths: list[int] | None = None,
    ) -> None:
        """A step verified `num_drafts` of the request's drafts and accepted the first `num_accepted` (a tree:
        `num_drafts` nodes, the accepted path's node indices, `num_accepted` of them (`accepted_nodes`), and the
        verified nodes' depths (`node_depths`))."""
        self._quiet = None
        if isinstance(state.acceptance, TreeAcceptance):
            assert path is not None and depths is not None, "a tree's verification comes with its path and depths"
            grown = state.verified_depth or self.depth
            state.acceptance.observe(depths, path, grown)
            assert isinstance(self.engine_acceptance, TreeAcceptance)
            self.engine_acceptance.observe(depths, path, grown)
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

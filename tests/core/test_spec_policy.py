"""The speculation policy's decisions as pure functions: plain numbers in, a number of drafts out."""

from __future__ import annotations

import pytest

from kvserve.config import SpeculativeConfig
from kvserve.core.spec_cost import StepCostModel, best_num_drafts, bucket, expected_tokens
from kvserve.core.spec_policy import (
    MAX_PROBE_INTERVAL,
    MIN_PROBE_INTERVAL,
    PRIOR_ACCEPTANCE,
    PROBE_BUDGET,
    QUIET_REDECIDE_INTERVAL,
    Acceptance,
    SpecDecodePolicy,
    TreeAcceptance,
    accepted_nodes,
)

K = 4
MS = 1e-3


def test_expected_tokens_is_one_plus_the_sum_of_prefix_products():
    assert expected_tokens([0.5, 0.5, 0.5], 0) == 1.0
    assert expected_tokens([0.5, 0.5, 0.5], 2) == 1.0 + 0.5 + 0.25
    assert expected_tokens([0.9, 0.0, 1.0], 3) == pytest.approx(1.9)  # nothing after a sure rejection counts


def test_best_num_drafts_at_batch_1_memory_bound():
    """Batch 1 on a CPU: verifying is nearly free (0.1 ms a draft against a 17.5 ms step)."""
    flat = [0.1 * MS * k for k in range(1, K + 1)]
    assert best_num_drafts([0.8] * K, 17.5 * MS, flat, 0.05) == 4  # copy-heavy text: all K
    assert best_num_drafts([0.0] * K, 17.5 * MS, flat, 0.05) == 0  # nothing accepted: none
    assert best_num_drafts([0.04] * K, 17.5 * MS, flat, 0.05) == 0  # gain under the margin: none
    # A model proposer at 4 ms a draft: 1 draft earns 1.4 tokens in 21.6 ms (0.0648/ms) against 1.05 / 17.5 ms
    # (0.060/ms) needed; 2 drafts 1.56 in 25.7 ms (0.0607/ms): one draft is best.
    eagle = [(0.1 + 4.0) * MS * k for k in range(1, K + 1)]
    assert best_num_drafts([0.4] * K, 17.5 * MS, eagle, 0.05) == 1
    assert best_num_drafts([0.25] * K, 17.5 * MS, eagle, 0.05) == 0  # 1.25 / 21.6 ms = 0.058/ms: under 0.06


def test_best_num_drafts_at_batch_64_compute_bound():
    """Batch 64: a plain step's share is 1 ms per request and each verified draft costs 0.8 ms more."""
    costs = [0.8 * MS * k for k in range(1, K + 1)]
    assert best_num_drafts([0.5] * K, 1.0 * MS, costs, 0.05) == 0  # 1.5 / 1.8 ms < 1.05 / 1 ms
    assert best_num_drafts([0.9] * K, 1.0 * MS, costs, 0.05) == 1  # 1.9 / 1.8 ms = 1.056 / ms
    assert best_num_drafts([0.99] * K, 1.0 * MS, costs, 0.05) == 4


def test_step_cost_curve_interpolates_and_extrapolates():
    m = StepCostModel()
    m.observe(8, 500 * MS)  # a shape's first step (warm-up) is ignored
    assert m.seconds(8) is None and m.extra_seconds(8, 1) is None
    m.observe(8, 20 * MS)
    assert m.seconds(16) == pytest.approx(40 * MS)  # one point: compute-bound guess (pessimistic)
    assert m.seconds(1) == pytest.approx(20 * MS)  # flat below the smallest measured
    m.observe(16, 26 * MS)
    m.observe(16, 26 * MS)
    assert m.seconds(12) == pytest.approx(23 * MS)
    assert m.seconds(24) == pytest.approx(32 * MS)  # the slope of the last two, 0.75 ms a token
    assert m.extra_seconds(8, 8) == pytest.approx(6 * MS)
    m.observe(17, 20 * MS)
    m.observe(17, 20 * MS)  # noise: a falling curve never gives negative extra costs
    for _ in range(4):
        m.observe(8, 20 * MS)
    for _ in range(4):
        m.observe(8, 200 * MS)  # a slow spell: the median of the last 9 holds until it is most of them
    assert m.seconds(8) == pytest.approx(20 * MS)
    assert m.extra_seconds(17, 10) == 0.0
    assert [bucket(t) for t in (1, 32, 33, 40, 63, 64, 71, 72, 300)] == [1, 32, 32, 40, 60, 64, 64, 72, 288]


def test_acceptance_per_position_counts_only_the_drafts_reached():
    a = Acceptance(K, weight=0.5)
    assert a.effective(K) == [PRIOR_ACCEPTANCE] * K  # nothing known
    a.observe(4, 1)  # draft 1 accepted, draft 2 rejected, 3 and 4 never reached
    assert a.num_observed == 2 and a.effective(K) == [0.75, 0.25, 0.25, 0.25]
    a.observe(4, 4)
    # Positions 3 and 4 start from position 2's estimate (0.625) the first time they are reached.
    assert a.effective(K) == [0.875, 0.625, 0.8125, 0.8125]
    started = Acceptance(K, weight=0.3, start=a)  # a new request starts from the engine's estimate
    assert started.effective(K) == [0.875, 0.625, 0.8125, 0.8125]


def _measured_policy(config: SpeculativeConfig, plain_ms: float, per_token_ms: float, propose_ms: float):
    policy = SpecDecodePolicy(config)
    for t in (1, 1, 2, 2, 8, 8, 16, 16, 64, 64, 128, 128):  # each bucket's first measurement is ignored
        policy.observe_step(t, True, (plain_ms + per_token_ms * t) * MS, propose_ms * MS, 1, 0.0, 0)
    return policy


def test_grant_gives_k_to_good_requests_and_probes_bad_ones_within_the_budget():
    # A proposer pass of 5 ms a request: a probe costs ~10 ms, ~60 steps of the 1% probe budget.
    policy = _measured_policy(SpeculativeConfig("ngram", K), 17.0, 0.01, 5.0)
    good, bad = policy.new_state(0), policy.new_state(0)
    for _ in range(5):
        policy.observe_verification(good, K, K)
        policy.observe_verification(bad, 1, 0)
    # `good` raised the engine-wide estimate that new requests start from; `bad` has its own, and its first probe
    # comes MIN_PROBE_INTERVAL steps after its arrival (costs are measured, so no probe at once).
    for step in range(MIN_PROBE_INTERVAL):
        assert policy.grant([good, bad], [True, True], step) == [K, 0]
    assert policy.grant([good, bad], [True, True], MIN_PROBE_INTERVAL) == [K, 1]
    assert bad.probing and policy.num_to_verify(bad, 3) == 1 and bad.verifying_probe
    policy.observe_verification(bad, 1, 0)  # the probe fails: the interval doubles for the one after next
    assert bad.probe_interval == 2 * MIN_PROBE_INTERVAL and bad.next_probe_step == 2 * MIN_PROBE_INTERVAL
    # Due again, but the credit (1% of each step's time) has not paid for the last probe yet.
    assert policy.grant([good, bad], [True, True], 2 * MIN_PROBE_INTERVAL) == [K, 0]
    for _ in range(60):
        policy.observe_step(2 + K, True, 17.1 * MS, 10.0 * MS, 2, 0.0, 0)
    assert policy.grant([good, bad], [True, True], 2 * MIN_PROBE_INTERVAL + 1) == [K, 1]
    assert policy.grant([good, bad], [True, False], 5 * MIN_PROBE_INTERVAL) == [K, 0]  # probes only those that sample
    for _ in range(10):  # failed probes, one after another
        bad.limit, bad.probing = 1, True
        policy.num_to_verify(bad, 1)
        policy.observe_verification(bad, 1, 0)
    assert bad.probe_interval == MAX_PROBE_INTERVAL


def test_batch_size_turns_speculation_off_where_verification_costs():
    """The same acceptance pays at batch 1 and not at batch 64 on a compute-bound curve."""
    policy = _measured_policy(SpeculativeConfig("ngram", K), 16.0, 0.8, 0.01)
    assert policy.decide([[0.6] * K], 1) == [K]
    assert policy.decide([[0.6] * K] * 64, 64) == [0] * 64
    # Verification is charged at the step's size so far: the best request gets its drafts first, and the next
    # one fewer (at 7 query tokens its 4th draft would cost 0.8 ms for 0.13 expected tokens).
    assert policy.decide([[0.6] * K, [0.97] * K, [0.0] * K], 3) == [3, K, 0]


def test_fixed_k_and_disable_by_batch_size():
    fixed = SpecDecodePolicy(SpeculativeConfig("ngram", K, adaptive=False))
    states = [fixed.new_state(0) for _ in range(3)]
    assert fixed.grant(states, [True] * 3, 0) == [K] * 3
    capped = SpecDecodePolicy(SpeculativeConfig("ngram", K, adaptive=False, disable_by_batch_size=2))
    assert capped.grant([capped.new_state(0) for _ in range(3)], [True] * 3, 0) == [0] * 3


def test_probes_alone_are_charged_their_measured_seconds():
    """Where only probes run the proposer, the step's measured proposer seconds (a new shape's warm-up included,
    which the medians leave out) come off the probe credit: a 200 ms probe pays for itself only after 200 ms / 1%
    = 20 s of steps."""
    policy = _measured_policy(SpeculativeConfig("ngram", K), 17.0, 0.01, 1.0)
    bad = policy.new_state(0)
    for _ in range(5):
        policy.observe_verification(bad, 1, 0)
    assert policy.grant([bad], [True], MIN_PROBE_INTERVAL) == [1]
    policy.observe_step(1, True, 17 * MS, 200 * MS, 1, 0.0, 0)
    bad.next_probe_step = 0  # due at every step from now on
    granted = [policy.grant([bad], [True], step)[0] for step in range(100)]
    for _ in range(100):
        policy.observe_step(1, True, 17 * MS, 0.0, 0, 0.0, 0)
    assert granted == [0] * 100
    assert policy.grant([bad], [True], 1000) == [0]  # 100 steps of 17 ms earned 17 ms of the 200


def test_a_sleeping_proposers_bookkeeping_is_not_charged_to_the_probes():
    """Steps that grant no drafts at all still measure a model proposer's pass (it records the positions it
    skips, ~0.3 ms for EAGLE): that is no probe's cost, so the credit keeps growing and the next due probe runs."""
    policy = _measured_policy(SpeculativeConfig("eagle", K), 17.0, 0.01, 1.0)
    bad = policy.new_state(0)
    for _ in range(5):
        policy.observe_verification(bad, 1, 0)
    bad.next_probe_step = 300
    for step in range(300):  # not due yet: nothing granted, 300 x 0.3 ms = 90 ms of bookkeeping
        assert policy.grant([bad], [True], step) == [0]
        policy.observe_step(1, True, 17 * MS, 0.3 * MS, 0, 0.0, 0)
    assert policy._probe_credit > 0
    assert policy.grant([bad], [True], 300) == [1]


def test_a_quiet_decision_is_reused_until_something_it_depends_on_changes():
    """While every request is left out, grant reuses that decision for QUIET_REDECIDE_INTERVAL steps (only the
    costs can drift meanwhile); an observed verification or a new request makes it decide again at once."""
    policy = _measured_policy(SpeculativeConfig("ngram", K), 17.0, 0.01, 20.0)  # a 20 ms proposer never pays
    state = policy.new_state(0)
    state.next_probe_step = 10_000  # no probes in this test
    assert policy.grant([state], [True], 0) == [0]
    cheap = _measured_policy(SpeculativeConfig("ngram", K), 17.0, 0.01, 0.01)
    policy.proposer_cost = cheap.proposer_cost  # now drafts would pay: seen at the next decision only
    for step in range(1, QUIET_REDECIDE_INTERVAL):
        assert policy.grant([state], [True], step) == [0]
    assert policy.grant([state], [True], QUIET_REDECIDE_INTERVAL) == [K]
    # Quiet again (an expensive proposer), then a verification: decided again at the next step.
    policy.proposer_cost = _measured_policy(SpeculativeConfig("ngram", K), 17.0, 0.01, 20.0).proposer_cost
    assert policy.grant([state], [True], 20) == [0]
    policy.proposer_cost = cheap.proposer_cost
    assert policy.grant([state], [True], 21) == [0]
    policy.observe_verification(state, K, K)
    assert policy.grant([state], [True], 22) == [K]
    # ... and so does a new request.
    policy = _measured_policy(SpeculativeConfig("ngram", K), 17.0, 0.01, 20.0)
    state = policy.new_state(0)
    state.next_probe_step = 10_000
    assert policy.grant([state], [True], 0) == [0]
    policy.proposer_cost = cheap.proposer_cost
    assert policy.grant([state], [True], 1) == [0]
    other = policy.new_state(2)
    other.next_probe_step = 10_000
    assert policy.grant([state, other], [True, True], 2) == [K, K]


def test_a_trees_acceptance_is_learnt_per_depth_and_size_from_its_accepted_path():
    """Nodes are in rank order, so a tree cut to its best n nodes would have accepted the verified path's nodes
    below n; a tree grown d levels deep is the deeper tree's nodes of depth <= d in the same order. One verified
    tree of 8 nodes grown 3 deep with path 0 -> 2 -> 5 measures every size at depths 1 to 3."""
    acc = TreeAcceptance(8, 4, 4, 1.0)  # weight 1: the values are the last observation
    assert acc.values[3][:5] == pytest.approx([0.5, 0.75, 0.875, 0.9375, 0.9375])  # the prior, per level reached
    assert acc.values[0] == [0.5] * 4  # one level holds top_k = 4 nodes at most
    depths = [1, 1, 2, 1, 2, 3, 2, 3]
    acc.observe(depths, [0, 2, 5], 3)
    assert acc.values[2] == [1, 1, 2, 2, 2, 3, 3, 3]
    # Depth 2 holds nodes 0 1 2 3 4 6 (ranks 0-5): the path's first two nodes are ranks 0 and 2; sizes 7 and 8 of
    # a depth-2 tree hold nodes this tree did not verify, so they keep their prior.
    assert acc.values[1] == pytest.approx([1, 1, 2, 2, 2, 2, 0.75, 0.75])
    assert acc.values[0] == pytest.approx([1, 1, 1, 0.5])  # nodes 0 1 3
    assert acc.values[3][:5] == pytest.approx([0.5, 0.75, 0.875, 0.9375, 0.9375])  # not grown that deep
    acc.observe([1, 1, 2, 1], [], 3)  # a smaller tree measures only its sizes; larger ones keep theirs
    assert acc.values[2] == [0, 0, 0, 0, 2, 3, 3, 3] and acc.num_observed == 8
    assert acc.values[0][:3] == [0, 0, 0]
    half = TreeAcceptance(3, 2, 4, 0.5, start=acc)
    assert half.values == [[0, 0, 0], [0, 0, 0]]
    half.observe([1, 2, 1], [0, 1], 2)
    assert half.values == [[0.5, 0.5, 0], [0.5, 1.0, 1.0]]  # depth 1 held two of its nodes
    lengths = TreeAcceptance(4, 1, 4, 1.0)
    lengths.values = [[1.0, 0.0, 2.0, 1.0]]
    assert lengths.effective(4) == [[1.0, 1.0, 2.0, 2.0]]  # a larger tree holds the smaller one


def test_accepted_nodes_follows_the_emitted_tokens_through_the_tree():
    tokens, parents = [5, 7, 5, 9, 7], [-1, -1, 0, 1, 2]
    assert accepted_nodes(tokens, parents, [7, 9, 3]) == [1, 3]
    assert accepted_nodes(tokens, parents, [5, 5, 7, 1]) == [0, 2, 4]
    assert accepted_nodes(tokens, parents, [4]) == []
    assert accepted_nodes(tokens[:3], parents[:3], [7, 9]) == [1]  # a verified prefix of the proposed tree
    assert accepted_nodes(tokens, parents, [5, 8, 1]) == [0]  # no such path (cannot happen): what matched


def test_a_tree_gets_the_size_with_the_best_rate_and_probes_are_whole_trees():
    """A tree of 8 nodes and depth 2 on a compute-bound curve (0.3 ms a verified row on a 17 ms step, drafting
    free): its best 3 nodes hold almost all it accepts, so 3 nodes give the best tokens per second. Its probes are
    whole trees, and one accepted level makes a probe a success."""
    tree = SpeculativeConfig("eagle", 8, tree_depth=2, tree_topk=4, tree_num_nodes=8)
    policy = _measured_policy(tree, 17.0, 0.3, 0.0)
    lengths = [[0.6] * 8, [0.6, 0.8, 1.5, 1.5, 1.5, 1.5, 1.5, 1.5]]
    assert policy.decide([lengths], 1) == [3]  # 2.5 tokens for 18.2 ms: more nodes cost rows and earn nothing
    assert policy.decide([[[0.05] * 8] * 2], 1) == [0]
    # The step grows as requests get nodes: the second is charged the rows after the first's.
    assert policy.decide([[[0.05] * 8] * 2, lengths, [[1.0] * 8, [1.6] * 8]], 2) == [0, 3, 1]  # best goes first
    # An expansion costs whatever the size: with 5 ms for it, the second level does not pay for itself here (2.4
    # tokens for 22.9 ms against 2 for 17.9 ms at depth 1).
    costly = _measured_policy(tree, 17.0, 0.3, 0.0)
    for _ in range(2):
        costly.observe_step(1, True, 17 * MS, 0.0, 1, 5 * MS, 1)
    assert costly.decide_shapes([[[0.3] + [1.0] * 7, [0.3] + [1.4] * 7]], 1) == ([2], [1])
    assert costly.decide_shapes([[[0.3] * 8] * 2], 1) == ([1], [1])  # one level needs no expansion
    assert costly.decide([[[0.04] * 8] * 2], 1) == [0]
    bad = policy.new_state(0)
    for _ in range(10):
        policy.observe_verification(bad, 8, 0, [], [1] * 4 + [2] * 4)
    assert policy.grant([bad], [True], MIN_PROBE_INTERVAL) == [8]  # a whole tree
    assert bad.depth == 2
    assert policy.num_to_verify(bad, 8) == 8 and bad.verifying_probe
    policy.observe_verification(bad, 8, 1, [3], [1] * 4 + [2] * 4)
    assert bad.probe_interval == MIN_PROBE_INTERVAL
    assert bad.acceptance.values[1][2] < bad.acceptance.values[1][3]  # only sizes from 4 on held node 3


def test_a_tree_is_grown_as_deep_as_pays():
    """A tree's last level costs an expansion (1 ms here, on a 6 ms step with verified rows at 0.1 ms): where the
    third level adds little to the accepted path, the policy grows two levels and sends that depth with the limit;
    where it adds enough, three. The verified tree's depth is what its observation measures."""
    tree = SpeculativeConfig("eagle", 8, tree_depth=3, tree_topk=4, tree_num_nodes=8)
    policy = _measured_policy(tree, 6.0, 0.1, 0.2)
    for _ in range(2):
        policy.observe_step(1, True, 6 * MS, 0.2 * MS, 1, 2 * MS, 2)  # two expansions: 1 ms each
    shallow = [[0.6] * 8, [0.6, 0.9, 1.1, 1.2, 1.2, 1.2, 1.2, 1.2], [0.6, 0.9, 1.1, 1.2, 1.25, 1.3, 1.3, 1.3]]
    deep = [shallow[0], shallow[1], [0.6, 0.9, 1.1, 1.2, 1.6, 1.9, 2.0, 2.0]]
    assert policy.decide_shapes([shallow], 1) == ([4], [2])
    assert policy.decide_shapes([deep], 1) == ([7], [3])
    state = policy.new_state(0)
    state.acceptance.values = [list(row) for row in shallow]
    state.next_probe_step = 10**6
    assert policy.grant([state], [True], 1) == [4] and state.depth == 2
    assert policy.num_to_verify(state, 4) == 4 and state.verified_depth == 2
    before = [list(row) for row in state.acceptance.values]
    policy.observe_verification(state, 4, 2, [0, 2], [1, 1, 2, 1])
    assert state.acceptance.values[2] == before[2]  # a depth-2 tree says nothing of depth 3
    assert state.acceptance.values[1][:4] != before[1][:4]


def test_requests_due_together_are_probed_a_few_at_a_time():
    """A batch that arrived together comes due for its first probes in the same step. Where nothing else is
    drafted, each probe still takes its estimate from the credit as it is granted, so the credit (at most one step's
    time) buys a few probes per step, not one for every request: the burst that cost a batch-64 run 2% at once."""
    policy = _measured_policy(SpeculativeConfig("ngram", K), 17.0, 0.3, 0.2)
    states = [policy.new_state(0) for _ in range(64)]
    for s in states:
        for _ in range(5):
            policy.observe_verification(s, 1, 0)
    for _ in range(200):  # a long quiet spell: the credit is full (one step's time)
        policy.observe_step(64, True, 36 * MS, 0.0, 0, 0.0, 0)
    estimate = policy._probe_cost(64)
    assert estimate is not None and estimate > 0
    granted = policy.grant(states, [True] * 64, MIN_PROBE_INTERVAL)
    assert 1 <= sum(granted) <= 36 * MS / estimate + 1 < 64
    # The step's measured proposer seconds replace the proposer's part of the estimates charged, and their
    # verification stays charged: probes whose proposing cost five times its estimate leave the credit four of
    # those lower each (plus the step's own share of the budget).
    n, credit = sum(granted), policy._probe_credit
    propose = policy._probe_propose_cost()
    verify = estimate - propose
    assert propose > 0 and verify > 0
    measured = 5 * propose * n
    policy.observe_step(64 + n, False, 36 * MS, measured, n, 0.0, 0)
    expected = credit + propose * n - measured + PROBE_BUDGET * (36 * MS + measured)
    assert policy._probe_credit == pytest.approx(expected)


def test_a_probe_is_charged_its_verification_only_where_steps_that_size_were_measured():
    """Before any 13-token step was measured, the curve's guess for one (13 times a 1-token step) would hold the
    credit negative for hundreds of steps, and only tree probes measure such steps: it is not charged until then."""
    policy = SpecDecodePolicy(SpeculativeConfig("eagle", 12, tree_depth=4, tree_topk=4))
    for _ in range(3):
        policy.observe_step(1, True, 5 * MS, 1 * MS, 1, 2 * MS, 12)
    propose = policy._probe_propose_cost()
    assert policy._probe_cost(1) == pytest.approx(propose)
    for _ in range(3):
        policy.observe_step(13, True, 9 * MS, 0.0, 0, 0.0, 0)
    assert policy._probe_cost(1) == pytest.approx(propose + 4 * MS)


def test_nobody_is_probed_where_drafts_could_not_pay_even_if_all_were_accepted():
    """A tree of n nodes grown d deep emits 1 + min(n, d) tokens at best. At batch 64 on a compute-bound curve (0.3
    ms a token against a 0.56 ms share) with a 0.6 ms pass and 0.33 ms an expansion, no shape could pay, so probing
    only costs and nobody is probed; at batch 1 a whole tree could pay, and is the probe. With a 0.1 ms pass, a tree
    of 2 nodes 2 levels deep could pay at batch 64: the probe is that shape, not a whole tree. A chain's single draft
    can pay at batch 64, so the chain keeps probing there."""
    tree, chain = SpeculativeConfig("eagle", 12, tree_depth=4, tree_topk=4), SpeculativeConfig("eagle", K)
    for config, pass_ms, draft_ms, probe_at_64 in ((tree, 0.6, 4.0, None), (tree, 0.1, 4.0, 2), (chain, 0.1, 0.1, 1)):
        policy = _measured_policy(config, 17.0, 0.3, pass_ms)
        for _ in range(2):  # 12 expansions in 4 ms for the tree, 4 drafted tokens in 0.1 ms for the chain
            policy.observe_step(1, True, 17 * MS, pass_ms * MS, 1, draft_ms * MS, config.num_speculative_tokens)
        states = [policy.new_state(0) for _ in range(64)]
        for _ in range(200):  # the credit is full
            policy.observe_step(64, True, 36 * MS, 0.0, 0, 0.0, 0)
        granted = policy.grant(states, [True] * 64, MIN_PROBE_INTERVAL)
        assert {n for n in granted if n} == (set() if probe_at_64 is None else {probe_at_64})
        if probe_at_64 is None:  # still due: probed as soon as they could pay
            assert all(s.next_probe_step == MIN_PROBE_INTERVAL for s in states)
        elif config.tree:
            assert {s.depth for s in states if s.probing} == {2}
        alone = policy.new_state(0)
        assert policy.grant([alone], [True], MIN_PROBE_INTERVAL)[0] > 0  # at batch 1 it can pay
        assert policy._probe_could_pay(1) == ((12, 4) if config.tree else (1, K))  # a whole tree probes there

"""Scheduler with speculative decoding, against a fake runner that verifies drafts exactly: drafts in the token
budget and KV slots, computed count rolled back by the rejected ones, only accepted tokens hashed, stops
inside the accepted run, preemption and abort, and the limits of the speculation policy."""

from __future__ import annotations

from kvserve.config import CacheConfig, SchedulerConfig, SpeculativeConfig
from kvserve.core.hashing import extend_block_hashes
from kvserve.core.sched_output import SchedulerOutput
from kvserve.core.scheduler import Scheduler
from kvserve.outputs import ModelRunnerOutput, SpecStepTiming
from kvserve.request import RequestStatus
from tests.core.helpers import assert_no_leak, make_request, next_token, reference_output

K = 4


def make_spec_scheduler(num_blocks: int = 64, budget: int = 64, adaptive: bool = False, **kw) -> Scheduler:
    spec = SpeculativeConfig("ngram", K, adaptive=adaptive, **kw)
    return Scheduler(SchedulerConfig(16, budget, 256), CacheConfig(block_size=4), num_blocks, spec)


class SpecFakeRunner:
    """Verifies drafts against the deterministic 'model' of helpers.next_token and proposes drafts of which the
    first `len(tokens) % (K + 1)` are right, so every acceptance length occurs."""

    def __init__(self) -> None:
        self.tokens: dict[str, list[int]] = {}
        self.computed: dict[str, int] = {}
        self.drafts_seen: list[tuple[str, list[int]]] = []

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        for req_id in so.finished_req_ids:
            self.tokens.pop(req_id, None)
        for new in so.scheduled_new_reqs:
            self.tokens[new.req_id] = list(new.prompt_token_ids) + list(new.output_token_ids)
            self.computed[new.req_id] = new.num_computed_tokens
        for cached in so.scheduled_cached_reqs:
            assert self.computed[cached.req_id] == cached.num_computed_tokens
        req_ids, sampled, proposals = [], [], []
        for req_id, n in so.num_scheduled_tokens.items():
            toks = self.tokens[req_id]
            drafts = so.scheduled_spec_decode_tokens.get(req_id, [])
            assert len(toks) + len(drafts) >= self.computed[req_id] + n
            self.computed[req_id] += n
            req_ids.append(req_id)
            if self.computed[req_id] < len(toks) + len(drafts):
                sampled.append([])
                proposals.append([])
                continue
            self.drafts_seen.append((req_id, list(drafts)))
            emitted = []
            for d in drafts:
                target = next_token(toks + emitted)
                emitted.append(target)
                if d != target:
                    break
            else:
                emitted.append(next_token(toks + emitted))
            self.computed[req_id] -= len(drafts) - (len(emitted) - 1)
            toks.extend(emitted)
            sampled.append(emitted)
            proposals.append(self._propose(toks))
        return ModelRunnerOutput(req_ids, sampled, None, proposals)

    @staticmethod
    def _propose(toks: list[int]) -> list[int]:
        num_right = len(toks) % (K + 1)
        out: list[int] = []
        for i in range(K):
            t = next_token(toks + out)
            out.append(t if i < num_right else t + 1)
        return out


def run(scheduler: Scheduler, requests, max_steps: int = 10_000, check=None):
    for r in requests:
        scheduler.add_request(r)
    runner = SpecFakeRunner()
    outputs: dict[str, list[int]] = {r.request_id: [] for r in requests}
    history = []
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests():
            break
        so = scheduler.schedule()
        history.append(so)
        assert so.total_num_scheduled_tokens <= scheduler.config.max_num_batched_tokens
        if check:
            check(scheduler, so)
        for out in scheduler.update_from_output(so, runner.execute(so)):
            outputs[out.request_id].extend(out.new_token_ids)
    else:
        raise AssertionError("requests did not finish")
    return outputs, history, runner


def test_outputs_match_reference_with_every_acceptance_length():
    s = make_spec_scheduler()
    prompts = {f"r{i}": list(range(1 + i, 9 + 3 * i)) for i in range(5)}
    reqs = [make_request(k, v, max_tokens=23) for k, v in prompts.items()]
    outputs, history, runner = run(s, reqs)
    for k, v in prompts.items():
        assert outputs[k] == reference_output(v, 23)
    stats = s.spec_stats
    assert stats.num_drafts > 0 and 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert all(n > 0 for n in stats.num_accepted_tokens_per_pos)
    # Drafts are part of the scheduled tokens: a decode with k drafts is scheduled 1 + k tokens.
    for so in history:
        for req_id, drafts in so.scheduled_spec_decode_tokens.items():
            assert so.num_scheduled_tokens[req_id] == 1 + len(drafts)
    assert_no_leak(s)


def test_rejected_drafts_roll_back_and_are_never_hashed():
    s = make_spec_scheduler()
    r = make_request("a", [5, 6, 7], max_tokens=40)

    def check(scheduler, so):
        if "a" not in scheduler.requests:
            return
        req = scheduler.requests["a"]
        # Every cached block of the request holds accepted tokens only: its hash is that of its real tokens.
        expected = []
        extend_block_hashes(expected, req.all_token_ids, 4, None)
        blocks = scheduler.kv.req_to_blocks["a"]
        for i, block in enumerate(blocks):
            if block.block_hash is not None:
                assert block.block_hash == expected[i]
        # Computed never passes the known tokens plus the drafts scheduled now.
        assert req.num_computed_tokens <= req.num_tokens + len(so.scheduled_spec_decode_tokens.get("a", []))

    outputs, _, _ = run(s, [r], check=check)
    assert outputs["a"] == reference_output([5, 6, 7], 40)
    assert_no_leak(s)


def test_draft_count_respects_max_tokens_and_budget():
    s = make_spec_scheduler(budget=3)
    r = make_request("a", [1, 2, 3, 4], max_tokens=6)

    def check(scheduler, so):
        drafts = so.scheduled_spec_decode_tokens.get("a", [])
        # No draft would make the request emit past max_tokens.
        assert r.num_output_tokens + len(drafts) + 1 <= 6

    outputs, history, runner = run(s, [r], check=check)
    assert outputs["a"] == reference_output([1, 2, 3, 4], 6)
    assert any(d for _, d in runner.drafts_seen)
    assert all(len(d) <= 2 for _, d in runner.drafts_seen)
    assert_no_leak(s)


def test_stop_token_inside_accepted_run_drops_the_rest():
    ref = reference_output([9, 8, 7], 30)
    stop = ref[10]
    assert stop not in ref[:10]
    s = make_spec_scheduler()
    r = make_request("a", [9, 8, 7], max_tokens=30, stop_token_ids=[stop])
    outputs, _, _ = run(s, [r])
    assert outputs["a"] == ref[:11]
    assert r.status == RequestStatus.FINISHED_STOPPED and r.stop_reason == stop
    assert_no_leak(s)


def test_preemption_and_abort_with_drafts():
    s = make_spec_scheduler(num_blocks=14, budget=32)
    prompts = {f"r{i}": list(range(10 * i + 1, 10 * i + 9)) for i in range(4)}
    reqs = [make_request(k, v, max_tokens=20) for k, v in prompts.items()]
    outputs, _, _ = run(s, reqs)
    assert s.num_preemptions > 0
    for k, v in prompts.items():
        assert outputs[k] == reference_output(v, 20)
    assert_no_leak(s)

    s2 = make_spec_scheduler()
    runner = SpecFakeRunner()
    s2.add_request(make_request("x", [1, 2, 3], max_tokens=50))
    for _ in range(4):
        so = s2.schedule()
        s2.update_from_output(so, runner.execute(so))
    so = s2.schedule()
    assert so.scheduled_spec_decode_tokens  # aborted while verifying drafts
    s2.finish_requests(["x"], RequestStatus.FINISHED_ABORTED)
    s2.update_from_output(so, runner.execute(so))
    assert_no_leak(s2)


def test_draft_limits_tell_the_proposer_what_the_policy_will_verify():
    """Before anything is measured the cost-aware policy gives no request drafts but probes one (a limit of 1),
    and verifies no more than it granted; once steps are timed, a request whose drafts are accepted gets K.
    Without the policy (adaptive off) nothing is named: every request gets K."""
    s = make_spec_scheduler(adaptive=True)
    good, other = make_request("good", list(range(1, 9))), make_request("other", list(range(2, 10)))
    for r in (good, other):
        s.add_request(r)
    so = s.schedule()
    assert so.spec_draft_limits == {"good": 1, "other": 0}  # one probe per step while nothing is measured
    runner = SpecFakeRunner()
    limits: dict[str, int] = {}
    for _ in range(12):
        out = runner.execute(so)
        # Flat step costs and a free proposer: drafts that are accepted pay.
        out.spec_timing = SpecStepTiming(0.01 + 0.0001 * so.total_num_scheduled_tokens, 0.0001, 2)
        s.update_from_output(so, out)
        for req_id, drafts in so.scheduled_spec_decode_tokens.items():
            assert len(drafts) <= limits.get(req_id, K)
        limits = dict(so.spec_draft_limits)
        so = s.schedule()
    assert so.spec_draft_limits.get("good", K) > 0 and so.spec_draft_limits.get("other", K) > 0
    fixed = make_spec_scheduler(adaptive=False)
    fixed.add_request(make_request("r", list(range(1, 9))))
    fixed_so = fixed.schedule()
    assert fixed_so.spec_draft_limits == {}

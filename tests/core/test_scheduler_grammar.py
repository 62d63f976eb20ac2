"""The scheduler's side of structured outputs, with a stand-in grammar: requests whose grammar still compiles
wait without holding up the others, keep their place, and one whose grammar failed ends with an "abort" output;
a grammar that completes finishes its request."""

from __future__ import annotations

from kvserve.core.sched_output import SchedulerOutput
from kvserve.request import RequestStatus
from tests.core.helpers import FakeRunner, make_request, make_scheduler


class FakeGrammar:
    def __init__(self, ready: bool = True, failure: str | None = None, length: int | None = None) -> None:
        self.ready, self.failure, self.length = ready, failure, length
        self.accepted: list[int] = []

    def accept(self, token_id: int) -> bool:
        self.accepted.append(token_id)
        return True

    def num_valid(self, token_ids: list[int]) -> int:
        return len(token_ids)

    @property
    def is_terminated(self) -> bool:
        return self.length is not None and len(self.accepted) >= self.length


class FakeManager:
    num_words = 1

    def fill_bitmask(self, grammars, drafts, parents=None) -> bytes:
        return b"\xff\xff\xff\xff" * (len(grammars) + sum(len(d) for d in drafts))


def step(scheduler, runner) -> tuple[SchedulerOutput, list]:
    so = scheduler.schedule()
    return so, scheduler.update_from_output(so, runner.execute(so))


def test_compiling_requests_wait_in_place_and_the_rest_go_ahead():
    scheduler = make_scheduler(max_num_seqs=4)
    scheduler.structured_output = FakeManager()
    slow = make_request("slow", [1, 2, 3], max_tokens=4)
    slow.grammar = FakeGrammar(ready=False, length=2)
    free = [make_request(f"f{i}", [5 + i, 6], max_tokens=2) for i in range(2)]
    for r in [slow, *free]:
        scheduler.add_request(r)
    runner = FakeRunner()
    so, _ = step(scheduler, runner)
    assert set(so.num_scheduled_tokens) == {"f0", "f1"} and not so.structured_output_request_ids
    assert [r.request_id for r in scheduler.waiting] == ["slow"]
    late = make_request("late", [9, 9], max_tokens=1)
    scheduler.add_request(late)
    step(scheduler, runner)
    assert [r.request_id for r in scheduler.waiting] == ["slow"]  # late went ahead, slow kept its place
    slow.grammar.ready = True
    so, outs = step(scheduler, runner)
    assert "slow" in so.num_scheduled_tokens and so.structured_output_request_ids == ["slow"]
    assert so.grammar_bitmask is not None and so.grammar_bitmask_words == 1
    while scheduler.has_unfinished_requests():
        so, more = step(scheduler, runner)
        outs += more
    done = [o for o in outs if o.request_id == "slow" and o.finished]
    # The grammar completed after 2 tokens (max_tokens 4): "stop", its last token kept as text.
    assert (done[0].finish_reason, done[0].grammar_completed) == ("stop", True)
    assert len(slow.output_token_ids) == 2 and slow.grammar.accepted == slow.output_token_ids
    assert scheduler.kv.pool.num_free_blocks == scheduler.kv.num_blocks


def test_a_grammar_that_failed_to_compile_ends_its_request_with_an_output():
    scheduler = make_scheduler()
    scheduler.structured_output = FakeManager()
    bad = make_request("bad", [1, 2], max_tokens=4)
    bad.grammar = FakeGrammar(failure="invalid structured output specification: too big")
    good = make_request("good", [3, 4], max_tokens=2)
    scheduler.add_request(bad)
    scheduler.add_request(good)
    runner = FakeRunner()
    so, outs = step(scheduler, runner)
    assert list(so.num_scheduled_tokens) == ["good"]
    (failed,) = [o for o in outs if o.request_id == "bad"]
    assert (failed.new_token_ids, failed.finish_reason) == ([], "abort")
    assert bad.status == RequestStatus.FINISHED_ABORTED and "bad" not in scheduler.requests
    while scheduler.has_unfinished_requests():
        step(scheduler, runner)
    assert scheduler.kv.pool.num_free_blocks == scheduler.kv.num_blocks

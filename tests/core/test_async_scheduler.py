"""Async scheduling in the scheduler alone: step N+1 is scheduled before step N's output arrives (output
placeholders). With a fake model whose next token is a function of the whole history, any lost, repeated or
misplaced token changes the output; the outputs must equal the synchronous scheduler's, and nothing may leak."""

import random

import pytest

from tests.core.helpers import (
    assert_no_leak,
    make_request,
    make_scheduler,
    reference_output,
    run_async_to_completion,
    run_to_completion,
)


def workload(seed: int, block_size: int, with_stops: bool):
    rng = random.Random(seed)
    shared = [rng.randrange(1, 500) for _ in range(20)]
    reqs = []
    for i in range(14):
        prompt = (shared if i % 2 else []) + [rng.randrange(1, 500) for _ in range(rng.randrange(1, 30))]
        # The fake model's tokens are 1..997: a few stop ids end some requests early, mid-flight.
        stops = rng.sample(range(1, 998), 40) if with_stops and i % 3 == 0 else None
        reqs.append(
            make_request(f"r{i}", prompt, max_tokens=rng.randrange(1, 14), block_size=block_size, stop_token_ids=stops)
        )
    return reqs


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("budget", [3, 8, 128])
@pytest.mark.parametrize("num_blocks", [None, "tight"])
def test_async_outputs_equal_the_synchronous_schedulers(block_size, budget, num_blocks):
    blocks = max(12, 60 // block_size) if num_blocks == "tight" else 400 // block_size
    seed = block_size * 1000 + budget

    def scheduler(async_scheduling: bool):
        return make_scheduler(
            num_blocks=blocks,
            block_size=block_size,
            max_num_batched_tokens=budget,
            max_num_seqs=5,
            async_scheduling=async_scheduling,
        )

    sync_s = scheduler(False)
    want, _ = run_to_completion(sync_s, workload(seed, block_size, with_stops=True))
    async_s = scheduler(True)
    got = run_async_to_completion(async_s, workload(seed, block_size, with_stops=True))
    assert got == want
    assert_no_leak(async_s)
    if num_blocks == "tight" and block_size < 16:
        assert async_s.num_preemptions > 0, "the tight pool was meant to preempt"


def test_placeholders_never_outlive_the_step_in_flight():
    s = make_scheduler(async_scheduling=True)
    reqs = workload(7, 4, with_stops=False)
    outputs = run_async_to_completion(s, reqs)
    for r in reqs:
        assert outputs[r.request_id] == reference_output(r.prompt_token_ids, r.max_tokens)
        assert r.num_output_placeholders <= 1  # the last one is settled by the final output
    assert_no_leak(s)


def test_a_request_is_not_scheduled_past_max_tokens_or_max_model_len():
    s = make_scheduler(async_scheduling=True, max_model_len=20)
    short = make_request("a", [5, 6, 7], max_tokens=4)
    capped = make_request("b", list(range(1, 16)), max_tokens=5)  # max_model_len 20: 5 tokens exactly
    s.add_request(short)
    s.add_request(capped)
    scheduled = {"a": 0, "b": 0}
    from tests.core.helpers import FakeRunner

    runner, in_flight = FakeRunner(), None
    while in_flight is not None or s.has_unfinished_requests():
        so = s.schedule()
        for req_id, n in so.num_scheduled_tokens.items():
            scheduled[req_id] += n
        ro = runner.execute(so)
        previous, in_flight = in_flight, (None if so.is_empty else (so, ro))
        if previous is not None:
            s.update_from_output(*previous)
    # Prompt + every output token but the last is computed: nothing beyond.
    assert scheduled == {"a": 3 + 4 - 1, "b": 15 + 5 - 1}
    assert_no_leak(s)


def test_aborts_with_a_step_in_flight_free_everything():
    s = make_scheduler(async_scheduling=True, num_blocks=20, max_num_batched_tokens=16)
    reqs = workload(11, 4, with_stops=False)
    aborted = ["r1", "r4", "r9"]
    outputs = run_async_to_completion(s, reqs, abort={2: ["r1"], 5: ["r4", "r9"]})
    for r in reqs:
        if r.request_id not in aborted:
            assert outputs[r.request_id] == reference_output(r.prompt_token_ids, r.max_tokens)
    assert_no_leak(s)


def test_an_id_reused_while_the_aborted_requests_step_is_in_flight_gets_none_of_its_tokens():
    from kvserve.request import RequestStatus
    from tests.core.helpers import FakeRunner

    s = make_scheduler(async_scheduling=True)
    old = make_request("x", [5, 6, 7], max_tokens=8)
    new = make_request("x", [9, 10, 11, 12], max_tokens=6)
    s.add_request(old)
    runner, in_flight, outputs = FakeRunner(), None, []
    for step in range(100):
        if in_flight is None and not s.has_unfinished_requests():
            break
        if step == 3:  # old's step is in flight: abort it, and reuse its id at once
            s.finish_requests(["x"], RequestStatus.FINISHED_ABORTED)
            s.add_request(new)
        so = s.schedule()
        ro = runner.execute(so)
        previous, in_flight = in_flight, (None if so.is_empty else (so, ro))
        if previous is not None:
            for out in s.update_from_output(*previous):
                if step >= 3:
                    outputs.extend(out.new_token_ids)
    assert outputs == reference_output(new.prompt_token_ids, 6)
    assert_no_leak(s)

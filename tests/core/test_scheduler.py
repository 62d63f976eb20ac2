"""Scheduler: token budget, chunked prefill, FCFS, prefix hits, preemption by recompute, abort, admission."""

import pytest

from kvserve.request import RequestStatus
from tests.core.helpers import (
    FakeRunner,
    assert_no_leak,
    make_request,
    make_scheduler,
    preempted_per_step,
    reference_output,
    run_to_completion,
)


def test_single_request_prefill_then_decode():
    s = make_scheduler()
    r = make_request("a", list(range(1, 11)), max_tokens=3)
    outputs, history = run_to_completion(s, [r])
    assert history[0].num_scheduled_tokens == {"a": 10}
    assert [n.block_ids for n in history[0].scheduled_new_reqs] == [[0, 1, 2]]
    assert [h.num_scheduled_tokens for h in history[1:]] == [{"a": 1}, {"a": 1}]
    assert history[1].scheduled_cached_reqs[0].num_computed_tokens == 10
    assert outputs["a"] == reference_output(r.prompt_token_ids, 3)
    assert r.status == RequestStatus.FINISHED_LENGTH
    assert_no_leak(s)


def test_outputs_match_reference_and_nothing_leaks():
    s = make_scheduler()
    prompts = {f"r{i}": list(range(1 + i, 20 + 3 * i)) for i in range(6)}
    reqs = [make_request(k, v, max_tokens=7) for k, v in prompts.items()]
    outputs, _ = run_to_completion(s, reqs)
    for k, v in prompts.items():
        assert outputs[k] == reference_output(v, 7)
    assert_no_leak(s)


def test_chunked_prefill_respects_token_budget_and_decodes_go_first():
    s = make_scheduler(max_num_batched_tokens=8)
    a = make_request("a", list(range(1, 4)), max_tokens=5)
    b = make_request("b", list(range(1, 30)), max_tokens=2)
    outputs, history = run_to_completion(s, [a, b])
    # Step 1: a's 3-token prompt then 5 tokens of b's prompt; afterwards a decodes (1) while b gets 7 per step.
    assert history[0].num_scheduled_tokens == {"a": 3, "b": 5}
    assert history[1].num_scheduled_tokens == {"a": 1, "b": 7}
    assert list(history[1].num_scheduled_tokens) == ["a", "b"]
    assert outputs["a"] == reference_output(a.prompt_token_ids, 5)
    assert outputs["b"] == reference_output(b.prompt_token_ids, 2)
    assert_no_leak(s)


def test_without_chunked_prefill_a_prompt_waits_for_a_whole_budget():
    s = make_scheduler(max_num_batched_tokens=10, enable_chunked_prefill=False)
    a = make_request("a", list(range(1, 11)), max_tokens=3)
    b = make_request("b", list(range(21, 31)), max_tokens=3)
    _, history = run_to_completion(s, [a, b])
    # b's 10-token prompt never fits beside a's decodes, and is not split: it runs once a is done.
    assert [h.num_scheduled_tokens for h in history[:4]] == [{"a": 10}, {"a": 1}, {"a": 1}, {"b": 10}]
    assert_no_leak(s)


def test_max_num_seqs_caps_running_requests():
    s = make_scheduler(max_num_seqs=2)
    reqs = [make_request(f"r{i}", [i + 1] * 5, max_tokens=3) for i in range(5)]
    outputs, history = run_to_completion(s, reqs)
    assert list(history[0].num_scheduled_tokens) == ["r0", "r1"]
    assert all(len(h.num_scheduled_tokens) <= 2 for h in history)
    assert all(len(v) == 3 for v in outputs.values())
    assert_no_leak(s)


def test_prefix_hits_count_as_computed_and_share_blocks():
    s = make_scheduler(block_size=4)
    prefix = list(range(100, 112))  # 3 full blocks
    a = make_request("a", prefix + [1, 2], max_tokens=4)
    s.add_request(a)
    runner = FakeRunner()
    so_a = s.schedule()
    s.update_from_output(so_a, runner.execute(so_a))
    assert so_a.scheduled_new_reqs[0].block_ids == [0, 1, 2, 3]
    b = make_request("b", prefix + [3, 4, 5], max_tokens=4)
    s.add_request(b)
    so_b = s.schedule()
    new_b = so_b.scheduled_new_reqs[0]
    assert new_b.num_computed_tokens == 12
    assert new_b.block_ids == [0, 1, 2, 4]
    assert so_b.num_scheduled_tokens == {"a": 1, "b": 3}
    assert [s.kv.pool.blocks[i].ref_cnt for i in range(5)] == [2, 2, 2, 1, 1]
    stats = s.kv.stats
    assert (stats.num_lookups, stats.num_query_tokens, stats.num_hit_tokens) == (2, 14 + 15, 12)


def test_same_prompt_admitted_in_one_step_hits_blocks_scheduled_in_that_step():
    """n > 1 style: two requests with one prompt share its full blocks even within the first step."""
    s = make_scheduler(block_size=4)
    prompt = list(range(1, 11))  # 2 full blocks + 2 tokens
    a = make_request("a", prompt, max_tokens=3)
    b = make_request("b", prompt, max_tokens=3)
    s.add_request(a)
    s.add_request(b)
    so = s.schedule()
    assert so.num_scheduled_tokens == {"a": 10, "b": 2}
    assert so.scheduled_new_reqs[1].block_ids[:2] == so.scheduled_new_reqs[0].block_ids[:2]


def test_full_prompt_hit_still_computes_last_token():
    s = make_scheduler(block_size=4)
    prompt = list(range(1, 9))  # exactly 2 blocks
    outputs, _ = run_to_completion(s, [make_request("a", prompt, max_tokens=2)])
    s2_req = make_request("b", prompt, max_tokens=2)
    s.add_request(s2_req)
    so = s.schedule()
    assert so.scheduled_new_reqs[0].num_computed_tokens == 4
    assert so.num_scheduled_tokens == {"b": 4}


def test_prefix_caching_off_gives_no_hits():
    s = make_scheduler(enable_prefix_caching=False)
    prompt = list(range(1, 20))
    outputs, _ = run_to_completion(s, [make_request("a", prompt), make_request("b", prompt)])
    assert outputs["a"] == outputs["b"] == reference_output(prompt, 8)
    assert s.kv.stats.num_hit_tokens == 0 and s.kv.pool.cached == {}
    assert_no_leak(s)


def test_preemption_by_recompute_keeps_outputs_and_frees_everything():
    # 10 blocks of 4 tokens: three requests of 5 prompt + 12 output tokens (5 blocks each) all start, then
    # cannot all stay resident.
    s = make_scheduler(num_blocks=10, block_size=4, max_num_batched_tokens=64)
    prompts = {f"r{i}": [10 * i + j for j in range(1, 6)] for i in range(3)}
    reqs = [make_request(k, v, max_tokens=12) for k, v in prompts.items()]
    outputs, history = run_to_completion(s, reqs)
    preempted = [p for p in preempted_per_step(history) if p]
    assert preempted, "the pool was meant to force a preemption"
    # The most recently admitted running request is the victim.
    assert preempted[0] == {"r2"}
    for k, v in prompts.items():
        assert outputs[k] == reference_output(v, 12)
    assert s.num_preemptions >= 1
    assert_no_leak(s)


def test_preempted_request_goes_to_front_of_waiting():
    s = make_scheduler(num_blocks=4, block_size=4, max_num_batched_tokens=64)
    a = make_request("a", list(range(1, 8)), max_tokens=8)  # 2 blocks now, up to 4
    b = make_request("b", list(range(11, 18)), max_tokens=8)
    c = make_request("c", list(range(21, 24)), max_tokens=2)
    for r in (a, b, c):
        s.add_request(r)
    runner_outputs = []
    runner = FakeRunner()
    for _ in range(3):
        so = s.schedule()
        runner_outputs.append(so)
        s.update_from_output(so, runner.execute(so))
    assert b.status == RequestStatus.PREEMPTED
    assert list(s.waiting)[:2] == [b, c]
    assert b.num_computed_tokens == 0 and s.kv.get_block_ids("b") == []


def test_abort_frees_blocks_at_once():
    s = make_scheduler()
    a = make_request("a", list(range(1, 20)), max_tokens=50)
    b = make_request("b", list(range(1, 6)), max_tokens=50)
    s.add_request(a)
    s.add_request(b)
    s.schedule()
    assert s.kv.pool.num_free_blocks < s.kv.num_blocks
    s.finish_requests(["a", "b"], RequestStatus.FINISHED_ABORTED)
    assert a.status == RequestStatus.FINISHED_ABORTED
    assert_no_leak(s)
    so = s.schedule()
    assert so.finished_req_ids == {"a", "b"} and so.is_empty


def test_abort_of_waiting_request():
    s = make_scheduler(max_num_seqs=1)
    s.add_request(make_request("a", [1, 2, 3]))
    s.add_request(make_request("b", [1, 2, 3]))
    s.schedule()
    s.finish_requests(["b"], RequestStatus.FINISHED_ABORTED)
    assert [r.request_id for r in s.waiting] == []
    s.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    assert_no_leak(s)


def test_request_that_can_never_fit_is_rejected_at_admission():
    s = make_scheduler(num_blocks=4, block_size=4, max_model_len=100)
    with pytest.raises(ValueError, match="at most 16 fit"):
        s.add_request(make_request("a", list(range(1, 10)), max_tokens=10))
    s2 = make_scheduler(num_blocks=100, block_size=4, max_model_len=20)
    with pytest.raises(ValueError, match="max_model_len 20"):
        s2.add_request(make_request("a", list(range(1, 10)), max_tokens=12))
    assert s2.requests == {}


def test_stop_conditions():
    s = make_scheduler()
    prompt = list(range(1, 6))
    ref = reference_output(prompt, 10)
    stop_tok = ref[3]
    r_stop = make_request("s", prompt, max_tokens=10, stop_token_ids=[stop_tok])
    r_min = make_request("m", prompt, max_tokens=10, stop_token_ids=[stop_tok], min_tokens=6)
    r_len = make_request("l", prompt, max_tokens=4)
    outputs, _ = run_to_completion(s, [r_stop, r_min, r_len])
    assert outputs["s"] == ref[:4] and r_stop.stop_reason == stop_tok
    assert r_stop.status == RequestStatus.FINISHED_STOPPED
    assert outputs["m"][:4] == ref[:4] and len(outputs["m"]) > 4
    assert outputs["l"] == ref[:4] and r_len.status == RequestStatus.FINISHED_LENGTH
    assert_no_leak(s)


@pytest.mark.parametrize("block_size", [1, 2, 4, 16])
@pytest.mark.parametrize("budget", [3, 8, 128])
def test_random_workloads_match_reference(block_size, budget):
    import random

    rng = random.Random(block_size * 1000 + budget)
    shared = [rng.randrange(1, 500) for _ in range(20)]
    prompts = {}
    for i in range(12):
        tail = [rng.randrange(1, 500) for _ in range(rng.randrange(1, 30))]
        prompts[f"r{i}"] = (shared if i % 2 else []) + tail
    s = make_scheduler(
        num_blocks=max(12, 60 // block_size),
        block_size=block_size,
        max_num_batched_tokens=budget,
        max_num_seqs=5,
    )
    reqs = [make_request(k, v, max_tokens=rng.randrange(1, 12), block_size=block_size) for k, v in prompts.items()]
    max_tokens = {r.request_id: r.max_tokens for r in reqs}
    outputs, _ = run_to_completion(s, reqs)
    for k, v in prompts.items():
        assert outputs[k] == reference_output(v, max_tokens[k])
    assert_no_leak(s)

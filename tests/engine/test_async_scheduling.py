"""Async scheduling (step N+1 scheduled and launched before step N's tokens are read): the same tokens as the
synchronous engine under batching, chunked prefill, prefix hits, stops, preemption (recompute and swap), penalties,
seeds and logprobs, and every block free afterwards."""

from __future__ import annotations

import random

import pytest

from kvserve import LLM, SamplingParams
from kvserve.engine.arg_utils import EngineArgs
from tests.conftest import assert_all_blocks_free

MODEL = "llama-gqa-untied"


@pytest.fixture(scope="module")
def model_path(tiny_model_factory) -> str:
    return tiny_model_factory(MODEL)


def rand_prompts(count: int, seed: int, shared_prefix: int = 0) -> list[dict]:
    rng = random.Random(seed)
    prefix = [rng.randrange(3, 49000) for _ in range(shared_prefix)]
    return [
        {"prompt_token_ids": prefix + [rng.randrange(3, 49000) for _ in range(rng.randrange(1, 40))]}
        for _ in range(count)
    ]


def run(model_path: str, prompts, params, **options) -> tuple[list[list[int]], list]:
    llm = LLM(model_path, dtype="float32", max_model_len=128, **options)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert_all_blocks_free(llm)
    core = llm.engine.engine_core
    assert core._in_flight is None and core.executor.driver_runner._in_flight is None
    return [o.outputs[0].token_ids for o in outs], outs


def mixed_params(count: int, seed: int) -> list[SamplingParams]:
    """Greedy, lengths from 1 to 30."""
    rng = random.Random(seed)
    return [SamplingParams(max_tokens=rng.randrange(1, 31), temperature=0.0, ignore_eos=True) for _ in range(count)]


def with_stops(params: list[SamplingParams], tokens: list[list[int]]) -> list[SamplingParams]:
    """Every third request stops on the token it produced third (a stop the async engine sees one step late, with
    the next step already in flight)."""
    out = []
    for i, (p, toks) in enumerate(zip(params, tokens, strict=True)):
        stop = [toks[min(2, len(toks) - 1)]] if i % 3 == 0 else None
        out.append(SamplingParams(max_tokens=p.max_tokens, temperature=0.0, ignore_eos=True, stop_token_ids=stop))
    return out


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"max_num_batched_tokens": 16, "max_num_seqs": 5},  # chunked prefill next to decodes, a queue
        {"num_kv_blocks": 12, "block_size": 8},  # recompute preemption
        {"num_kv_blocks": 12, "block_size": 8, "preemption_mode": "swap", "swap_space": 1 << 20},
        {"enable_prefix_caching": False, "max_num_seqs": 1},  # batch 1
    ],
    ids=["batched", "chunked", "recompute", "swap", "batch1"],
)
def test_greedy_tokens_match_the_synchronous_engine(model_path, options):
    prompts = rand_prompts(12, 1, shared_prefix=20) + rand_prompts(6, 2)
    plain = mixed_params(len(prompts), 3)
    unstopped, _ = run(model_path, prompts, plain, **options)
    params = with_stops(plain, unstopped)
    want, want_outs = run(model_path, prompts, params, **options)
    assert sum(len(w) < len(u) for w, u in zip(want, unstopped, strict=True)) >= 3  # the stops do fire
    got, outs = run(model_path, prompts, params, async_scheduling=True, **options)
    assert got == want
    reasons = [(o.outputs[0].finish_reason, o.outputs[0].stop_reason) for o in outs]
    assert reasons == [(o.outputs[0].finish_reason, o.outputs[0].stop_reason) for o in want_outs]


def test_preemption_really_happens_in_the_small_pool(model_path):
    llm = LLM(model_path, dtype="float32", max_model_len=128, num_kv_blocks=12, block_size=8, async_scheduling=True)
    llm.generate(rand_prompts(12, 1, shared_prefix=20), mixed_params(12, 3), use_tqdm=False)
    assert llm.stats()["num_preemptions"] > 0
    assert_all_blocks_free(llm)


def test_penalties_see_the_token_in_flight(model_path):
    """Penalties read the tokens generated so far, the one the previous step produced included: by the time the
    next step samples, the runner must have it on the host. Greedy with a negative frequency penalty, which pulls
    the choice towards the tokens generated so far: a token missing from that history changes the output."""
    prompts = rand_prompts(6, 4)
    plain = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    penalized = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, frequency_penalty=-1.0)
    unpenalized, _ = run(model_path, prompts, plain)
    want, _ = run(model_path, prompts, penalized)
    assert want != unpenalized  # the penalty matters here
    got, _ = run(model_path, prompts, penalized, async_scheduling=True)
    assert got == want


def test_seeded_sampling_and_logprobs_match(model_path):
    """Seeds draw by the position of the token: the in-flight token counts in the row before the next draw."""
    prompts = rand_prompts(6, 4)
    params = [
        SamplingParams(
            max_tokens=20,
            temperature=0.8,
            seed=i,
            repetition_penalty=1.3,
            min_tokens=3,
            logprobs=2,
            ignore_eos=True,
        )
        for i in range(len(prompts))
    ]
    want, want_outs = run(model_path, prompts, params)
    got, got_outs = run(model_path, prompts, params, async_scheduling=True)
    assert got == want
    for w, g in zip(want_outs, got_outs, strict=True):
        assert [sorted(d) for d in g.outputs[0].logprobs] == [sorted(d) for d in w.outputs[0].logprobs]
        assert g.outputs[0].cumulative_logprob == pytest.approx(w.outputs[0].cumulative_logprob, abs=1e-5)


def test_abort_while_a_step_is_in_flight_frees_everything(model_path):
    llm = LLM(model_path, dtype="float32", max_model_len=128, async_scheduling=True)
    engine = llm.engine
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(rand_prompts(4, 5)):
        engine.add_request(str(i), prompt, params)
    finished: dict[str, list[int]] = {}
    steps = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out.outputs[0].token_ids
        steps += 1
        if steps == 6:
            assert engine.engine_core._in_flight is not None
            engine.abort_request(["1", "2"])
    assert sorted(finished) == ["0", "3"] and all(len(t) == 40 for t in finished.values())
    assert_all_blocks_free(llm)
    # The engine goes on.
    again = llm.generate(rand_prompts(1, 5)[:1], params, use_tqdm=False)[0].outputs[0].token_ids
    assert again == finished["0"]


def test_no_step_is_scheduled_past_max_tokens(model_path):
    """A request whose in-flight token is its last is not scheduled again: exactly max_tokens steps sample."""
    llm = LLM(model_path, dtype="float32", max_model_len=128, async_scheduling=True)
    core = llm.engine.engine_core
    sampled = []
    execute = core.executor.execute_model

    def counting(so):
        sampled.append(so.total_num_scheduled_tokens)
        return execute(so)

    core.executor.execute_model = counting
    out = llm.generate(rand_prompts(1, 6), SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 7
    # One prefill step, six decode steps, then one empty step that only collects the last token.
    assert sampled[1:] == [1] * 6 + [0]


def test_max_model_len_reached_in_flight(model_path):
    llm = LLM(model_path, dtype="float32", max_model_len=40, async_scheduling=True)
    out = llm.generate({"prompt_token_ids": list(range(100, 130))}, SamplingParams(max_tokens=None, temperature=0.0))
    assert len(out[0].outputs[0].token_ids) == 10 and out[0].outputs[0].finish_reason == "length"
    assert_all_blocks_free(llm)


@pytest.mark.parametrize(
    "options, match",
    [
        ({"speculative_config": {"method": "ngram", "num_speculative_tokens": 2}}, "speculative"),
        ({"kv_transfer_config": {"kv_connector": "offload", "cpu_bytes": "1MiB"}}, "KV connector"),
        ({"tensor_parallel_size": 2}, "tensor_parallel_size"),
    ],
)
def test_refused_combinations_say_why(model_path, options, match):
    with pytest.raises(ValueError, match=match):
        EngineArgs(model=model_path, async_scheduling=True, **options).create_engine_config()

"""Structured outputs through the engine: greedy tokens equal HF's under the same grammar mask (llguidance
driven directly, one token at a time), and stay identical under batching with free requests, chunked prefill,
preemption and n-gram speculation; sampling draws from the masked distribution; bad specs are ValueErrors."""

from __future__ import annotations

import json
import math
import random
import re

import llguidance
import llguidance.hf
import numpy as np
import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.sampling_params import StructuredOutputsParams
from kvserve.structured_output.grammar import check
from tests.conftest import assert_all_blocks_free, load_hf_model

SCHEMA = {
    "type": "object",
    "properties": {
        "flag": {"type": "boolean"},
        "kind": {"enum": ["cat", "dog", "owl"]},
        "count": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["flag", "kind", "count"],
    "additionalProperties": False,
}
SPECS = {
    "json": StructuredOutputsParams(json=SCHEMA),
    "regex": StructuredOutputsParams(regex=r"[a-c]{2,6}-\d\d"),
    "choice": StructuredOutputsParams(choice=["alpha", "beta gamma", "delta.epsilon"]),
    "grammar": StructuredOutputsParams(grammar='root ::= "<" [xyz]+ ">" | "none"'),
    "json_object": StructuredOutputsParams(json_object=True),
}


def rand_prompts(count: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(3, 49000) for _ in range(rng.randrange(4, 30))]} for _ in range(count)]


@pytest.fixture(scope="module")
def ll_tokenizer(smollm2_tokenizer):
    return llguidance.hf.from_tokenizer(smollm2_tokenizer, n_vocab=len(smollm2_tokenizer))


@torch.no_grad()
def hf_constrained_greedy(model, ll_tokenizer, prompt_ids: list[int], spec, max_tokens: int) -> tuple[list[int], str]:
    """HF's logits with its own KV cache, llguidance's mask applied by hand, argmax; stops where kvserve's rule
    says (the grammar complete, or max_tokens)."""
    matcher = llguidance.LLMatcher(ll_tokenizer, check(spec))
    out = model(torch.tensor([prompt_ids]), use_cache=True)
    tokens: list[int] = []
    while True:
        logits = out.logits[0, -1].clone()
        bits = np.unpackbits(np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
        allowed = torch.from_numpy(bits[: logits.shape[0]].astype(bool))
        logits[~allowed] = float("-inf")
        nxt = int(logits.argmax())
        tokens.append(nxt)
        assert matcher.consume_token(nxt)
        if matcher.is_stopped():
            return tokens, "stop"
        if len(tokens) == max_tokens:
            return tokens, "length"
        out = model(torch.tensor([[nxt]]), past_key_values=out.past_key_values, use_cache=True)


def greedy(spec, max_tokens: int = 40, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, structured_outputs=spec, **kwargs)


@pytest.mark.slow
@pytest.mark.parametrize("model_name", ["llama-gqa-untied", "qwen3-qknorm"])
def test_greedy_matches_hf_under_the_same_mask(tiny_model_factory, ll_tokenizer, model_name):
    path = tiny_model_factory(model_name)
    hf = load_hf_model(path)
    llm = LLM(path, dtype="float32", max_model_len=256)
    prompts = rand_prompts(2, 0)
    reasons = set()
    for name, spec in SPECS.items():
        outs = llm.generate(prompts, greedy(spec), use_tqdm=False)
        for prompt, out in zip(prompts, outs, strict=True):
            want, reason = hf_constrained_greedy(hf, ll_tokenizer, prompt["prompt_token_ids"], spec, 40)
            got = out.outputs[0]
            assert got.token_ids == want, (name, got.text)
            assert got.finish_reason == reason, name
            reasons.add(reason)
    assert reasons == {"stop", "length"} or reasons == {"stop"}
    assert_all_blocks_free(llm)


@pytest.fixture(scope="module")
def model_path(tiny_model_factory) -> str:
    return tiny_model_factory("llama-gqa-untied")


def check_output(name: str, text: str, finish_reason: str) -> None:
    """A complete output is in its language (checked without llguidance)."""
    if finish_reason != "stop":
        return
    if name == "json":
        value = json.loads(text)
        assert set(value) == {"flag", "kind", "count"}, text
        assert isinstance(value["flag"], bool) and value["kind"] in ("cat", "dog", "owl")
        assert isinstance(value["count"], int) and 0 <= value["count"] <= 99
    elif name == "json_object":
        assert isinstance(json.loads(text), dict)
    elif name == "choice":
        assert text in SPECS["choice"].choice
    elif name == "regex":
        assert re.fullmatch(r"[a-c]{2,6}-\d\d", text), text
    elif name == "grammar":
        assert text == "none" or (text[0] == "<" and text[-1] == ">" and set(text[1:-1]) <= set("xyz")), text


def mixed_workload(seed: int) -> tuple[list[dict], list[SamplingParams], list[str | None]]:
    """Constrained requests of every kind between free ones, greedy and seeded."""
    rng = random.Random(seed)
    prompts = rand_prompts(16, seed)
    names: list[str | None] = [None if i % 3 == 2 else list(SPECS)[i % len(SPECS)] for i in range(16)]
    params = []
    for i, name in enumerate(names):
        temperature = 0.0 if i % 2 else 0.9
        params.append(
            SamplingParams(
                temperature=temperature,
                seed=i,
                max_tokens=rng.randrange(8, 48),
                structured_outputs=SPECS[name] if name else None,
                ignore_eos=name is None,
            )
        )
    return prompts, params, names


@pytest.mark.slow
@pytest.mark.parametrize(
    "options",
    [
        {"max_num_batched_tokens": 16, "max_num_seqs": 6},  # chunked prefill next to decodes, a queue
        {"num_kv_blocks": 14, "block_size": 8},  # recompute preemption
        {"num_kv_blocks": 14, "block_size": 8, "preemption_mode": "swap", "swap_space": 1 << 20},
    ],
    ids=["chunked", "recompute", "swap"],
)
def test_batched_outputs_equal_each_request_alone(model_path, options):
    prompts, params, names = mixed_workload(1)
    alone = LLM(model_path, dtype="float32", max_model_len=128, max_num_seqs=1)
    want = [alone.generate([p], [sp], use_tqdm=False)[0].outputs[0] for p, sp in zip(prompts, params, strict=True)]
    llm = LLM(model_path, dtype="float32", max_model_len=128, **options)
    got = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    for name, g, w in zip(names, got, want, strict=True):
        assert (g.token_ids, g.finish_reason) == (w.token_ids, w.finish_reason), name
        if name is not None:
            check_output(name, g.text, g.finish_reason)
    assert sum(o.finish_reason == "stop" for o, n in zip(got, names, strict=True) if n) >= 5
    if "num_kv_blocks" in options:
        assert llm.stats()["num_preemptions"] > 0
    assert_all_blocks_free(llm)


def constrained_only(seed: int, greedy_only: bool) -> tuple[list[dict], list[SamplingParams]]:
    prompts, params, names = mixed_workload(seed)
    keep = [i for i, n in enumerate(names) if n is not None and (params[i].temperature == 0 or not greedy_only)]
    return [prompts[i] for i in keep], [params[i] for i in keep]


@pytest.mark.slow
@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_speculation_leaves_constrained_outputs_unchanged(tiny_model_factory, method):
    """Drafts the grammar refuses are dropped before verification; the rest are verified under each position's
    own mask. Greedy tokens equal speculation off; seeded sampled ones too with n-gram (one-hot drafts are accepted
    iff they equal the plain draw). Drafts are verified and accepted for the constrained requests themselves."""
    path = tiny_model_factory("llama-loops")  # loops: the n-gram proposer has drafts to offer
    prompts, params = constrained_only(2, greedy_only=method != "ngram")
    plain = LLM(path, dtype="float32", max_model_len=128)
    want = [
        (o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in plain.generate(prompts, params, use_tqdm=False)
    ]
    spec = {"method": method, "num_speculative_tokens": 3, "adaptive": False}
    if method == "ngram":
        spec |= {"prompt_lookup_min": 1, "prompt_lookup_max": 3}
    else:
        spec["model"] = path  # the target itself: its unconstrained guesses, cut by the grammar
    llm = LLM(path, dtype="float32", max_model_len=128, speculative_config=spec)
    got = [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == want
    stats = llm.stats()["spec_decoding"]
    assert stats["num_draft_tokens"] > 0 and stats["num_accepted_tokens"] > 0, stats
    assert_all_blocks_free(llm)


def test_sampling_draws_from_the_masked_distribution(model_path, ll_tokenizer):
    """With temperature 1, the first token is drawn with the model's probabilities renormalised over the tokens
    the grammar allows there (any tokenization of a choice is allowed: "dog" or "d" + "og"), checked against HF's
    logits and llguidance's own mask, within 4.5 standard deviations per token."""
    spec = StructuredOutputsParams(choice=["cat", "dog", "the", "and"])
    prompt = rand_prompts(1, 5)[0]
    with torch.no_grad():
        logits = load_hf_model(model_path)(torch.tensor([prompt["prompt_token_ids"]])).logits[0, -1]
    matcher = llguidance.LLMatcher(ll_tokenizer, check(spec))
    bits = np.unpackbits(np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
    allowed = np.flatnonzero(bits[: logits.shape[0]]).tolist()
    assert 4 < len(allowed) < 40
    probs = dict(zip(allowed, torch.softmax(logits[allowed], dim=0).tolist(), strict=True))
    n = 400
    llm = LLM(model_path, dtype="float32", max_model_len=128)
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=1, structured_outputs=spec) for s in range(n)]
    outs = llm.generate([prompt] * n, params, use_tqdm=False)
    counts = dict.fromkeys(allowed, 0)
    for o in outs:
        counts[o.outputs[0].token_ids[0]] += 1  # a KeyError: a token the grammar forbids
    assert sum(p > 0.1 for p in probs.values()) >= 2  # not decided by one dominant token
    for token, p in probs.items():
        assert abs(counts[token] - n * p) <= 4.5 * math.sqrt(n * p * (1 - p)) + 1, (token, counts, probs)
    assert_all_blocks_free(llm)


def test_a_complete_output_stops_without_eos_and_keeps_its_last_token(model_path):
    llm = LLM(model_path, dtype="float32", max_model_len=128)
    spec = StructuredOutputsParams(choice=["alpha", "beta gamma"])
    for ignore_eos in (False, True):
        (out,) = llm.generate(rand_prompts(1, 3), greedy(spec, 32, ignore_eos=ignore_eos), use_tqdm=False)
        assert out.outputs[0].text in ("alpha", "beta gamma")
        assert (out.outputs[0].finish_reason, out.outputs[0].stop_reason) == ("stop", None)
    # n > 1: every sequence follows the grammar.
    (out,) = llm.generate(rand_prompts(1, 3), SamplingParams(n=3, max_tokens=8, structured_outputs=spec, seed=1))
    assert all(c.text in ("alpha", "beta gamma") for c in out.outputs)
    assert_all_blocks_free(llm)


def test_bad_specs_are_refused_and_the_engine_goes_on(model_path):
    llm = LLM(model_path, dtype="float32", max_model_len=128)
    for spec in (StructuredOutputsParams(regex="[a-"), StructuredOutputsParams(json='{"type": "nonsense"}')):
        with pytest.raises(ValueError, match="structured output|JSON"):
            llm.generate(rand_prompts(1, 0), greedy(spec), use_tqdm=False)
    (out,) = llm.generate(rand_prompts(1, 0), greedy(SPECS["regex"]), use_tqdm=False)
    check_output("regex", out.outputs[0].text, out.outputs[0].finish_reason)
    assert_all_blocks_free(llm)


def test_async_scheduling_runs_constrained_requests_synchronously(model_path):
    """With async scheduling, constrained requests are served, not refused: the engine finishes the step in flight
    and runs synchronous steps while one is there, so every output equals the synchronous engine's (free
    requests alongside included), then goes back to async steps."""
    prompts, params, _ = mixed_workload(5)
    want = LLM(model_path, dtype="float32", max_model_len=128).generate(prompts, params, use_tqdm=False)
    llm = LLM(model_path, dtype="float32", max_model_len=128, async_scheduling=True)
    engine = llm.engine
    free = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    engine.add_request("free-before", rand_prompts(1, 9)[0], free)
    engine.step()
    assert engine.engine_core._in_flight is not None  # an async step is in flight when the constrained ones come
    got = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert [o.outputs[0].text for o in got] == [o.outputs[0].text for o in want]
    engine.add_request("free-after", rand_prompts(1, 10)[0], free)
    engine.step()
    assert engine.engine_core._in_flight is not None  # async again
    while engine.has_unfinished_requests():
        engine.step()
    assert_all_blocks_free(llm)


def test_a_slow_grammar_compiles_beside_the_engine(model_path):
    """A grammar that takes a while to compile (100,000 choices: ~0.7 s on an idle kind A) does not stop the engine: the
    free requests sent with it are scheduled at once, while it waits in the queue; then it runs, under its
    grammar."""
    llm = LLM(model_path, dtype="float32", max_model_len=128)
    engine = llm.engine
    choices = [f"option {i:05d}" for i in range(100_000)]
    engine.add_request("slow", rand_prompts(1, 7)[0], greedy(StructuredOutputsParams(choice=choices), 8))
    for i, prompt in enumerate(rand_prompts(3, 8)):
        engine.add_request(f"free{i}", prompt, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    scheduler = engine.engine_core.scheduler
    assert not scheduler.requests["slow"].grammar.ready  # compiling on its own thread; add_request returned
    engine.step()
    assert {r.request_id for r in scheduler.running} == {"free0", "free1", "free2"}
    assert [r.request_id for r in scheduler.waiting] == ["slow"]
    text = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == "slow" and out.finished:
                text = out.outputs[0].text
    assert text in choices
    assert_all_blocks_free(llm)

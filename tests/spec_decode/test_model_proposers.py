"""Draft-model and EAGLE speculation end to end on tiny random models (fp32): greedy outputs token-identical to
speculation off with batching, prefix hits, chunked prefill, preemption and n > 1; seeded sampling reproducible;
sampled outputs equal in distribution; every KV block free afterwards (the draft pool mirrors the target's
block ids, so the target's free blocks are the draft's too)."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from kvserve import LLM, SamplingParams
from tests.conftest import assert_all_blocks_free
from tests.engine.test_spec_decode import assert_same_greedy, copy_prompts, token_ids

K = 3


def spec_config(method: str, model: str) -> dict:
    return {"method": method, "model": model, "num_speculative_tokens": K, "adaptive": False}


@pytest.fixture(scope="module")
def plain(target_path) -> LLM:
    return LLM(target_path, dtype="float32", max_model_len=256)


@pytest.fixture(scope="module", params=["draft_self", "draft_other", "eagle"])
def spec(request, target_path, tiny_model_factory, eagle_head_path) -> LLM:
    """The draft is the target itself (all drafts accepted: the long-accept path), another tiny model of the same
    vocabulary and a different KV shape (1 KV head), or a random EAGLE head (mostly rejected)."""
    config = {
        "draft_self": spec_config("draft_model", target_path),
        "draft_other": spec_config("draft_model", tiny_model_factory("llama-mqa-tied")),
        "eagle": spec_config("eagle", eagle_head_path),
    }[request.param]
    return LLM(target_path, dtype="float32", max_model_len=256, speculative_config=config)


def test_greedy_identical_batched_and_prefix_hits(plain, spec):
    prompts = copy_prompts(5, 11)
    assert_same_greedy(plain, spec, prompts, max_tokens=40)
    hits = spec.stats()["prefix_cache"]["num_hit_tokens"]
    shared = [{"prompt_token_ids": p["prompt_token_ids"] + [7, 8, 9]} for p in prompts[:3]]
    assert_same_greedy(plain, spec, prompts[:3] + shared, max_tokens=40)
    assert spec.stats()["prefix_cache"]["num_hit_tokens"] > hits


def test_greedy_identical_with_n_and_stops(plain, spec):
    prompts = copy_prompts(2, 12)
    ref = token_ids(plain, prompts, SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))
    got = token_ids(spec, prompts, SamplingParams(max_tokens=30, n=2, temperature=0.0, ignore_eos=True))
    assert got == [r for r in ref for _ in range(2)]
    stop = ref[0][17]
    out = spec.generate(prompts[0], SamplingParams(max_tokens=30, temperature=0.0, stop_token_ids=[stop]))[0]
    assert out.outputs[0].token_ids == ref[0][: ref[0].index(stop) + 1]
    assert_all_blocks_free(spec)


def small_pool_llm(target_path: str, config: dict, **kwargs) -> LLM:
    """A pool of 14 blocks and 24 tokens per step: five requests of ~80 tokens force chunked prefill and
    preemption."""
    return LLM(
        target_path,
        dtype="float32",
        max_model_len=256,
        max_num_batched_tokens=24,
        num_kv_blocks=14,
        speculative_config=config,
        **kwargs,
    )


@pytest.mark.parametrize("method", ["draft_model", "eagle"])
def test_greedy_identical_with_chunked_prefill_and_preemption(method, target_path, eagle_head_path, plain):
    model = target_path if method == "draft_model" else eagle_head_path
    llm = small_pool_llm(target_path, spec_config(method, model))
    assert_same_greedy(plain, llm, copy_prompts(5, 13, length=16), max_tokens=40)
    assert llm.stats()["num_preemptions"] > 0


def test_draft_of_itself_accepts_everything(target_path, plain):
    llm = LLM(
        target_path, dtype="float32", max_model_len=256, speculative_config=spec_config("draft_model", target_path)
    )
    assert_same_greedy(plain, llm, copy_prompts(3, 14), max_tokens=33)
    stats = llm.stats()["spec_decoding"]
    # Target and draft compute the same argmax, except where batched scoring rounds a near-tie differently.
    assert stats["acceptance_rate"] > 0.95, stats


def test_sampled_distribution_matches(target_path, noisy_draft_path, plain):
    """Full draft distributions q (the draft is the target with a noisy LM head, so q != p): the tokens at
    output positions 1-3 are distributed as without speculation (two-sample chi-square)."""
    llm = LLM(
        target_path, dtype="float32", max_model_len=256, speculative_config=spec_config("draft_model", noisy_draft_path)
    )
    prompt = {"prompt_token_ids": [11, 12, 13, 14] * 4}
    params = SamplingParams(max_tokens=4, temperature=1.5, top_k=6, ignore_eos=True, n=600)
    a = token_ids(llm, prompt, params)
    b = token_ids(plain, prompt, params)
    stats = llm.stats()["spec_decoding"]
    assert 0 < stats["num_accepted_tokens"] < stats["num_draft_tokens"], stats
    assert_same_distribution(a, b, (1, 2, 3))
    assert_all_blocks_free(llm)


def assert_same_distribution(a: list[list[int]], b: list[list[int]], positions) -> None:
    """Two-sample chi-square, per output position: the tokens of samples `a` and `b` come from one distribution."""
    for pos in positions:
        ca, cb = Counter(t[pos] for t in a), Counter(t[pos] for t in b)
        keys = sorted(set(ca) | set(cb))
        table = torch.tensor([[ca[k] for k in keys], [cb[k] for k in keys]], dtype=torch.float64)
        expected = table.sum(1, keepdim=True) * table.sum(0, keepdim=True) / table.sum()
        stat = ((table - expected) ** 2 / expected).sum()
        pvalue = float(torch.special.gammaincc(torch.tensor((len(keys) - 1) / 2, dtype=torch.float64), stat / 2))
        assert pvalue > 1e-3, (pos, ca, cb)


def test_seeded_sampling_reproducible(spec):
    prompts = copy_prompts(3, 15)
    params = SamplingParams(max_tokens=24, temperature=0.9, top_p=0.9, seed=5, ignore_eos=True)
    first = token_ids(spec, prompts, params)
    assert token_ids(spec, prompts[:1], params) == first[:1]  # other batch, same tokens
    assert_all_blocks_free(spec)


@pytest.mark.parametrize(
    "config,match",
    [
        ({"method": "draft_model", "num_speculative_tokens": 2}, "needs 'model'"),
        ({"method": "eagle", "model": "/nonexistent", "num_speculative_tokens": 2}, "no EAGLE head"),
    ],
)
def test_config_errors(target_path, config, match):
    with pytest.raises(ValueError, match=match):
        LLM(target_path, dtype="float32", max_model_len=64, speculative_config=config)


def test_policy_limits_bound_the_draft_steps(target_path, eagle_head_path, plain):
    """With the cost-aware policy (the default) each proposal stays within the limit the scheduler sent (a
    request at 0 gets none: tests/spec_decode/test_policy.py checks that drafts that never pay end there)."""
    config = {"method": "eagle", "model": eagle_head_path, "num_speculative_tokens": K}
    llm = LLM(target_path, dtype="float32", max_model_len=256, speculative_config=config)
    proposer = llm.engine.engine_core.executor.driver_runner.proposer
    seen: list[tuple[int, int]] = []
    propose = proposer.propose

    def recording(step):
        proposal = propose(step)
        seen.extend((len(d), int(m)) for d, m in zip(proposal.drafts, step.max_drafts, strict=True))
        return proposal

    proposer.propose = recording
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    prompts = copy_prompts(3, 31)
    assert token_ids(llm, prompts, params) == token_ids(plain, prompts, params)
    assert seen and all(n <= m for n, m in seen)


def test_swap_preemption_takes_the_drafts_kv_along(target_path, plain):
    """Swapped-out requests come back with the draft's KV too (it mirrors the target's block ids): the target
    drafting for itself keeps accepting nearly everything across swaps, and greedy outputs stay identical."""
    config = spec_config("draft_model", target_path)
    llm = small_pool_llm(target_path, config, preemption_mode="swap", swap_space=1 << 20)
    assert_same_greedy(plain, llm, copy_prompts(5, 16, length=16), max_tokens=40)
    stats = llm.stats()
    assert stats["num_swapped_out"] > 0 and stats["num_swapped_in"] == stats["num_swapped_out"]
    assert stats["spec_decoding"]["acceptance_rate"] > 0.95, stats["spec_decoding"]

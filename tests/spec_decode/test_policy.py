"""The cost-aware speculation policy end to end on tiny models (fp32): requests it leaves out of a model
proposer are caught up on exactly (the target drafting for itself keeps accepting nearly everything), greedy
outputs stay token-identical to speculation off under batching, prefix hits, chunked prefill and preemption,
and a proposer whose drafts are never accepted ends up at k = 0 on most steps."""

from __future__ import annotations

import pytest

from kvserve import LLM, SamplingParams
from tests.conftest import assert_all_blocks_free
from tests.engine.test_spec_decode import assert_same_greedy, copy_prompts, token_ids
from tests.spec_decode.test_model_proposers import small_pool_llm

K = 3


@pytest.fixture(scope="module")
def plain(target_path) -> LLM:
    return LLM(target_path, dtype="float32", max_model_len=256)


def force_limits(llm: LLM, pattern: list[bool]) -> None:
    """Replace the policy's decisions: in step s every request gets K drafts if pattern[s % len] else none
    (left out of the proposer), so that leaving out and catching up happen on a fixed schedule."""
    policy = llm.engine.engine_core.scheduler.spec_policy

    def grant(states, samples, step_id):
        n = K if pattern[step_id % len(pattern)] else 0
        for s in states:
            s.limit, s.probing = n, False
        return [n] * len(states)

    policy.grant = grant


@pytest.mark.parametrize("method", ["draft_self", "eagle"])
def test_left_out_requests_catch_up_exactly(target_path, eagle_head_path, plain, method):
    kind, model = ("draft_model", target_path) if method == "draft_self" else ("eagle", eagle_head_path)
    config = {"method": kind, "model": model, "num_speculative_tokens": K}
    llm = LLM(target_path, dtype="float32", max_model_len=256, speculative_config=config)
    # Out for 1-3 steps at a time; the 3-step gap also spans prompts' whole prefills.
    force_limits(llm, [True, False, True, True, False, False, True, False, False, False, True])
    prompts = copy_prompts(5, 41)
    assert_same_greedy(plain, llm, prompts, max_tokens=40)
    shared = [{"prompt_token_ids": p["prompt_token_ids"] + [7, 8, 9]} for p in prompts[:3]]
    hits = llm.stats()["prefix_cache"]["num_hit_tokens"]
    assert_same_greedy(plain, llm, prompts[:3] + shared, max_tokens=40)
    assert llm.stats()["prefix_cache"]["num_hit_tokens"] > hits
    if method == "draft_self":
        # Stale draft KV at a skipped position would make the draft disagree with the target.
        assert llm.stats()["spec_decoding"]["acceptance_rate"] > 0.95, llm.stats()["spec_decoding"]


@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
def test_left_out_requests_with_chunked_prefill_and_preemption(target_path, plain, preemption_mode):
    config = {"method": "draft_model", "model": target_path, "num_speculative_tokens": K}
    kw = {"swap_space": 1 << 20} if preemption_mode == "swap" else {}
    llm = small_pool_llm(target_path, config, preemption_mode=preemption_mode, **kw)
    force_limits(llm, [True, False, False, True, True, False])
    assert_same_greedy(plain, llm, copy_prompts(5, 16, length=16), max_tokens=40)
    stats = llm.stats()
    assert stats["num_preemptions"] > 0
    # NOTE: far lower than the 0.95 above (0.62 recompute, 0.40 swap when written), a known limit: a preempted
    # request's record of skipped positions goes with it, so the blocks computed while it was left out hold no
    # draft KV when it comes back (nor when a prefix hit finds them). That costs acceptance, never correctness;
    # the forced schedule here leaves requests out far more often than the policy would a paying one.
    assert stats["spec_decoding"]["acceptance_rate"] > 0.3, stats["spec_decoding"]


def test_zero_acceptance_ends_at_k0_on_most_steps(target_path, plain):
    """A draft model whose every draft is a token the target never emits: after a few steps the policy gives
    the requests no drafts (and the proposer skips them) except for sparse probes; outputs stay identical."""
    prompts = copy_prompts(4, 51)
    params = SamplingParams(max_tokens=80, temperature=0.0, ignore_eos=True)
    ref = token_ids(plain, prompts, params)
    bad = next(t for t in range(3, 1000) if all(t not in r for r in ref))
    config = {"method": "draft_model", "model": target_path, "num_speculative_tokens": K}
    llm = LLM(target_path, dtype="float32", max_model_len=256, speculative_config=config)
    proposer = llm.engine.engine_core.executor.driver_runner.proposer
    inner = proposer._propose
    passes: list[int] = []

    def wrong(step):
        proposal = inner(step)
        proposal.drafts = [[bad] * len(d) for d in proposal.drafts]
        passes.append(len(step.rows))
        return proposal

    proposer._propose = wrong
    scheduler = llm.engine.engine_core.scheduler
    schedule = scheduler.schedule
    verified: list[int] = []  # per decode step: requests that verify drafts in it

    def recording():
        so = schedule()
        if so.num_scheduled_tokens and not so.scheduled_new_reqs:
            verified.append(len(so.scheduled_spec_decode_tokens))
        return so

    scheduler.schedule = recording
    assert token_ids(llm, prompts, params) == ref
    stats = llm.stats()["spec_decoding"]
    assert stats["num_accepted_tokens"] == 0 and stats["num_drafts"] > 0
    # 4 requests over ~80 decode steps: drafts in at most 1 of 5 request-steps (the start and sparse probes).
    assert sum(verified) <= 0.2 * 4 * len(verified), verified
    assert sum(passes) <= 0.2 * 4 * len(verified), passes
    assert_all_blocks_free(llm)

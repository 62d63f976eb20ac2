"""Greedy token ids equal HF transformers (fp32) for 32 tokens, under every engine condition.

Each condition changes how the work is cut up (batch order, prefix-cache hits, chunk sizes, preemption, block
size) but must never change the tokens.
"""

from __future__ import annotations

import random
import zlib

import pytest

from kvserve import LLM, SamplingParams
from tests.conftest import TINY_MODELS, assert_all_blocks_free, hf_greedy, load_hf_model

NUM_TOKENS = 32
GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)

# name -> engine kwargs. Every condition runs the same prompts twice (the second round hits the prefix cache
# where it is on), once in order and once reversed.
CONDITIONS = {
    "default-block16": dict(),
    "block8": dict(block_size=8),
    "block32": dict(block_size=32),
    "chunked-budget8": dict(max_num_batched_tokens=8),
    "no-chunked-prefill": dict(enable_chunked_prefill=False, max_num_batched_tokens=512),
    "prefix-cache-off": dict(enable_prefix_caching=False),
    "one-seq-at-a-time": dict(max_num_seqs=1),
    # 24 blocks of 8 hold ~1.4 of the longest requests (100 + 32 tokens): forces preemption by recompute.
    "preemption-tiny-pool": dict(block_size=8, num_kv_blocks=24, max_num_batched_tokens=64),
}
# Every layer windowed: requests release the blocks behind the window, so the tiny pool need not preempt them
# (tests/models/test_sliding_window.py forces preemption there with bigger prefills).
RELEASES_BLOCKS = {"mistral-window12"}


def make_prompts(seed: int) -> list[list[int]]:
    """Random token prompts: two pairs sharing a 40-token prefix, plus unrelated lengths 5..100."""
    rng = random.Random(seed)

    def toks(n: int) -> list[int]:
        return [rng.randrange(3, 49000) for _ in range(n)]

    shared = toks(40)
    return [shared + toks(9), toks(5), shared + toks(23), toks(17), toks(100), shared[:33] + toks(2)]


@pytest.fixture(scope="module")
def references(tiny_model_factory):
    cache: dict[str, tuple[str, list[list[int]], list[list[int]]]] = {}

    def get(name: str):
        if name not in cache:
            path = tiny_model_factory(name)
            prompts = make_prompts(zlib.crc32(name.encode()) % 1000)
            hf = load_hf_model(path)
            cache[name] = (path, prompts, [hf_greedy(hf, p, NUM_TOKENS) for p in prompts])
        return cache[name]

    return get


def run_condition(llm: LLM, prompts: list[list[int]]) -> list[list[list[int]]]:
    """Three rounds: in order, reversed, in order again (warm prefix cache). Returns token ids per round."""
    rounds = []
    for order in (list(range(len(prompts))), list(reversed(range(len(prompts)))), list(range(len(prompts)))):
        outs = llm.generate([{"prompt_token_ids": prompts[i]} for i in order], GREEDY, use_tqdm=False)
        by_prompt = {i: o.outputs[0].token_ids for i, o in zip(order, outs, strict=True)}
        rounds.append([by_prompt[i] for i in range(len(prompts))])
    return rounds


@pytest.mark.parametrize("name", list(TINY_MODELS))
def test_greedy_matches_hf_under_all_conditions(name, references):
    path, prompts, refs = references(name)
    for cond, kwargs in CONDITIONS.items():
        llm = LLM(path, dtype="float32", max_model_len=512, **kwargs)
        for round_idx, got in enumerate(run_condition(llm, prompts)):
            for i, (g, r) in enumerate(zip(got, refs, strict=True)):
                assert g == r, f"{name} / {cond} / round {round_idx} / prompt {i}: {g} != {r}"
        stats = llm.stats()
        if kwargs.get("enable_prefix_caching", True):
            assert stats["prefix_cache"]["num_hit_tokens"] > 0, f"{cond}: expected prefix-cache hits"
        else:
            assert stats["prefix_cache"]["num_hit_tokens"] == 0
        if cond == "preemption-tiny-pool" and name not in RELEASES_BLOCKS:
            assert stats["num_preemptions"] > 0, "the tiny pool was meant to force preemption"
        assert_all_blocks_free(llm)


# ---------------------------------------------------------------------------- the embedded GGUF model

SMOL_CONDITIONS = {
    "batched-block16": dict(),
    "chunked8-block8-preempt": dict(block_size=8, max_num_batched_tokens=8, num_kv_blocks=30),
    "prefix-off-block32": dict(block_size=32, enable_prefix_caching=False),
}


@pytest.fixture(scope="module")
def smollm2_references(smollm2_gguf, smollm2_tokenizer):
    import os

    tok = smollm2_tokenizer
    chats = [
        "What is the capital of France?",
        "Write a haiku about the sea.",
        "List three prime numbers and explain why they are prime.",
    ]
    prompts = [
        tok.apply_chat_template([{"role": "user", "content": c}], tokenize=False, add_generation_prompt=True)
        for c in chats
    ] + ["The quick brown fox", "def fibonacci(n):\n"]
    prompt_ids = [tok(p, add_special_tokens=False).input_ids for p in prompts]
    hf = load_hf_model(os.path.dirname(smollm2_gguf), gguf_file=os.path.basename(smollm2_gguf))
    return prompt_ids, [hf_greedy(hf, p, NUM_TOKENS) for p in prompt_ids]


@pytest.mark.slow
@pytest.mark.parametrize("cond", list(SMOL_CONDITIONS))
def test_smollm2_gguf_greedy_matches_hf(cond, smollm2_gguf, smollm2_references):
    prompts, refs = smollm2_references
    llm = LLM(smollm2_gguf, dtype="float32", quantization="none", max_model_len=256, **SMOL_CONDITIONS[cond])
    for round_idx, got in enumerate(run_condition(llm, prompts)):
        for i, (g, r) in enumerate(zip(got, refs, strict=True)):
            assert g == r, f"{cond} / round {round_idx} / prompt {i}: {g} != {r}"
    if "preempt" in cond:
        assert llm.stats()["num_preemptions"] > 0
    assert_all_blocks_free(llm)


@pytest.mark.slow
def test_smollm2_chat_answers_capital_of_france(smollm2_gguf):
    """The demo question, in the default dtype (bf16)."""
    llm = LLM(smollm2_gguf, max_model_len=256)
    out = llm.chat(
        [{"role": "user", "content": "What is the capital of France?"}],
        SamplingParams(temperature=0, max_tokens=24),
        use_tqdm=False,
    )
    assert "Paris" in out[0].outputs[0].text
    assert out[0].outputs[0].finish_reason == "stop"
    assert_all_blocks_free(llm)

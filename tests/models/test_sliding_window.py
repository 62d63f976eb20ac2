"""Sliding-window attention: greedy tokens equal HF transformers (fp32) on a model whose every layer has a window
(Mistral) and on one with alternating local/global layers (Qwen2's layer_types), with windows far shorter than
the prompts and the generations, under every engine condition; blocks behind the window are released as a
request grows (so it holds a bounded number), and combinations that would attend over the whole context are
refused before loading."""

from __future__ import annotations

import dataclasses
import random

import pytest

from kvserve import LLM, SamplingParams
from kvserve.engine.arg_utils import EngineArgs
from kvserve.engine.combinations import refusals
from kvserve.engine.llm_engine import LLMEngine
from kvserve.utils import cdiv
from tests.conftest import assert_all_blocks_free, hf_greedy, load_hf_model, triton_once

NUM_TOKENS = 48  # generation well past the windows (12 and 10)
GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)
MODELS = {"mistral-window12": 12, "qwen2-local-global": 10}

CONDITIONS = {
    "block4": dict(block_size=4),
    "block16": dict(block_size=16),
    "chunked-budget8": dict(block_size=4, max_num_batched_tokens=8),
    "prefix-cache-off": dict(block_size=4, enable_prefix_caching=False),
    "one-seq-at-a-time": dict(block_size=4, max_num_seqs=1),
    # 28 blocks of 4 hold the longest request (61 + 48 tokens; a request may not outgrow the pool even with a
    # window) but not the six at once, and a budget of 128 admits big prefills: forces preemption by recompute
    # (with the windowed model too, whose requests otherwise hold only ~4 blocks each once decoding).
    "preemption-tiny-pool": dict(block_size=4, num_kv_blocks=28, max_num_batched_tokens=128),
    "torch-reference": dict(block_size=4, attention_backend="torch"),
}


def make_prompts(seed: int) -> list[list[int]]:
    """Prompts longer and shorter than the windows; two pairs share a 30-token prefix (prefix-cache hits)."""
    rng = random.Random(seed)

    def toks(n: int) -> list[int]:
        return [rng.randrange(3, 49000) for _ in range(n)]

    shared = toks(30)
    return [shared + toks(9), toks(5), shared + toks(21), toks(17), toks(61), shared[:27] + toks(3)]


@pytest.fixture(scope="module")
def references(tiny_model_factory):
    cache: dict[str, tuple[str, list[list[int]], list[list[int]]]] = {}

    def get(name: str):
        if name not in cache:
            path = tiny_model_factory(name)
            prompts = make_prompts(len(name))
            hf = load_hf_model(path)
            cache[name] = (path, prompts, [hf_greedy(hf, p, NUM_TOKENS) for p in prompts])
        return cache[name]

    return get


@pytest.mark.parametrize("condition", list(CONDITIONS))
@pytest.mark.parametrize("name", list(MODELS))
def test_greedy_parity_with_hf(references, name, condition):
    path, prompts, want = references(name)
    llm = LLM(path, dtype="float32", max_model_len=256, **CONDITIONS[condition])
    batch = [{"prompt_token_ids": p} for p in prompts]
    for round_ in range(2):  # the second round hits the prefix cache (where it is on), in reverse order
        order = list(range(len(prompts)))
        if round_:
            order.reverse()
        outs = llm.generate([batch[i] for i in order], GREEDY, use_tqdm=False)
        for i, out in zip(order, outs, strict=True):
            assert out.outputs[0].token_ids == want[i], f"prompt {i} (round {round_})"
    stats = llm.stats()
    if condition != "prefix-cache-off":
        assert stats["prefix_cache"]["num_hit_tokens"] > 0
    if condition == "preemption-tiny-pool":
        assert stats["num_preemptions"] > 0
    assert_all_blocks_free(llm)


def test_hf_reference_differs_from_full_attention(references, tiny_model_factory):
    """Without this, parity could hold because the windows never mattered: the same weights with the window
    switched off (HF) give other tokens for the long prompts."""
    import transformers

    for name in MODELS:
        path, prompts, want = references(name)
        config = transformers.AutoConfig.from_pretrained(path)
        config.sliding_window = None
        config.use_sliding_window = False
        if hasattr(config, "layer_types"):
            config.layer_types = ["full_attention"] * config.num_hidden_layers
        full = transformers.AutoModelForCausalLM.from_pretrained(path, config=config, attn_implementation="eager")
        assert hf_greedy(full.float().eval(), prompts[4], NUM_TOKENS) != want[4], name


def run_one(engine: LLMEngine, prompt: list[int], num_tokens: int) -> list[int]:
    """Steps one request to its end; returns how many blocks it held after each step."""
    engine.add_request("r", {"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=num_tokens))
    kv = engine.engine_core.scheduler.kv
    held = []
    while engine.has_unfinished_requests():
        engine.step()
        held.append(kv.num_held_blocks("r"))
    return held


def test_blocks_behind_the_window_are_released(tiny_model_factory):
    """Every layer windowed (12 keys), blocks of 4: a request holds at most cdiv(11, 4) + 1 blocks behind its next
    query plus the blocks of the tokens it schedules, however long it grows; the pool shows the rest free."""
    path = tiny_model_factory("mistral-window12")
    engine = LLMEngine.from_engine_args(
        EngineArgs(model=path, dtype="float32", max_model_len=256, block_size=4, max_num_batched_tokens=8)
    )
    prompt = [random.Random(1).randrange(3, 49000) for _ in range(40)]
    held = run_one(engine, prompt, 150)
    bound = cdiv(12 - 1, 4) + 1 + cdiv(8, 4)  # the window's blocks + a chunk of 8 new tokens
    assert max(held[:-1]) <= bound and len(held) > 150
    assert held[-1] == 0  # finished: everything released
    pool = engine.engine_core.scheduler.kv.pool
    assert pool.num_free_blocks == pool.num_blocks and all(b.ref_cnt == 0 for b in pool.blocks)


def test_local_global_model_keeps_every_block(tiny_model_factory):
    """A full-attention layer reads the whole context, so nothing may be released."""
    path = tiny_model_factory("qwen2-local-global")
    engine = LLMEngine.from_engine_args(EngineArgs(model=path, dtype="float32", max_model_len=256, block_size=4))
    held = run_one(engine, [5] * 40, 60)
    assert held[-2] == cdiv(40 + 59, 4)  # before the last step: every block of the context


def test_gpu_refused_before_loading(tiny_model_factory):
    config = EngineArgs(model=tiny_model_factory("mistral-window12"), dtype="float32").create_engine_config()
    on_gpu = dataclasses.replace(config, model=dataclasses.replace(config.model, device="cuda"))
    assert any(r.startswith("a sliding-window model on the GPU") for r in refusals(on_gpu))
    assert not any("sliding-window" in r for r in refusals(config))


@triton_once
def test_triton_kernels_in_the_interpreter_match_hf(references):
    """The Triton backend's kernels (in Triton's interpreter on the CPU) through the engine: windowed prefill
    chunks after cached prefixes and windowed decodes, on both models."""
    for name in MODELS:
        path, prompts, want = references(name)
        llm = LLM(path, dtype="float32", max_model_len=256, attention_backend="triton", block_size=8)
        picked = [0, 1, 2]  # the third shares a 30-token prefix with the first: hits
        outs = llm.generate(
            [{"prompt_token_ids": prompts[i]} for i in picked],
            SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
            use_tqdm=False,
        )
        for i, out in zip(picked, outs, strict=True):
            assert out.outputs[0].token_ids == want[i][:16], f"{name}: prompt {i}"
        assert llm.stats()["prefix_cache"]["num_hit_tokens"] > 0
        assert_all_blocks_free(llm)


@pytest.mark.parametrize(
    "options,match",
    [
        (dict(speculative_config={"method": "ngram", "num_speculative_tokens": 2}), "with speculative decoding"),
        (dict(preemption_mode="swap"), "with preemption_mode swap"),
    ],
)
def test_unsupported_combinations_refused_before_loading(tiny_model_factory, options, match):
    path = tiny_model_factory("mistral-window12")
    with pytest.raises(ValueError, match=match):
        EngineArgs(model=path, dtype="float32", **options).create_engine_config()

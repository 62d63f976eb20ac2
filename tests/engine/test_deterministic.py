"""Batch invariance (issue 32): a request's token ids and logprobs, greedy or seeded-sampled, are bitwise the same
whatever else is in the batch, however its prompt was cut into chunks, and whichever of its blocks came from the
prefix cache, swap or a disk tier; in bf16 and fp32, on every ISA level (`KVSERVE_CPU_ISA=avx2|generic`).

The target prompt is long enough (1,500 tokens) that a one-step prefill is a big chunk, while chunk budgets of 16
and 256 tokens, prefix hits and tier loads give small ones: any kernel whose reduction order depends on the chunk,
the batch or the row count shows up as a different logprob.
"""

from __future__ import annotations

import random

import pytest

from kvserve import LLM, SamplingParams
from kvserve.kernels.cpu import kernel_isa
from tests.conftest import assert_all_blocks_free

MODEL = "llama-hd64-long"
PROMPT_LEN = 1500
NUM_OUT = 12
DTYPES = ["bfloat16", "float32"]

GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_OUT, ignore_eos=True, logprobs=3)
SEEDED = SamplingParams(temperature=0.9, top_p=0.95, seed=7, max_tokens=NUM_OUT, ignore_eos=True, logprobs=3)
PARAMS = {"greedy": GREEDY, "seeded": SEEDED}

# (token ids, per position the sorted (token id, logprob) pairs): everything a request returns that could move.
Result = tuple[list[int], list[list[tuple[int, float]]]]


def random_tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 49000) for _ in range(n)]


TARGET = random_tokens(PROMPT_LEN, 32)


def result(out) -> Result:
    c = out.outputs[0]
    logprobs = [sorted((t, lp.logprob) for t, lp in pos.items()) for pos in c.logprobs or []]
    return list(c.token_ids), logprobs


def run_alone(llm: LLM, prompt: list[int] = TARGET) -> dict[str, Result]:
    """The prompt greedy, then seeded-sampled: one request at a time."""
    return {
        name: result(llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0])
        for name, params in PARAMS.items()
    }


@pytest.fixture(scope="module")
def model_path(tiny_model_factory) -> str:
    return tiny_model_factory(MODEL)


@pytest.fixture(scope="module", params=DTYPES)
def dtype(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def reference(model_path, dtype) -> dict[str, Result]:
    """The target alone on a fresh engine: its whole prompt in one step, nothing cached."""
    llm = LLM(model_path, dtype=dtype, deterministic=True, enable_prefix_caching=False)
    return run_alone(llm)


@pytest.mark.parametrize("budget", [16, 256, 2048])
def test_chunk_budget_does_not_change_the_output(model_path, dtype, reference, budget):
    llm = LLM(model_path, dtype=dtype, deterministic=True, enable_prefix_caching=False, max_num_batched_tokens=budget)
    assert run_alone(llm) == reference


def test_prefix_hits_do_not_change_the_output(model_path, dtype, reference):
    llm = LLM(model_path, dtype=dtype, deterministic=True)
    # A prompt sharing the target's first 1,000 tokens: the target then finds 62 blocks cached and computes the
    # rest, 508 tokens, in one chunk.
    llm.generate({"prompt_token_ids": TARGET[:1000] + random_tokens(300, 1)}, GREEDY, use_tqdm=False)
    hits = llm.stats()["prefix_cache"]["num_hit_tokens"]
    assert run_alone(llm) == reference
    assert llm.stats()["prefix_cache"]["num_hit_tokens"] >= hits + 62 * 16
    # Again: now all but the last token are hits (the seeded run hit the greedy run's blocks already).
    assert run_alone(llm) == reference
    assert_all_blocks_free(llm)


def mixed_batch(seed: int) -> tuple[list[dict], list[SamplingParams]]:
    """30 requests of every kind around the target (greedy and seeded): short and long prompts (one shares the
    target's beginning), greedy, seeded and unseeded sampling, penalties, various lengths."""
    rng = random.Random(seed)
    prompts: list[dict] = []
    params: list[SamplingParams] = []
    for i in range(29):
        n = rng.choice([3, 17, 64, 200, 700, 1200, 1900])
        prompts.append({"prompt_token_ids": random_tokens(n, 1000 + i)})
        kind = i % 4
        max_tokens = rng.randint(1, 3 * NUM_OUT)
        if kind == 0:
            params.append(SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=2))
        elif kind == 1:
            params.append(SamplingParams(temperature=1.0, seed=i, max_tokens=max_tokens, ignore_eos=True, logprobs=1))
        elif kind == 2:
            params.append(SamplingParams(temperature=0.7, top_k=20, max_tokens=max_tokens, ignore_eos=True))
        else:
            params.append(
                SamplingParams(temperature=0.0, repetition_penalty=1.2, max_tokens=max_tokens, ignore_eos=True)
            )
    prompts.append({"prompt_token_ids": TARGET[:700] + random_tokens(100, 2)})
    params.append(GREEDY)
    # The target twice (greedy and seeded) among them.
    prompts[11:11] = [{"prompt_token_ids": TARGET}]
    params[11:11] = [GREEDY]
    prompts[23:23] = [{"prompt_token_ids": TARGET}]
    params[23:23] = [SEEDED]
    assert len(prompts) == 32
    return prompts, params


def test_a_batch_of_mixed_requests_does_not_change_the_output(model_path, dtype, reference):
    prompts, params = mixed_batch(5)
    # Step by step in two arrangements: the batch in order with the default budget, and reversed with a budget
    # of 256 tokens (other chunk boundaries, other neighbours, other row counts in every kernel call).
    first = LLM(model_path, dtype=dtype, deterministic=True, max_num_seqs=32)
    outs = [result(o) for o in first.generate(prompts, params, use_tqdm=False)]
    assert outs[11] == reference["greedy"]
    assert outs[23] == reference["seeded"]
    second = LLM(model_path, dtype=dtype, deterministic=True, max_num_seqs=32, max_num_batched_tokens=256)
    outs_reversed = [result(o) for o in second.generate(prompts[::-1], params[::-1], use_tqdm=False)][::-1]
    # Every greedy or seeded request (not the unseeded ones, whose keys come from the engine's shared generator).
    for i, p in enumerate(params):
        if p.temperature == 0.0 or p.seed is not None:
            assert outs_reversed[i] == outs[i], i
    assert_all_blocks_free(first)
    assert_all_blocks_free(second)


def test_swap_preemption_does_not_change_the_output(model_path, dtype, reference):
    # Four copies of the target (no prefix caching, so each computes its own KV) in a pool that holds about 1.5 of
    # them: the later ones are preempted mid-prefill, swapped out and back in.
    llm = LLM(
        model_path,
        dtype=dtype,
        deterministic=True,
        enable_prefix_caching=False,
        num_kv_blocks=150,
        preemption_mode="swap",
        swap_space=1 << 26,
    )
    names = ["greedy", "seeded", "greedy", "seeded"]
    outs = llm.generate([{"prompt_token_ids": TARGET}] * 4, [PARAMS[n] for n in names], use_tqdm=False)
    assert [result(o) for o in outs] == [reference[n] for n in names]
    stats = llm.stats()
    assert stats["num_swapped_out"] > 0 and stats["num_swapped_in"] == stats["num_swapped_out"]
    assert_all_blocks_free(llm)


def test_disk_tier_loads_do_not_change_the_output(model_path, dtype, reference, tmp_path):
    config = {"kv_connector": "offload", "cpu_bytes": 1 << 20, "disk_path": str(tmp_path)}
    first = LLM(model_path, dtype=dtype, deterministic=True, kv_transfer_config=config)
    first.generate({"prompt_token_ids": TARGET}, GREEDY, use_tqdm=False)
    first.engine.engine_core.shutdown()  # lets queued disk writes finish
    # A restarted engine: an empty pool and RAM tier, the prompt's blocks on disk.
    second = LLM(model_path, dtype=dtype, deterministic=True, kv_transfer_config=config)
    assert run_alone(second) == reference
    assert second.stats()["kv_transfer"]["disk_hit_blocks"] >= PROMPT_LEN // 16 - 1
    second.engine.engine_core.shutdown()


def test_the_thread_count_does_not_change_the_output(model_path, dtype, reference):
    # One thread (every kernel's split over threads differs), then the automatic count again for the next tests.
    try:
        assert (
            run_alone(LLM(model_path, dtype=dtype, deterministic=True, enable_prefix_caching=False, num_threads=1))
            == reference
        )
    finally:
        LLM(model_path, dtype=dtype, deterministic=True, max_model_len=64)


def test_ngram_speculation_does_not_change_the_output(tiny_model_factory, dtype):
    """Drafts verified k + 1 positions at a time (a small chunk per request): the same tokens and logprobs as one
    token per step. (A model whose greedy outputs loop, so that prompt lookup drafts.)"""
    path = tiny_model_factory("llama-loops")
    spec = {"method": "ngram", "num_speculative_tokens": 3, "adaptive": False}
    plain = LLM(path, dtype=dtype, deterministic=True, max_model_len=512)
    speculative = LLM(path, dtype=dtype, deterministic=True, max_model_len=512, speculative_config=spec)
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True, logprobs=3)
    prompts = [{"prompt_token_ids": random_tokens(n, n)} for n in (5, 40, 300)]
    expected = [result(o) for o in plain.generate(prompts, params, use_tqdm=False)]
    assert [result(o) for o in speculative.generate(prompts, params, use_tqdm=False)] == expected
    assert speculative.stats()["spec_decoding"]["num_accepted_tokens"] > 0


def test_without_the_mode_a_big_chunk_changes_the_fp32_output(model_path):
    """deterministic=False sends a big chunk (the one-step prefill) to SDPA where the cache has the standard layout
    (fp32): the same prompt in chunks of 256 then gets other logprobs. This is what the tests above catch."""
    whole = LLM(model_path, dtype="float32", enable_prefix_caching=False, deterministic=False)
    chunked = LLM(
        model_path, dtype="float32", enable_prefix_caching=False, deterministic=False, max_num_batched_tokens=256
    )
    assert run_alone(whole) != run_alone(chunked)


def startup_line(caplog) -> str:
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("kvserve platform")]
    assert len(lines) == 1
    caplog.clear()
    return lines[0]


def test_the_startup_line_says_whether_inference_is_deterministic(model_path, caplog):
    isa = kernel_isa()
    # fp32 prompt chunks take the kernel's tile path on AVX2 and AVX-512 (paged_attention_chunk.cpp).
    chunks = "prompt chunks in tiles, big ones via SDPA" if isa != "generic" else "big chunks via SDPA"
    with caplog.at_level("INFO", logger="kvserve.startup"):
        LLM(model_path, dtype="float32", max_model_len=64, deterministic=True)
        assert startup_line(caplog).endswith(f"; kernels=C++ {isa}; deterministic=on")
        LLM(model_path, dtype="float32", max_model_len=64, deterministic=False)
        assert startup_line(caplog).endswith(f"; kernels=C++ {isa}, {chunks}; deterministic=off")
        # By default: on where it costs nothing (the pair-packed bf16 cache), else off, saying why.
        LLM(model_path, dtype="float32", max_model_len=64)
        assert startup_line(caplog).endswith(
            f"; deterministic=off (attention (C++ {isa}, {chunks}) not batch-invariant)"
        )
        LLM(model_path, dtype="bfloat16", max_model_len=64)
        if isa == "avx512_bf16":
            assert startup_line(caplog).endswith("; kernels=C++ avx512_bf16, pair-packed bf16 KV; deterministic=on")
        else:
            assert startup_line(caplog).endswith(" not batch-invariant)")
        LLM(model_path, dtype="float32", max_model_len=64, attention_backend="torch")
        assert startup_line(caplog).endswith(
            "; deterministic=off (attention (pure torch (no C++ kernels)) not batch-invariant)"
        )


def test_deterministic_is_refused_where_it_cannot_hold(model_path, monkeypatch):
    with pytest.raises(ValueError, match="torch reference attention is not batch-invariant"):
        LLM(model_path, dtype="float32", attention_backend="torch", deterministic=True)
    with pytest.raises(ValueError, match="tensor_parallel_size > 1"):
        LLM(model_path, dtype="float32", tensor_parallel_size=2, deterministic=True)
    # vLLM's switch means deterministic=True.
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")
    with pytest.raises(ValueError, match="torch reference attention is not batch-invariant"):
        LLM(model_path, dtype="float32", attention_backend="torch")
    # Without the C++ kernels (no compiler, or KVSERVE_CPU_KERNELS=0).
    monkeypatch.setattr("kvserve.attention.selector.load_cpu_kernels", lambda: None)
    with pytest.raises(ValueError, match="needs the C.. CPU kernels"):
        LLM(model_path, dtype="float32")


@pytest.mark.slow
def test_the_embedded_model_answers_the_same_on_a_prefix_hit_and_in_small_chunks():
    """Issue 32's report: SmolLM2 in bf16 answered a 3,000-token prompt differently the second time (a prefix hit)."""
    prompt = random_tokens(3000, 0)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2)
    llm = LLM(dtype="bfloat16", deterministic=True, max_model_len=4096)
    first = result(llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0])
    assert result(llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]) == first
    small = LLM(
        dtype="bfloat16",
        deterministic=True,
        max_model_len=4096,
        max_num_batched_tokens=256,
        enable_prefix_caching=False,
    )
    assert result(small.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]) == first

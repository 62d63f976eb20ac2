"""The whole engine on the Triton attention backend: greedy tokens equal HF transformers (fp32), through mixed
prefill/decode batches, prefix-cache hits, chunked prefill after a cached prefix, preemption (recompute and swap),
the offload connector's RAM and disk tiers, and decode steps fed through the persistent buffers of the CUDA-graph
path (padded batches).

With a GPU this runs on it (CUDA graphs captured for real, and eager); without one, on the CPU with the kernels in
Triton's interpreter, where the graph path runs its padded, buffer-fed steps eagerly (`capture=False`).
"""

from __future__ import annotations

import os
import random

import pytest
import torch

from kvserve import LLM, SamplingParams
from tests.conftest import assert_all_blocks_free, hf_greedy, load_hf_model

pytest.importorskip("triton")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# In the interpreter the kernels do not depend on the CPU's ISA level: once, in the native run, is enough.
pytestmark = pytest.mark.skipif(
    DEVICE == "cpu" and bool(os.environ.get("KVSERVE_CPU_ISA")), reason="forced ISA level: Triton tests run once"
)
NUM_TOKENS = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)
MODEL = "qwen3-qknorm"  # GQA 2, head_dim 32, q/k norms


@pytest.fixture(scope="module")
def model_and_references(tiny_model_factory):
    path = tiny_model_factory(MODEL)
    rng = random.Random(14)

    def toks(n: int) -> list[int]:
        return [rng.randrange(3, 49000) for _ in range(n)]

    shared = toks(37)
    prompts = [shared + toks(6), toks(3), toks(45), shared + toks(11)]
    hf = load_hf_model(path)
    return path, prompts, [hf_greedy(hf, p, NUM_TOKENS) for p in prompts]


def make_llm(path: str, **kwargs) -> LLM:
    if DEVICE == "cuda":
        # A fixed pool: engines of earlier tests may still hold GPU memory, which would upset profiling.
        kwargs.setdefault("kv_cache_memory", 1 << 30)
    return LLM(path, dtype="float32", max_model_len=256, device=DEVICE, attention_backend="triton", **kwargs)


def check(llm: LLM, prompts, refs, rounds: int = 2) -> None:
    for round_idx in range(rounds):
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
        for i, (o, r) in enumerate(zip(outs, refs, strict=True)):
            assert o.outputs[0].token_ids == r, f"round {round_idx} / prompt {i}"
    assert_all_blocks_free(llm)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(enforce_eager=True),
        dict(enforce_eager=True, block_size=32, max_num_batched_tokens=16),
        dict(enforce_eager=True, block_size=8, num_kv_blocks=14, max_num_batched_tokens=32),
    ],
    ids=["mixed-batches", "chunked16-block32", "preemption"],
)
def test_greedy_matches_hf_eager(model_and_references, kwargs):
    path, prompts, refs = model_and_references
    llm = make_llm(path, **kwargs)
    assert llm.engine.engine_core.executor.driver_runner.attn_backend.describe(16).startswith("Triton")
    check(llm, prompts, refs)
    stats = llm.stats()
    assert stats["prefix_cache"]["num_hit_tokens"] > 0
    if "num_kv_blocks" in kwargs:
        assert stats["num_preemptions"] > 0, "the tiny pool was meant to force preemption"


def test_greedy_matches_hf_through_decode_graph_buffers(model_and_references):
    """Decode-only steps go through the graph path: 4 requests padded to the ladder's next size (max_num_seqs 6:
    sizes 1, 2, 4, 6), then fewer as requests finish."""
    path, prompts, refs = model_and_references
    llm = make_llm(path, max_num_seqs=6)
    runner = llm.engine.engine_core.executor.driver_runner
    if DEVICE == "cpu":
        assert runner.graphs is None  # graphs are captured on a GPU only
        runner.graphs = runner.build_decode_graphs(capture=False)
    else:
        assert runner.graphs is not None and runner.graphs.graphs
    assert runner.graphs.sizes == [1, 2, 4, 6]
    replays = []
    run = runner.graphs.run

    def counting_run(input_ids, positions, inputs, size, fill=None):
        replays.append((len(input_ids), size))
        return run(input_ids, positions, inputs, size, fill)

    runner.graphs.run = counting_run
    check(llm, prompts[:3], refs[:3], rounds=1)
    sizes = {size for _, size in replays}
    assert replays and all(n <= size for n, size in replays) and 4 in sizes
    # Uneven output lengths: the batch shrinks, and padded sizes above the batch get used.
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (NUM_TOKENS, 3, 7)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts[:3]], params, use_tqdm=False)
    for o, r, n in zip(outs, refs[:3], (NUM_TOKENS, 3, 7), strict=True):
        assert o.outputs[0].token_ids == r[:n]
    assert any(n < size for n, size in replays)
    assert_all_blocks_free(llm)


def test_async_scheduling_through_decode_graph_buffers(model_and_references):
    """Async scheduling feeds each decode step's input token from the device (the previous step's sample)
    into the graph's persistent buffers: greedy tokens still equal HF's."""
    path, prompts, refs = model_and_references
    llm = make_llm(path, max_num_seqs=6, async_scheduling=True)
    runner = llm.engine.engine_core.executor.driver_runner
    if DEVICE == "cpu":
        runner.graphs = runner.build_decode_graphs(capture=False)
    fills = []
    run = runner.graphs.run

    def counting_run(input_ids, positions, inputs, size, fill=None):
        fills.append(0 if fill is None else len(fill[0]))
        return run(input_ids, positions, inputs, size, fill)

    runner.graphs.run = counting_run
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (NUM_TOKENS, 3, 7, 5)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for o, r, n in zip(outs, refs, (NUM_TOKENS, 3, 7, 5), strict=True):
        assert o.outputs[0].token_ids == r[:n]
    assert fills and max(fills) == 4  # every decode row's token came from the device
    assert_all_blocks_free(llm)


SMALL_POOL = dict(enforce_eager=True, block_size=8, num_kv_blocks=14, max_num_batched_tokens=32)


def test_swap_preemption(model_and_references):
    """Preempted requests' blocks go to the (pinned, on a GPU) swap space and come back, asynchronously on a GPU."""
    path, prompts, refs = model_and_references
    llm = make_llm(path, preemption_mode="swap", swap_space=1 << 20, **SMALL_POOL)
    check(llm, prompts, refs)
    stats = llm.stats()
    assert stats["num_swapped_out"] > 0 and stats["num_swapped_in"] == stats["num_swapped_out"]
    swap = llm.engine.engine_core.scheduler.swap
    assert swap is not None and swap.num_free_blocks == swap.num_blocks


def test_offload_tiers(model_and_references, tmp_path):
    """Blocks evicted from the pool come back from the RAM tier; after a restart, from the disk tier (read on the
    connector's I/O thread and copied to the pool's device there)."""
    path, prompts, refs = model_and_references
    config = {"kv_connector": "offload", "cpu_bytes": 1 << 20, "disk_path": str(tmp_path)}
    first = make_llm(path, kv_transfer_config=config, **SMALL_POOL)
    check(first, prompts, refs)
    assert first.stats()["kv_transfer"]["ram_hit_blocks"] > 0
    first.engine.engine_core.shutdown()  # lets the disk writes finish
    second = make_llm(path, kv_transfer_config=config, **SMALL_POOL)
    check(second, prompts, refs, rounds=1)
    assert second.stats()["kv_transfer"]["disk_loaded_bytes"] > 0


def test_dummy_weights_and_the_profiling_step(tiny_model_factory, tmp_path):
    """load_format dummy needs only config.json (and a tokenizer); the profiling step (the largest batch, every
    slot -1) runs without touching the KV cache."""
    import shutil

    src = tiny_model_factory(MODEL)
    for name in os.listdir(src):
        if not name.endswith(".safetensors"):
            shutil.copy(os.path.join(src, name), tmp_path / name)
    llm = make_llm(str(tmp_path), load_format="dummy", enforce_eager=True, max_num_seqs=4)
    runner = llm.engine.engine_core.executor.driver_runner
    before = [(k.clone(), v.clone()) for k, v in runner.kv_caches]
    runner.dummy_run(num_tokens=40, num_reqs=6)
    for (k, v), (k0, v0) in zip(runner.kv_caches, before, strict=True):
        assert torch.equal(k, k0) and torch.equal(v, v0)
    out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], GREEDY, use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == NUM_TOKENS
    assert_all_blocks_free(llm)


@pytest.mark.skipif(DEVICE != "cuda", reason="memory profiling measures a GPU")
def test_gpu_memory_profiling_sizes_the_pool(model_and_references):
    import gc

    gc.collect()
    torch.cuda.empty_cache()
    path, prompts, refs = model_and_references
    total = torch.cuda.mem_get_info()[1]
    llm = LLM(path, dtype="float32", max_model_len=256, device="cuda", gpu_memory_utilization=0.5)
    runner = llm.engine.engine_core.executor.driver_runner
    kv_bytes = sum(k.numel() * k.element_size() * 2 for k, _ in runner.kv_caches)
    # The tiny model's weights and activations are small: the pool is most of half the GPU, and no more.
    assert 0.35 * total < kv_bytes < 0.5 * total
    check(llm, prompts[:2], refs[:2], rounds=1)
    llm.shutdown()


@pytest.mark.skipif(DEVICE != "cuda", reason="the rotary + KV write launch is GPU-only (half types)")
def test_rotary_write_launch_changes_no_token(tiny_model_factory, monkeypatch):
    """bf16 on the GPU: rotary and the KV write in one launch give the tokens of the two launches, batched and
    at batch 1 (a decode graph)."""
    path = tiny_model_factory(MODEL)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    prompts = [{"prompt_token_ids": [5 + i for i in range(n)]} for n in (3, 40)]
    outs = {}
    for fuse in ("1", "0"):
        monkeypatch.setenv("KVSERVE_FUSE_ROTARY_WRITE", fuse)
        llm = LLM(path, dtype="bfloat16", max_model_len=256, device=DEVICE, kv_cache_memory=1 << 30)
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        got.append(llm.generate(prompts[:1], params, use_tqdm=False)[0].outputs[0].token_ids)
        outs[fuse] = got
        llm.shutdown()
    assert outs["1"] == outs["0"]

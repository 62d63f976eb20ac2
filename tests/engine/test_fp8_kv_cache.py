"""The engine with an fp8 KV cache (kv_cache_dtype): the pool holds one-byte elements, so the same kv_cache_memory
holds twice the blocks of a bf16 cache; greedy decoding runs through batching, prefix hits and chunked prefill on
the C++ kernels and gives the torch reference's tokens; the layout id names the format; options that do not
combine are refused before anything loads."""

from __future__ import annotations

import random

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.engine.arg_utils import EngineArgs
from tests.conftest import assert_all_blocks_free
from tests.kernels.build import require_kernels

MODEL = "llama-hd64-long"  # head_dim 64: the kernels' fast path
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


def runner_of(llm: LLM):
    return llm.engine.engine_core.executor.driver_runner


def prompts() -> list[list[int]]:
    rng = random.Random(3)
    shared = [rng.randrange(3, 49000) for _ in range(40)]
    return [shared + [rng.randrange(3, 49000) for _ in range(n)] for n in (5, 30, 90)] + [shared[:20]]


@pytest.mark.parametrize("kv_cache_dtype,torch_dtype", [("fp8", torch.float8_e4m3fn), ("fp8_e5m2", torch.float8_e5m2)])
def test_fp8_cache_doubles_the_blocks_and_names_its_format(tiny_model_factory, kv_cache_dtype, torch_dtype):
    path = tiny_model_factory(MODEL)
    budget = 8 << 20
    bf16 = LLM(path, dtype="bfloat16", max_model_len=512, kv_cache_memory=budget)
    fp8 = LLM(path, dtype="bfloat16", max_model_len=512, kv_cache_memory=budget, kv_cache_dtype=kv_cache_dtype)
    assert fp8.stats()["num_blocks"] == 2 * bf16.stats()["num_blocks"]
    caches = runner_of(fp8).kv_caches
    assert all(k.dtype == torch_dtype and v.dtype == torch_dtype for k, v in caches)
    spec = runner_of(fp8).kv_cache_spec()
    name = "fp8_e4m3" if kv_cache_dtype == "fp8" else kv_cache_dtype
    assert f"|kv_dtype={name}|" in spec.layout_id
    assert spec.layers[0].kv_dtype == str(torch_dtype).removeprefix("torch.")
    assert spec.layout_id != runner_of(bf16).kv_cache_spec().layout_id
    assert "|kv_dtype=auto|" in runner_of(bf16).kv_cache_spec().layout_id


@pytest.mark.parametrize("model", [MODEL, "bloom-alibi"])  # ALiBi: the slopes on the generic path's fp8 reads
@pytest.mark.parametrize("kv_cache_dtype", ["fp8_e4m3", "fp8_e5m2"])
def test_fp8_greedy_kernels_equal_torch_reference(tiny_model_factory, kv_cache_dtype, model):
    """fp32 model, fp8 cache: the C++ kernels' greedy tokens equal the torch reference's over batched prompts with
    a shared prefix (prefix-cache hits) and chunked prefill (a 16-token budget), twice (the second round from the
    prefix cache); every block is free at the end."""
    require_kernels()
    path = tiny_model_factory(model)
    ps = [{"prompt_token_ids": p} for p in prompts()]
    outs = {}
    for backend in ("cpu", "torch"):
        llm = LLM(
            path,
            dtype="float32",
            max_model_len=512,
            kv_cache_memory=16 << 20,
            kv_cache_dtype=kv_cache_dtype,
            attention_backend=backend,
            max_num_batched_tokens=64,
        )
        rounds = [[o.outputs[0].token_ids for o in llm.generate(ps, GREEDY, use_tqdm=False)] for _ in range(2)]
        assert rounds[0] == rounds[1]
        assert all(len(t) == GREEDY.max_tokens for t in rounds[0])
        assert_all_blocks_free(llm)
        outs[backend] = rounds[0]
    assert outs["cpu"] == outs["torch"]


def test_unsupported_kv_cache_dtypes_are_refused_before_loading(tiny_model_factory):
    path = tiny_model_factory(MODEL)
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, fp8, fp8_e4m3, fp8_e5m2"):
        EngineArgs(model=path, kv_cache_dtype="int8").create_engine_config()
    spec = {"method": "draft_model", "model": path, "num_speculative_tokens": 2}
    with pytest.raises(ValueError, match="kv_cache_dtype fp8 with draft-model or EAGLE speculation"):
        EngineArgs(model=path, kv_cache_dtype="fp8", speculative_config=spec).create_engine_config()
    ngram = {"method": "ngram", "num_speculative_tokens": 2}
    config = EngineArgs(model=path, kv_cache_dtype="fp8", speculative_config=ngram).create_engine_config()
    assert config.cache.cache_dtype == "fp8_e4m3"


@pytest.mark.parametrize("kv_cache_dtype", ["fp8_e4m3", "fp8_e5m2"])
def test_bf16_model_fp8_cache_is_pair_packed_and_batch_invariant(tiny_model_factory, kv_cache_dtype):
    """bf16 model, fp8 cache, where the CPU has AVX512-BF16 and AVX512-VBMI: the pool holds the fp8 pair-packed
    layout (named in the layout id), and each prompt's greedy tokens are the same alone and unchunked as batched,
    chunked (a 16-token budget) and from the prefix cache; every block is free at the end."""
    require_kernels()
    path = tiny_model_factory(MODEL)

    def make(budget: int) -> LLM:
        return LLM(
            path,
            dtype="bfloat16",
            max_model_len=512,
            kv_cache_memory=16 << 20,
            kv_cache_dtype=kv_cache_dtype,
            attention_backend="cpu",
            max_num_batched_tokens=budget,
        )

    llm = make(16)
    if "fp8-pair-packed" not in runner_of(llm).kv_cache_spec().layout_id:
        pytest.skip("no AVX512-BF16 + AVX512-VBMI here: the fp8 cache keeps the standard layout")
    ps = [{"prompt_token_ids": p} for p in prompts()]
    rounds = [[o.outputs[0].token_ids for o in llm.generate(ps, GREEDY, use_tqdm=False)] for _ in range(2)]
    assert rounds[0] == rounds[1]
    assert_all_blocks_free(llm)
    alone = make(512)
    for p, want in zip(ps, rounds[0], strict=True):
        got = alone.generate([p], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
        assert got == want
        alone.reset_prefix_cache()
    assert_all_blocks_free(alone)

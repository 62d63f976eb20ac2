"""ALiBi: the slopes equal HF's; greedy tokens equal HF transformers (fp32) on tiny BLOOM models beyond what
tests/models/test_hf_parity.py runs on them (batching, prefix hits, chunked prefill, preemption, block sizes): the
torch reference backend, the Triton kernels in the interpreter, tensor parallelism (each rank its heads' slopes),
speculative decoding, checkpoints of the bare BloomModel; HF without ALiBi gives other tokens (so the biases
matter); combinations not covered are refused before loading."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.engine.arg_utils import EngineArgs
from kvserve.engine.combinations import refusals
from kvserve.layers.alibi import alibi_slopes
from tests.conftest import assert_all_blocks_free, hf_greedy, load_hf_model, triton_once
from tests.engine.test_spec_decode import copy_prompts
from tests.executor.test_tp_parity import check_parity
from tests.models.test_hf_parity import NUM_TOKENS, make_prompts, run_condition

MODELS = ["bloom-alibi", "bloom-tied-post-ln"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)


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


def test_slopes_equal_hf_bit_for_bit():
    """Powers of two and the rule for the other head counts (BLOOM-560m has 16 heads, BLOOM-176B 112)."""
    from transformers.models.bloom.modeling_bloom import _get_alibi_slopes

    for n in [*range(1, 41), 64, 96, 112]:
        assert torch.equal(alibi_slopes(n), _get_alibi_slopes(n, torch.device("cpu"))), n
    # 6 heads: 2^-2, 2^-4, 2^-6, 2^-8 (the 4-head sequence), then 2^-1, 2^-3 (odd terms of the 8-head one).
    assert alibi_slopes(6).tolist() == [2**-2, 2**-4, 2**-6, 2**-8, 2**-1, 2**-3]


def assert_rounds_match(llm: LLM, prompts, want, what: str) -> None:
    for round_idx, got in enumerate(run_condition(llm, prompts)):
        for i, (g, r) in enumerate(zip(got, want, strict=True)):
            assert g == r, f"{what} / round {round_idx} / prompt {i}: {g} != {r}"
    assert llm.stats()["prefix_cache"]["num_hit_tokens"] > 0
    assert_all_blocks_free(llm)


@pytest.mark.parametrize("name", MODELS)
def test_torch_reference_backend_matches_hf(references, name):
    path, prompts, want = references(name)
    llm = LLM(path, dtype="float32", max_model_len=512, attention_backend="torch", block_size=8)
    assert_rounds_match(llm, prompts, want, f"{name} / torch")


@pytest.mark.parametrize("name", MODELS)
def test_big_chunks_through_sdpa_match_hf(references, name, monkeypatch):
    """deterministic=False sends big prefill chunks to SDPA with the ALiBi bias in its mask (fp32, the standard
    layout); a low threshold makes every prompt but the shortest one such a chunk."""
    from kvserve.attention import cpu_kernels

    monkeypatch.setattr(cpu_kernels, "_KERNEL_MAX_WORK", 64)
    spans = []
    sdpa_prefill_spans = cpu_kernels.sdpa_prefill_spans

    def counted(*args, **kwargs):
        spans.extend(args[4])
        return sdpa_prefill_spans(*args, **kwargs)

    monkeypatch.setattr(cpu_kernels, "sdpa_prefill_spans", counted)
    path, prompts, want = references(name)
    llm = LLM(path, dtype="float32", max_model_len=512, deterministic=False, max_num_batched_tokens=32)
    assert_rounds_match(llm, prompts, want, f"{name} / sdpa")
    assert any(span.mask is not None for span in spans)  # chunks after cached context too


@triton_once
def test_triton_kernels_in_the_interpreter_match_hf(references):
    """The Triton backend's kernels (in Triton's interpreter on the CPU) through the engine: prefill chunks after
    cached prefixes and decodes with ALiBi."""
    path, prompts, want = references("bloom-alibi")
    llm = LLM(path, dtype="float32", max_model_len=256, attention_backend="triton", block_size=8)
    picked = [0, 1, 2]  # the third shares a 40-token prefix with the first: hits
    outs = llm.generate(
        [{"prompt_token_ids": prompts[i]} for i in picked],
        SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
        use_tqdm=False,
    )
    for i, out in zip(picked, outs, strict=True):
        assert out.outputs[0].token_ids == want[i][:16], f"prompt {i}"
    assert llm.stats()["prefix_cache"]["num_hit_tokens"] > 0
    assert_all_blocks_free(llm)


def test_hf_without_alibi_gives_other_tokens(references, monkeypatch):
    """Without this, parity could hold because the biases never mattered: HF's model with every slope 0."""
    from transformers.models.bloom import modeling_bloom

    path, prompts, want = references("bloom-alibi")
    monkeypatch.setattr(modeling_bloom, "_get_alibi_slopes", lambda n, device: torch.zeros(n, device=device))
    flat = load_hf_model(path)
    assert sum(hf_greedy(flat, p, NUM_TOKENS) != w for p, w in zip(prompts, want, strict=True)) >= 3


def test_tensor_parallel_ranks_take_their_heads_slopes(tiny_model_factory):
    """TP=2: each rank holds 3 of the 6 heads and must bias them with their own slopes (rank 1 gets the slopes of
    heads 3-5); greedy tokens equal TP=1's through chunked prefill, prefix hits and preemption."""
    check_parity(tiny_model_factory("bloom-alibi"), distributed_executor_backend="mp")


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_speculative_decoding_matches_no_speculation(tiny_model_factory, method):
    """Verification runs several query tokens of a request per step (each with its own ALiBi query position)."""
    path = tiny_model_factory("bloom-alibi")
    if method == "ngram":
        config = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    else:  # the model drafting for itself: every draft accepted, many tokens verified per step
        config = {"method": "draft_model", "model": path, "num_speculative_tokens": 3}
    prompts = copy_prompts(4, seed=5)
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    plain = LLM(path, dtype="float32", max_model_len=256)
    spec = LLM(path, dtype="float32", max_model_len=256, speculative_config={**config, "adaptive": False})
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    got = [o.outputs[0].token_ids for o in spec.generate(prompts, params, use_tqdm=False)]
    assert got == want
    assert spec.stats()["spec_decoding"]["num_draft_tokens"] > 0
    assert_all_blocks_free(spec)


def test_bare_bloom_model_checkpoint_loads(references, tmp_path):
    """Hub BLOOMs (bigscience/bloom-560m) store the bare BloomModel: names without `transformer.`."""
    from safetensors.torch import load_file, save_file

    path, prompts, want = references("bloom-alibi")
    tensors = load_file(os.path.join(path, "model.safetensors"))
    bare = {k.removeprefix("transformer."): v for k, v in tensors.items()}
    assert any(not k.startswith("transformer.") for k in bare) and "lm_head.weight" in bare
    for name in os.listdir(path):
        if name != "model.safetensors":
            (tmp_path / name).write_bytes(open(os.path.join(path, name), "rb").read())
    save_file(bare, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    llm = LLM(str(tmp_path), dtype="float32", max_model_len=256)
    outs = llm.generate([{"prompt_token_ids": prompts[1]}], GREEDY, use_tqdm=False)
    assert outs[0].outputs[0].token_ids == want[1]


def test_gpu_and_eagle_refused_before_loading(tiny_model_factory):
    config = EngineArgs(model=tiny_model_factory("bloom-alibi"), dtype="float32").create_engine_config()
    assert config.model.arch.alibi
    on_gpu = dataclasses.replace(config, model=dataclasses.replace(config.model, device="cuda"))
    assert any(r.startswith("an ALiBi model on the GPU") for r in refusals(on_gpu))
    assert not any("ALiBi" in r for r in refusals(config))
    with pytest.raises(ValueError, match="an ALiBi model with EAGLE speculation"):
        EngineArgs(
            model=tiny_model_factory("bloom-alibi"),
            dtype="float32",
            speculative_config={
                "method": "eagle",
                "model": tiny_model_factory("bloom-alibi"),
                "num_speculative_tokens": 2,
            },
        ).create_engine_config()

"""Key centering for fp8 caches (attention/key_centering.py): the offsets are each layer's mean key after RoPE over
the fixed calibration forward; subtracting them leaves attention unchanged (softmax ignores a per-query constant)
on every backend and through the fused C++ layer, while the cache holds the centred keys; the layout id names the
recipe, and KVSERVE_FP8_KEY_CENTERING=0 turns it off."""

from __future__ import annotations

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.attention.key_centering import attention_modules, calibrate_key_offsets, calibration_ids, set_key_offsets
from kvserve.models.llama import LlamaDecoderLayer
from tests.conftest import assert_all_blocks_free
from tests.kernels.build import require_kernels

PROMPTS = [[5 + i for i in range(40)], [9] * 7, [(i * 37) % 500 + 3 for i in range(90)]]


def runner_of(llm: LLM):
    return llm.engine.engine_core.executor.driver_runner


def make(path: str, **kw) -> LLM:
    return LLM(path, max_model_len=256, kv_cache_memory=8 << 20, enable_prefix_caching=False, **kw)


def greedy_with_logprobs(llm: LLM) -> list[tuple[list[int], list[float]]]:
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=1)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [
        (c.token_ids, [d[t].logprob for t, d in zip(c.token_ids, c.logprobs, strict=True)])
        for c in (o.outputs[0] for o in outs)
    ]


@pytest.mark.parametrize("name", ["llama-hd64-long", "bloom-alibi"])
def test_offsets_are_the_mean_key_of_the_calibration_forward(tiny_model_factory, name, monkeypatch):
    """The runner's offsets equal the mean of the keys the real backend receives when the same seeded ids run as
    one prefill through the paged cache of an engine without fp8 (so no rounding of the cache feeds later layers):
    an independent capture, the real backend rather than the calibration's."""
    require_kernels()
    path = tiny_model_factory(name)
    runner = runner_of(make(path, dtype="float32", kv_cache_dtype="fp8_e4m3"))
    modules = attention_modules(runner.model)
    assert len(modules) == runner.model_config.arch.num_hidden_layers
    offsets = [m.k_offset for m in modules]
    for o, m in zip(offsets, modules, strict=True):
        assert o is not None and o.dtype == torch.float32 and o.shape == (m.kv_size,)
    assert max(float(o.abs().max()) for o in offsets) > 0

    plain = make(path, dtype="float32")
    captured: list[torch.Tensor] = []
    backend_type = type(runner_of(plain).attn_backend)
    real_forward = backend_type.forward

    def spy(self, q, k, v, *args, **kwargs):
        captured.append(k.float().mean(0).flatten())
        return real_forward(self, q, k, v, *args, **kwargs)

    monkeypatch.setattr(backend_type, "forward", spy)
    monkeypatch.setattr(LlamaDecoderLayer, "use_fused", False)
    from kvserve.benchmarks.perplexity import window_nll

    ids = calibration_ids(runner.vocab_size, runner.model_config.max_model_len)
    assert len(ids) == 256  # min(CALIBRATION_TOKENS, max_model_len)
    window_nll(plain, ids.tolist())
    assert len(captured) == len(offsets)
    for got, want in zip(offsets, captured, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("backend", ["cpu", "torch"])
@pytest.mark.parametrize("name", ["llama-hd64-long", "bloom-alibi"])
def test_centering_leaves_attention_unchanged_and_the_cache_holds_centred_keys(tiny_model_factory, name, backend):
    """fp32 model and cache (no rounding to hide behind): large random offsets give the same greedy tokens and
    logprobs to fp32 rounding as none, over prefill, decode (the fused layer where it runs) and batching; the
    cache's keys are the plain run's minus the offsets, its values untouched; every block is free afterwards."""
    if backend == "cpu":
        require_kernels()
    path = tiny_model_factory(name)
    plain = make(path, dtype="float32", attention_backend=backend)
    reference = greedy_with_logprobs(plain)
    centred = make(path, dtype="float32", attention_backend=backend)
    runner = runner_of(centred)
    gen = torch.Generator().manual_seed(1)
    offsets = [20 * torch.randn(m.kv_size, generator=gen) for m in attention_modules(runner.model)]
    set_key_offsets(runner.model, offsets)
    got = greedy_with_logprobs(centred)
    for (tokens, lps), (ref_tokens, ref_lps) in zip(got, reference, strict=True):
        assert tokens == ref_tokens
        torch.testing.assert_close(torch.tensor(lps), torch.tensor(ref_lps), rtol=0, atol=2e-3)
    for (k0, v0), (k1, v1), offset in zip(runner_of(plain).kv_caches, runner.kv_caches, offsets, strict=True):
        torch.testing.assert_close(v1, v0, rtol=1e-4, atol=1e-3)  # equal but for fp32 rounding in earlier layers
        written = v0.flatten(2).abs().sum(-1) > 0  # [blocks, block_size]: the slots a run wrote
        assert int(written.sum()) >= sum(len(p) for p in PROMPTS)
        want = k0[written].flatten(1) - offset
        torch.testing.assert_close(k1[written].flatten(1), want, rtol=1e-5, atol=1e-4)
    assert_all_blocks_free(centred)


def test_fp8_cache_centres_keys_and_names_it_in_the_layout(tiny_model_factory, monkeypatch):
    path = tiny_model_factory("llama-hd64-long")
    fp8 = runner_of(make(path, dtype="float32", kv_cache_dtype="fp8_e4m3"))
    assert all(m.k_offset is not None for m in attention_modules(fp8.model))
    assert "|k_centered=rand256s0|" in fp8.kv_cache_spec().layout_id
    auto = runner_of(make(path, dtype="float32"))
    assert all(m.k_offset is None for m in attention_modules(auto.model))
    assert "k_centered" not in auto.kv_cache_spec().layout_id
    monkeypatch.setenv("KVSERVE_FP8_KEY_CENTERING", "0")
    off = runner_of(make(path, dtype="float32", kv_cache_dtype="fp8_e4m3"))
    assert all(m.k_offset is None for m in attention_modules(off.model))
    assert "k_centered" not in off.kv_cache_spec().layout_id


def test_calibration_refuses_installed_offsets(tiny_model_factory):
    runner = runner_of(make(tiny_model_factory("llama-hd64-long"), dtype="float32", kv_cache_dtype="fp8_e5m2"))
    with pytest.raises(AssertionError, match="calibrate before setting offsets"):
        calibrate_key_offsets(runner.model, calibration_ids(runner.vocab_size, 16), runner.dtype)
    with pytest.raises(ValueError, match="key offsets for"):
        set_key_offsets(runner.model, [torch.zeros(1)])

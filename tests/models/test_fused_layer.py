"""The fused C++ decoder layer (kernels/csrc/decoder_layer.cpp), with float, bf16 pair or int8 linears, gives
bitwise the module path's results: the same sampled tokens and the same logprobs, to the last bit, over decodes,
batches, prefill chunks and (with deterministic=False) steps with SDPA prompt spans, where it steps aside."""

from __future__ import annotations

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.attention import cpu_kernels
from kvserve.kernels.cpu import load_cpu_kernels
from kvserve.layers.quant.int8_linear import Int8Linear
from kvserve.models.llama import LlamaDecoderLayer
from kvserve.platform import cpu_info

pytestmark = pytest.mark.skipif(load_cpu_kernels() is None, reason="the C++ CPU kernels did not build here")


def _run(llm: LLM, prompts: list[list[int]]) -> list[tuple[list[int], list]]:
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=3)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [
        (o.outputs[0].token_ids, [sorted((t, lp.logprob) for t, lp in d.items()) for d in o.outputs[0].logprobs])
        for o in outs
    ]


def _bf16_pairs_here() -> bool:
    kernels = load_cpu_kernels()
    return cpu_info().native_bf16 and kernels is not None and kernels.linear_bf16_pairs_supported()


@pytest.mark.parametrize(
    "dtype,quantization",
    [
        ("float32", None),
        ("float32", "int8"),
        pytest.param(
            "bfloat16",
            None,
            marks=pytest.mark.skipif(not _bf16_pairs_here(), reason="bf16 pair panels need AVX512-BF16"),
        ),
    ],
)
@pytest.mark.parametrize("name", ["llama-gqa-untied", "qwen2-bias-tied"])
@pytest.mark.parametrize("deterministic", [True, False])
def test_fused_layer_is_bitwise_the_module_path(
    tiny_model_factory, name, dtype, quantization, deterministic, monkeypatch
):
    # Prefill chunks with and without cached context beside decodes. With deterministic=False (and the standard
    # layout), chunks of over 64 x 64 query-key pairs, such as the 300-token prompt's first, are SDPA spans: those
    # steps take the module path for every row.
    monkeypatch.setattr(cpu_kernels, "_KERNEL_MAX_WORK", 64 * 64)
    llm = LLM(
        tiny_model_factory(name),
        dtype=dtype,
        max_model_len=512,
        max_num_batched_tokens=300,
        quantization=quantization,
        deterministic=deterministic,
    )
    model = llm.engine.engine_core.executor.driver_runner.model
    layers = model.model.layers
    assert all(layer._fused is not None for layer in layers), "the fused layer should run this model"
    assert model._stack is not None and model._stack.num_layers == len(layers)  # one C++ call a step
    if quantization:
        assert isinstance(layers[0].mlp.down_proj, Int8Linear)
    if dtype == "bfloat16":
        assert layers[0].mlp.down_proj._panel_kind == "bf16_pairs"
    prompts = [[5 + i for i in range(40)], [9] * 7, [(i * 37) % 500 + 3 for i in range(300)], [11, 12, 13]]
    fused = _run(llm, prompts)
    monkeypatch.setattr(LlamaDecoderLayer, "use_fused", False)
    llm.reset_prefix_cache()
    assert _run(llm, prompts) == fused


@pytest.mark.parametrize(
    "dtype",
    [
        "float32",
        pytest.param(
            "bfloat16", marks=pytest.mark.skipif(not _bf16_pairs_here(), reason="bf16 pair panels need AVX512-BF16")
        ),
    ],
)
def test_fused_layer_subtracts_the_fp8_key_offsets_as_the_module_path_does(tiny_model_factory, dtype, monkeypatch):
    """An fp8 cache centres the keys (attention/key_centering.py): the fused layer subtracts the same offsets at
    the same point, so its results stay bitwise the module path's."""
    llm = LLM(tiny_model_factory("llama-gqa-untied"), dtype=dtype, max_model_len=512, kv_cache_dtype="fp8_e4m3")
    layers = llm.engine.engine_core.executor.driver_runner.model.model.layers
    assert all(layer._fused is not None and layer.self_attn.k_offset is not None for layer in layers)
    prompts = [[5 + i for i in range(40)], [9] * 7, [11, 12, 13]]
    fused = _run(llm, prompts)
    monkeypatch.setattr(LlamaDecoderLayer, "use_fused", False)
    llm.reset_prefix_cache()
    assert _run(llm, prompts) == fused


@pytest.mark.parametrize(
    "dtype",
    [
        "float32",
        pytest.param(
            "bfloat16", marks=pytest.mark.skipif(not cpu_info().native_bf16, reason="bf16 compute needs native bf16")
        ),
    ],
)
# llama-hd64-long: head_dim 64, so that bf16 takes the pair-packed cache (and, on AMX, the tile attention).
@pytest.mark.parametrize("name", ["llama-gqa-untied", "qwen2-bias-tied", "llama-hd64-long"])
def test_one_row_int4_layer_is_bitwise_the_module_path(tiny_model_factory, name, dtype, monkeypatch):
    """Batch-1 decode steps with int4 linears run the whole layer in one parallel region (decoder_layer_row.cpp):
    the same tokens and logprobs, to the last bit, as the kernel-by-kernel fused layer and as the module path, on
    1 and 2 threads (a request alone, so every decode step is a single row)."""
    kernels = load_cpu_kernels()
    llm = LLM(tiny_model_factory(name), dtype=dtype, max_model_len=256, quantization="int4")
    layers = llm.engine.engine_core.executor.driver_runner.model.model.layers
    assert all(layer._fused is not None for layer in layers)
    prompts = [[5 + i for i in range(40)], [9] * 7, [11, 12, 13]]

    def alone() -> list:
        llm.reset_prefix_cache()
        return [_run(llm, [p])[0] for p in prompts]

    one_region = alone()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        one_thread = alone()
    finally:
        torch.set_num_threads(threads)
    assert kernels.decoder_layer_row_set_enabled(False)
    try:
        by_kernel = alone()
    finally:
        kernels.decoder_layer_row_set_enabled(True)
    monkeypatch.setattr(LlamaDecoderLayer, "use_fused", False)
    assert alone() == by_kernel == one_region == one_thread

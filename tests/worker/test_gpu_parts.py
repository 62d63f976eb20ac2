"""The GPU path's pure logic, checked on the CPU: the CUDA-graph batch-size ladder, KV sizing from a memory
profile (fake numbers), the profiling step's inputs, device and dtype resolution, and the options the GPU path
refuses. (What needs a GPU runs in benchmarks/gpu_suite.py.)"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvserve.engine import arg_utils
from kvserve.engine.arg_utils import EngineArgs, resolve_dtype
from kvserve.platform import resolve_device
from kvserve.worker.cuda_graph import capture_sizes, padded_size
from kvserve.worker.gpu_memory import (
    MemoryProfile,
    MemorySnapshot,
    dummy_attention_inputs,
    num_blocks_from_profile,
    profile_from_snapshots,
)

GIB = 2**30


def test_capture_ladder():
    assert capture_sizes(256) == [1, 2, 4, 8, *range(16, 257, 16)]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]  # max_num_seqs itself is always captured
    assert capture_sizes(8) == [1, 2, 4, 8]
    assert capture_sizes(3) == [1, 2, 3]
    assert capture_sizes(1) == [1]
    assert capture_sizes(1024)[-1] == 512  # larger batches run eagerly


def test_padded_size_is_the_next_rung():
    sizes = capture_sizes(40)  # [1, 2, 4, 8, 16, 32, 40]
    assert [padded_size(n, sizes) for n in (1, 2, 3, 5, 8, 9, 17, 32, 33, 40)] == [1, 2, 4, 8, 8, 16, 32, 32, 40, 40]
    assert padded_size(41, sizes) is None


def test_kv_budget_arithmetic():
    baseline = MemorySnapshot(total=80 * GIB, free=79 * GIB, torch_allocated=0, torch_reserved=0)  # context: 1 GiB
    before = MemorySnapshot(total=80 * GIB, free=63 * GIB, torch_allocated=16 * GIB, torch_reserved=16 * GIB)
    after = MemorySnapshot(total=80 * GIB, free=58 * GIB, torch_allocated=16 * GIB, torch_reserved=20 * GIB)
    profile = profile_from_snapshots(baseline, before, after, peak_allocated=19 * GIB)
    # Weights 16 GiB, activations peaked 3 GiB above them; outside torch the process grew 2 - 1 = 1 GiB.
    assert profile == MemoryProfile(total=80 * GIB, weights=16 * GIB, peak_activations=3 * GIB, non_torch_increase=GIB)
    assert profile.kv_budget(0.9) == int(72 * GIB) - 20 * GIB
    assert num_blocks_from_profile(profile, 0.9, bytes_per_block=2 * 2**20) == (52 * GIB) // (2 * 2**20)
    assert "KV cache 52.00 GiB" in profile.describe(0.9)


def test_no_room_for_the_kv_cache_is_a_clear_error():
    profile = MemoryProfile(total=24 * GIB, weights=16 * GIB, peak_activations=6 * GIB, non_torch_increase=0)
    with pytest.raises(ValueError, match="no GPU memory left for the KV cache.*raise gpu_memory_utilization"):
        num_blocks_from_profile(profile, 0.9, bytes_per_block=2**20)


def test_profiling_step_covers_the_token_budget_without_writes():
    inputs = dummy_attention_inputs(num_tokens=2050, num_reqs=256, block_size=16)
    q_lens = np.diff(inputs.query_start_loc)
    assert len(q_lens) == 256 and q_lens.sum() == 2050 and set(q_lens) == {8, 9}
    assert np.array_equal(inputs.seq_lens, q_lens)  # fresh prompts: no cached context
    assert (inputs.slot_mapping == -1).all() and (inputs.block_table == 0).all()
    assert inputs.block_table.shape == (256, 1)
    few = dummy_attention_inputs(num_tokens=3, num_reqs=256, block_size=16)
    assert np.array_equal(np.diff(few.query_start_loc), [1, 1, 1]) and few.num_decodes == 3


def test_device_and_dtype_resolution(monkeypatch):
    assert resolve_device("cpu") == "cpu"
    assert resolve_device("auto") == ("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(ValueError, match="unsupported device"):
        resolve_device("tpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="sees no CUDA GPU"):
            resolve_device("cuda")
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)
    assert resolve_dtype("auto", "cuda") == "bfloat16"
    assert resolve_dtype("half", "cuda") == "float16"
    assert resolve_dtype("float32", "cuda:0") == "float32"
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: False)
    assert resolve_dtype("auto", "cuda") == "float16"  # e.g. a V100 or T4
    with pytest.raises(ValueError, match="unsupported dtype"):
        resolve_dtype("int4", "cuda")


@pytest.mark.parametrize(
    "options,message",
    [
        (dict(tensor_parallel_size=2), "tensor_parallel_size > 1"),
        (dict(quantization="int8"), "quantization int8"),
        (dict(attention_backend="cpu"), "attention_backend cpu"),
    ],
)
def test_gpu_refuses_what_it_does_not_cover(tiny_model_factory, monkeypatch, options, message):
    monkeypatch.setattr(arg_utils, "resolve_device", lambda device: "cuda")
    args = EngineArgs(model=tiny_model_factory("llama-gqa-untied"), dtype="bfloat16", **options)
    with pytest.raises(ValueError, match=f"not supported on the GPU yet: .*{message}"):
        args.create_engine_config()


def test_gpu_takes_swap_offload_and_model_speculation(tiny_model_factory, monkeypatch):
    """Swap preemption, the offload connector and draft-model speculation are configured for a GPU as for the CPU
    (tests/models/test_triton_engine.py runs them on the Triton backend)."""
    monkeypatch.setattr(arg_utils, "resolve_device", lambda device: "cuda")
    path = tiny_model_factory("llama-gqa-untied")
    config = EngineArgs(
        model=path,
        dtype="bfloat16",
        preemption_mode="swap",
        kv_transfer_config={"kv_connector": "offload", "cpu_bytes": 1 << 20},
        speculative_config={"method": "draft_model", "model": path, "num_speculative_tokens": 2},
    ).create_engine_config()
    assert config.model.device == "cuda" and config.kv_transfer is not None
    assert config.speculative is not None and config.speculative.draft is not None
    assert config.speculative.draft.device == "cuda"


def test_gpu_defaults_async_scheduling_and_a_small_serving_budget(tiny_model_factory, monkeypatch):
    """On a GPU, async scheduling is on unless asked off or excluded (it is off on the CPU); a server on a GPU
    prefills in chunks of 384 tokens a step, an offline engine in 2048."""
    path = tiny_model_factory("llama-gqa-untied")
    cpu = EngineArgs(model=path, device="cpu").create_engine_config(serving=True)
    assert not cpu.scheduler.async_scheduling and cpu.scheduler.max_num_batched_tokens == 2048
    monkeypatch.setattr(arg_utils, "resolve_device", lambda device: "cuda")
    offline = EngineArgs(model=path, dtype="bfloat16").create_engine_config()
    assert offline.scheduler.async_scheduling and offline.scheduler.max_num_batched_tokens == 2048
    served = EngineArgs(model=path, dtype="bfloat16").create_engine_config(serving=True)
    assert served.scheduler.async_scheduling and served.scheduler.max_num_batched_tokens == 384
    asked_off = EngineArgs(model=path, dtype="bfloat16", async_scheduling=False).create_engine_config()
    assert not asked_off.scheduler.async_scheduling
    speculating = EngineArgs(
        model=path, dtype="bfloat16", speculative_config={"method": "ngram", "num_speculative_tokens": 2}
    ).create_engine_config()
    assert not speculating.scheduler.async_scheduling  # excluded: the default does not turn it on
    with pytest.raises(ValueError, match="async_scheduling with speculative decoding: the next step"):
        EngineArgs(
            model=path,
            dtype="bfloat16",
            async_scheduling=True,
            speculative_config={"method": "ngram", "num_speculative_tokens": 2},
        ).create_engine_config()


@pytest.mark.parametrize(
    "options,message",
    [
        (dict(gpu_memory_utilization=0), "gpu_memory_utilization must be in"),
        (dict(gpu_memory_utilization=1.5), "gpu_memory_utilization must be in"),
        (dict(load_format="pt"), "load_format must be one of"),
        (dict(attention_backend="flash"), "attention_backend must be one of"),
    ],
)
def test_bad_gpu_options_are_clear_errors(tiny_model_factory, options, message):
    with pytest.raises(ValueError, match=message):
        EngineArgs(model=tiny_model_factory("llama-gqa-untied"), **options).create_engine_config()


def test_cpu_config_defaults_are_unchanged(tiny_model_factory):
    config = EngineArgs(model=tiny_model_factory("llama-gqa-untied"), device="cpu").create_engine_config()
    assert config.model.device == "cpu" and config.model.attention_backend == "auto"
    assert config.model.load_format == "auto" and not config.model.enforce_eager

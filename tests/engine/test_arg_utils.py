"""EngineArgs is the one list of engine options: the CLI flags and from_cli_args follow its fields."""

from __future__ import annotations

import argparse
from dataclasses import fields

import pytest

from kvserve.engine.arg_utils import EngineArgs, add_cli_args


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    add_cli_args(p)
    return p


def test_every_field_has_a_flag_and_every_engine_flag_a_field():
    p = parser()
    group = next(g for g in p._action_groups if g.title == "engine")
    assert {a.dest for a in group._group_actions} == {f.name for f in fields(EngineArgs)}
    for a in group._group_actions:
        assert a.option_strings[0] == "--" + a.dest.replace("_", "-")
        assert a.help


def test_from_cli_args_defaults_and_flags():
    assert EngineArgs.from_cli_args(parser().parse_args([])) == EngineArgs()
    ns = parser().parse_args(
        [
            "--model", "m", "--dtype", "float32", "--max-num-seqs", "3", "--kv-cache-memory", "2MiB",
            "--no-enable-prefix-caching", "--kv-prefault", "sync", "--max-model-len", "64",
        ]
    )  # fmt: skip
    assert EngineArgs.from_cli_args(ns) == EngineArgs(
        model="m",
        dtype="float32",
        max_num_seqs=3,
        kv_cache_memory=2 << 20,
        enable_prefix_caching=False,
        kv_prefault="sync",
        max_model_len=64,
    )


def test_deterministic_flag_and_vllm_alias(monkeypatch):
    assert EngineArgs.from_cli_args(parser().parse_args([])).deterministic is None
    assert EngineArgs.from_cli_args(parser().parse_args(["--deterministic"])).deterministic is True
    assert EngineArgs.from_cli_args(parser().parse_args(["--no-deterministic"])).deterministic is False
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")
    assert EngineArgs()._deterministic() is True
    assert EngineArgs(deterministic=False)._deterministic() is False
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "0")
    assert EngineArgs()._deterministic() is None
    with pytest.raises(ValueError, match="deterministic must be"):
        EngineArgs(deterministic="yes")._deterministic()


def test_quantization_resolution(smollm2_gguf, tiny_model_factory):
    from kvserve.engine.arg_utils import resolve_quantization

    assert resolve_quantization("auto", smollm2_gguf) == "int8"  # Q4_1 layers
    assert resolve_quantization("auto", None) is None  # an HF folder keeps its dtype
    assert resolve_quantization("INT8", None) == "int8"
    assert resolve_quantization("none", smollm2_gguf) is None and resolve_quantization(None, smollm2_gguf) is None
    assert resolve_quantization("int4", smollm2_gguf) == "int4" and resolve_quantization("INT4", None) == "int4"
    with pytest.raises(ValueError, match="unsupported quantization"):
        resolve_quantization("int3", None)
    cfg = EngineArgs(model=tiny_model_factory("llama-gqa-untied"), quantization="auto").create_engine_config()
    assert cfg.model.quantization is None
    # the quantized panels are packed for a whole weight: no tensor parallelism
    for quant in ("int8", "int4"):
        with pytest.raises(ValueError, match="quantization with tensor_parallel_size > 1: the int8 and int4 panels"):
            EngineArgs(model=smollm2_gguf, quantization=quant, tensor_parallel_size=2).create_engine_config()

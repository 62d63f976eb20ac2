"""KV beyond the pool with tensor parallelism: swap preemption, the offload connector's RAM and disk tiers, and a
connector with asynchronous loads and delayed saves (tests/kv_transfer/standin.py), with TP = 2 on the mp executor
(and once on Ray): greedy outputs token-identical to TP = 1 (fp32), every block free afterwards.

Each rank moves its own slice of every block; the engine sizes the swap space and the tiers from the merged
KVCacheSpec, and the executor aggregates the ranks' connector reports (a load counts once both ranks report it)."""

from __future__ import annotations

import os
import random

import pytest

from kvserve import LLM, SamplingParams
from tests.conftest import assert_all_blocks_free
from tests.executor.test_tp_parity import local_ray_cluster, monkeypatch_module  # noqa: F401 - fixtures

ENGINE = dict(dtype="float32", max_model_len=256, block_size=8, max_num_batched_tokens=32, max_num_seqs=4)


def workload(seed: int = 21) -> tuple[list[dict], SamplingParams]:
    rng = random.Random(seed)
    prefix = [rng.randrange(3, 40000) for _ in range(32)]
    prompts = [prefix + [rng.randrange(3, 40000) for _ in range(rng.randrange(4, 20))] for _ in range(4)]
    return [{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def run(model: str, rounds: int = 1, reset: bool = False, **options) -> tuple[list[list[list[int]]], dict]:
    """`rounds` passes over the workload (`reset`: the prefix cache emptied between them, so later rounds load
    from the connector); outputs per round, and the stats after."""
    llm = LLM(model, **ENGINE, **options)
    try:
        prompts, params = workload()
        outs = []
        for _ in range(rounds):
            outs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
            if reset:
                assert llm.engine.engine_core.reset_prefix_cache()
        stats = llm.stats()
        assert_all_blocks_free(llm)
        return outs, stats
    finally:
        llm.shutdown()


@pytest.fixture(scope="module")
def model(tiny_model_factory) -> str:
    return tiny_model_factory("llama-gqa-untied")  # 2 KV heads: one per rank


@pytest.fixture(scope="module")
def reference(model) -> list[list[int]]:
    (out,), _ = run(model, num_kv_blocks=64)
    return out


def test_mp_tp2_swap_preemption(model, reference):
    (out,), stats = run(model, num_kv_blocks=12, preemption_mode="swap", swap_space="8MiB", tensor_parallel_size=2)
    assert stats["num_swapped_out"] > 0 and stats["num_swapped_in"] > 0, stats
    assert out == reference


def test_mp_tp2_ram_and_disk_tiers(model, reference, tmp_path):
    tiers = {"kv_connector": "offload", "cpu_bytes": "2MiB", "disk_path": str(tmp_path), "disk_bytes": "64MiB"}
    outs, stats = run(model, rounds=2, reset=True, num_kv_blocks=64, tensor_parallel_size=2, kv_transfer_config=tiers)
    assert outs == [reference, reference]
    kv = stats["kv_transfer"]
    assert kv["ram_hit_blocks"] > 0 and kv["disk_blocks"] > 0, kv
    # Every rank wrote its own part of each block.
    rank_dirs = [os.path.join(root, d) for root, dirs, _ in os.walk(tmp_path) for d in dirs if d.startswith("rank")]
    assert len(rank_dirs) == 2 and all(len(os.listdir(d)) == kv["disk_blocks"] for d in rank_dirs)
    # A restarted engine: RAM is empty, the disk tier loads every rank's part.
    outs, stats = run(model, num_kv_blocks=64, tensor_parallel_size=2, kv_transfer_config=tiers)
    assert outs == [reference]
    assert stats["kv_transfer"]["disk_hit_blocks"] > 0, stats["kv_transfer"]


def test_mp_tp2_async_loads_and_delayed_saves(model, reference, tmp_path):
    """The stand-in connector: rank r finishes a load r + 1 steps after it starts, and saves run after a request
    ends (its blocks kept until both ranks report them); the aggregated reports must wait for both ranks."""
    config = {"kv_connector": "standin", "kv_connector_module_path": "tests.kv_transfer.standin"}
    config["store_dir"] = str(tmp_path)
    outs, stats = run(model, rounds=2, reset=True, num_kv_blocks=64, tensor_parallel_size=2, kv_transfer_config=config)
    assert outs == [reference, reference]
    assert stats["kv_transfer"]["loaded_blocks"] > 0 and stats["kv_transfer"]["saved_blocks"] > 0


def test_ray_tp2_offload_tiers(local_ray_cluster, model, reference, tmp_path):  # noqa: F811
    tiers = {"kv_connector": "offload", "cpu_bytes": "2MiB", "disk_path": str(tmp_path)}
    outs, stats = run(
        model,
        rounds=2,
        reset=True,
        num_kv_blocks=64,
        tensor_parallel_size=2,
        distributed_executor_backend="ray",
        kv_transfer_config=tiers,
        preemption_mode="swap",
    )
    assert outs == [reference, reference]
    assert stats["kv_transfer"]["ram_hit_blocks"] > 0

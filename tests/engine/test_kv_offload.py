"""The offload connector and swap preemption end to end on a tiny random model: greedy outputs token-identical to
an engine without them, hits from the RAM tier and (after a restart) the disk tier, bad disk files as misses, and
no block left held in the pool or pinned in a tier."""

from __future__ import annotations

import os
import random
import threading

import pytest

from kvserve import LLM, SamplingParams
from kvserve.kv_transfer.base import KVConnectorOutput
from kvserve.kv_transfer.factory import register_connector
from kvserve.kv_transfer.offload import disk_format
from kvserve.kv_transfer.offload.worker import OffloadConnectorWorker
from tests.conftest import assert_all_blocks_free

MODEL = "llama-gqa-untied"
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
# A pool of 24 blocks of 8 tokens: four conversations of up to ~100 tokens cannot all stay in it.
ENGINE = dict(dtype="float32", max_model_len=256, block_size=8, num_kv_blocks=24)


def conversations(seed: int = 0, num: int = 4, turns: int = 3) -> list[list[int]]:
    """Each turn resends the whole conversation so far plus a new message (the multi-turn shape)."""
    rng = random.Random(seed)
    histories = [[rng.randrange(3, 49000) for _ in range(30)] for _ in range(num)]
    prompts = []
    for _ in range(turns):
        for c in range(num):
            histories[c] = histories[c] + [rng.randrange(3, 49000) for _ in range(20)]
            prompts.append(list(histories[c]))
    return prompts


def run(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    # One at a time, so every turn finds the previous ones' blocks saved (or evicted from the pool).
    return [llm.generate({"prompt_token_ids": p}, GREEDY, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]


def offload(disk_path=None, cpu_bytes: int = 1 << 20) -> dict:
    config = {"kv_connector": "offload", "cpu_bytes": cpu_bytes}
    if disk_path is not None:
        config["disk_path"] = str(disk_path)
    return config


def assert_clean(llm: LLM) -> None:
    assert_all_blocks_free(llm)
    scheduler = llm.engine.engine_core.scheduler
    assert not scheduler.loading and not scheduler._saving
    stats = llm.stats()["kv_transfer"]
    assert stats["ram_pinned_blocks"] == 0 and stats.get("disk_pinned_blocks", 0) == 0


@pytest.fixture(scope="module")
def model_path(tiny_model_factory) -> str:
    return tiny_model_factory(MODEL)


@pytest.fixture(scope="module")
def reference(model_path) -> list[list[int]]:
    llm = LLM(model_path, **ENGINE)
    out = run(llm, conversations())
    assert llm.stats()["prefix_cache"]["num_evictions"] > 0  # the pool really is too small for the workload
    return out


def test_ram_tier_hits_beyond_the_pool_are_token_identical(model_path, reference):
    llm = LLM(model_path, kv_transfer_config=offload(), **ENGINE)
    assert run(llm, conversations()) == reference
    stats = llm.stats()["kv_transfer"]
    assert stats["ram_hit_blocks"] > 0 and stats["ram_loaded_bytes"] > 0 and stats["ram_saved_bytes"] > 0
    assert_clean(llm)


class FailingRamLoads(OffloadConnectorWorker):
    """The offload worker, but every synchronous (RAM-only) load of two blocks or more fails after its first block,
    with garbage written over the rest: a forward pass that read them would change the output."""

    def __init__(self, config, spec, rank=0) -> None:
        super().__init__(config, spec, rank)
        self._failed: dict[str, int] = {}

    def start_load_kv(self, metadata) -> set[str]:
        failed = super().start_load_kv(metadata)
        for req_id, loads in metadata.loads.items():
            if req_id in self._finished and len(loads) > 1:
                self._finished.discard(req_id)
                for block_id, _, _ in loads[1:]:
                    self.pools[0][block_id].fill_(1e4)
                self._failed[req_id] = self.spec.block_size
        return failed | set(self._failed)

    def get_finished(self, idle: bool) -> KVConnectorOutput:
        out = super().get_finished(idle)
        out.failed_loading.update(self._failed)
        self._failed = {}
        return out


register_connector(
    "failing-ram-loads",
    "kvserve.kv_transfer.offload.scheduler:OffloadConnectorScheduler",
    f"{__name__}:FailingRamLoads",
)


def test_failed_synchronous_loads_are_recomputed_token_identical(model_path, reference):
    config = {"kv_connector": "failing-ram-loads", "cpu_bytes": 1 << 20}
    llm = LLM(model_path, kv_transfer_config=config, **ENGINE)
    assert run(llm, conversations()) == reference
    stats = llm.stats()["kv_transfer"]
    assert stats["failed_loads"] > 0 and stats["ram_hit_blocks"] > 0
    assert_clean(llm)


def test_ram_tier_eviction_keeps_outputs(model_path, reference):
    # Room for 6 blocks only: most saves evict older ones.
    block_bytes = llm_block_bytes(model_path)
    llm = LLM(model_path, kv_transfer_config=offload(cpu_bytes=6 * block_bytes), **ENGINE)
    assert run(llm, conversations()) == reference
    stats = llm.stats()["kv_transfer"]
    assert stats["ram_evicted_blocks"] > 0 and stats["ram_blocks"] == 6
    assert_clean(llm)


def llm_block_bytes(model_path) -> int:
    # 2 layers x (K + V) x 8 tokens x 2 kv heads x 16 dims x 4 bytes
    return 2 * 2 * 8 * 2 * 16 * 4


def test_disk_tier_survives_a_restart_and_bad_files_are_misses(model_path, reference, tmp_path, caplog):
    prompts = conversations()
    first = LLM(model_path, kv_transfer_config=offload(tmp_path), **ENGINE)
    assert run(first, prompts) == reference
    first.engine.engine_core.shutdown()  # lets queued writes finish
    (layout_dir,) = [d for d in tmp_path.iterdir() if d.is_dir()]
    files = sorted(layout_dir.glob("*.kvb"))
    assert len(files) == first.stats()["kv_transfer"]["disk_blocks"] > 0
    assert_clean(first)

    # A restarted engine (empty pool, empty RAM tier) loads from the disk tier alone.
    second = LLM(model_path, kv_transfer_config=offload(tmp_path), **ENGINE)
    assert run(second, prompts[-4:]) == reference[-4:]
    assert second.stats()["kv_transfer"]["disk_hit_blocks"] > 0
    second.engine.engine_core.shutdown()
    assert_clean(second)

    # Corrupt, truncate and delete files: each is a miss (with a warning), the output stays exact.
    third = LLM(model_path, kv_transfer_config=offload(tmp_path), **ENGINE)
    files = sorted(layout_dir.glob("*.kvb"))
    for f in files[::3]:
        data = bytearray(f.read_bytes())
        data[-5] ^= 0xFF
        f.write_bytes(bytes(data))
    for f in files[1::3]:
        os.truncate(f, f.stat().st_size // 2)
    for f in files[2::3]:
        f.unlink()
    with caplog.at_level("WARNING", logger="kvserve.kv_transfer.offload.worker"):
        assert run(third, prompts[-4:]) == reference[-4:]
    stats = third.stats()["kv_transfer"]
    assert stats["failed_loads"] > 0
    assert any("is a miss" in r.message for r in caplog.records)
    third.engine.engine_core.shutdown()
    assert_clean(third)


def test_a_workload_ends_with_its_disk_writes_reported_even_failed_ones(model_path, reference, tmp_path, monkeypatch):
    """generate() returns once every queued disk write is reported (the index then matches the files); a write
    that fails is reported too, so the engine does not wait for it forever."""

    def no_room(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(disk_format, "write_block", no_room)
    llm = LLM(model_path, kv_transfer_config=offload(tmp_path), **ENGINE)
    result: list = []
    # A thread with a deadline: an engine waiting forever for a lost report must fail the test, not hang it.
    worker = threading.Thread(target=lambda: result.append(run(llm, conversations())), daemon=True)
    worker.start()
    worker.join(timeout=120)
    assert result == [reference], "the workload did not end"
    connector = llm.engine.engine_core.scheduler.connector
    assert not connector.has_pending_work() and not llm.engine.has_unfinished_requests()
    assert llm.stats()["kv_transfer"]["disk_blocks"] == 0
    assert_clean(llm)


def test_a_drafts_kv_rides_along_in_both_tiers(model_path, reference, tmp_path):
    """A draft model's KV is stored and loaded with the target's blocks (same slot, same file), so requests that
    hit the RAM tier, or the disk tier after a restart, draft as well as before: the target drafting for itself
    keeps accepting nearly everything, and greedy outputs stay those without speculation or offload."""
    spec = {"method": "draft_model", "model": model_path, "num_speculative_tokens": 3, "adaptive": False}
    first = LLM(model_path, kv_transfer_config=offload(tmp_path), speculative_config=spec, **ENGINE)
    assert run(first, conversations()) == reference
    assert first.stats()["kv_transfer"]["ram_hit_blocks"] > 0
    assert first.stats()["spec_decoding"]["acceptance_rate"] > 0.95
    first.engine.engine_core.shutdown()
    assert_clean(first)
    second = LLM(model_path, kv_transfer_config=offload(tmp_path), speculative_config=spec, **ENGINE)
    assert run(second, conversations()[-4:]) == reference[-4:]
    stats = second.stats()
    assert stats["kv_transfer"]["disk_loaded_bytes"] > 0
    assert stats["spec_decoding"]["acceptance_rate"] > 0.95, stats["spec_decoding"]
    second.engine.engine_core.shutdown()
    assert_clean(second)


SWAP_ENGINE = dict(dtype="float32", max_model_len=256, block_size=8, num_kv_blocks=14, max_num_seqs=8)


def swap_workload():
    rng = random.Random(3)
    prompts = [{"prompt_token_ids": [rng.randrange(3, 49000) for _ in range(rng.randint(10, 30))]} for _ in range(6)]
    return prompts, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)


@pytest.fixture(scope="module")
def swap_reference(model_path):
    prompts, params = swap_workload()
    llm = LLM(model_path, dtype="float32", max_model_len=256)  # a pool big enough: no preemption
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.parametrize("swap_space", [1 << 20, 2 * llm_block_bytes(None)])
def test_swap_preemption_is_token_identical(model_path, swap_reference, swap_space):
    prompts, params = swap_workload()
    llm = LLM(model_path, preemption_mode="swap", swap_space=swap_space, **SWAP_ENGINE)
    out = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert out == swap_reference
    stats = llm.stats()
    assert stats["num_preemptions"] > 0
    if swap_space == 1 << 20:
        assert stats["num_swapped_out"] > 0 and stats["num_swapped_in"] == stats["num_swapped_out"]
    else:  # room for two blocks: every preemption falls back to recompute
        assert stats["num_swap_fallbacks"] > 0
    swap = llm.engine.engine_core.scheduler.swap
    assert swap is not None and swap.num_free_blocks == swap.num_blocks
    assert_all_blocks_free(llm)


def test_bad_kv_transfer_configs_are_clear_errors(model_path):
    with pytest.raises(ValueError, match="unknown kv_connector"):
        LLM(model_path, kv_transfer_config={"kv_connector": "nope"}, **ENGINE)
    with pytest.raises(ValueError, match="unknown offload option"):
        LLM(model_path, kv_transfer_config={"kv_connector": "offload", "cpu_byte": 1}, **ENGINE)
    with pytest.raises(ValueError, match="not valid JSON"):
        LLM(model_path, kv_transfer_config="{", **ENGINE)
    with pytest.raises(ValueError, match="preemption_mode"):
        LLM(model_path, preemption_mode="sometimes", **ENGINE)

"""A connector's per-layer hooks run inside the model's layer loop on eager steps: wait_for_layer_load(i) right
before layer i, save_kv_layer(i) right after it, so a save can overlap the later layers."""

from __future__ import annotations

from dataclasses import dataclass

from kvserve import LLM, SamplingParams
from kvserve.kv_transfer.base import KVConnectorMetadata, KVConnectorOutput, KVConnectorScheduler, KVConnectorWorker
from kvserve.kv_transfer.factory import register_connector

CALLS: list[str] = []


@dataclass
class _Meta(KVConnectorMetadata):
    pass


class RecordingScheduler(KVConnectorScheduler):
    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        return 0, False

    def update_state_after_alloc(self, request, block_ids, num_external_tokens):
        pass

    def build_connector_meta(self, scheduler_output, requests):
        return _Meta()


class RecordingWorker(KVConnectorWorker):
    metadata_type = _Meta

    def start_load_kv(self, metadata):
        CALLS.append("start")
        return set()

    def wait_for_layer_load(self, layer_idx):
        CALLS.append(f"wait{layer_idx}")

    def save_kv_layer(self, layer_idx, kv_cache):
        CALLS.append(f"save{layer_idx}")

    def wait_for_save(self):
        CALLS.append("done")

    def get_finished(self, idle):
        return KVConnectorOutput()


register_connector("recording", f"{__name__}:RecordingScheduler", f"{__name__}:RecordingWorker")


def test_hooks_bracket_each_layer(tiny_model_factory):
    llm = LLM(
        tiny_model_factory("llama-gqa-untied"),
        dtype="float32",
        max_model_len=128,
        kv_transfer_config={"kv_connector": "recording"},
    )
    try:
        model = llm.engine.engine_core.executor.driver_runner.model
        for i, layer in enumerate(model.model.layers):
            layer.register_forward_pre_hook(lambda *_, i=i: CALLS.append(f"layer{i}"))
        CALLS.clear()
        llm.generate({"prompt_token_ids": list(range(100, 120))}, SamplingParams(max_tokens=2), use_tqdm=False)
        step = CALLS[: CALLS.index("done") + 1]
        assert step == ["start", "wait0", "layer0", "save0", "wait1", "layer1", "save1", "done"], CALLS
    finally:
        llm.shutdown()

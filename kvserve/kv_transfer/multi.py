"""The multi-connector: several connectors chained, e.g. the local RAM/disk tiers first, then a shared pool.

    kv_transfer_config = {"kv_connector": "multi", "connectors": [{"kv_connector": "offload", ...},
                                                                  {"kv_connector": "pool", ...}]}

Loads: every connector is asked; the one that holds the longest run of the prompt's next blocks loads them (ties
go to the earlier, so a local tier beats a remote pool for the same blocks), the others get nothing to load. If
any connector answers "not yet", so does the chain. Saves: every connector sees every step (each saves what it
wants). A finished request's blocks are kept until every connector that asked to keep them has reported the save
done; the kv_transfer_params of all are merged (earlier connectors win on a shared key). Events, handshake
metadata and counters are the connectors' together (counters prefixed by each connector's name).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvserve.config import KVTransferConfig
from kvserve.kv_cache_spec import KVCacheSpec
from kvserve.kv_transfer.base import (
    KVConnectorMetadata,
    KVConnectorOutput,
    KVConnectorScheduler,
    KVConnectorWorker,
    as_type,
)


def sub_configs(config: KVTransferConfig) -> list[KVTransferConfig]:
    connectors = config.options.get("connectors")
    unknown = sorted(set(config.options) - {"connectors"})
    if unknown:
        raise ValueError(f"kv_transfer_config: unknown multi-connector option(s) {', '.join(unknown)}")
    if not isinstance(connectors, (list, tuple)) or not connectors:
        raise ValueError("kv_transfer_config: the multi connector needs 'connectors', a non-empty list of configs")
    out = []
    for c in connectors:
        if not isinstance(c, dict):
            raise ValueError("kv_transfer_config: each of 'connectors' must be an object")
        sub = KVTransferConfig.from_dict(c)
        if sub.kv_connector in ("multi", "MultiConnector"):
            raise ValueError("kv_transfer_config: a multi connector cannot nest another")
        out.append(sub)
    return out


@dataclass
class MultiMetadata(KVConnectorMetadata):
    subs: list[Any] = field(default_factory=list)  # each connector's metadata, in chain order


class MultiConnectorScheduler(KVConnectorScheduler):
    def __init__(self, config: KVTransferConfig, spec: KVCacheSpec) -> None:
        from kvserve.kv_transfer.factory import create_scheduler_connector

        super().__init__(config, spec)
        self.configs = sub_configs(config)
        self.connectors = [create_scheduler_connector(c, spec) for c in self.configs]
        self._chosen: dict[str, int] = {}  # req_id -> the connector that loads its hit (admitted or being asked)
        # req_id -> connectors that kept its blocks and have not reported the save yet.
        self._keepers: dict[str, set[int]] = {}

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        answers = [c.get_num_new_matched_tokens(request, num_computed_tokens) for c in self.connectors]
        if any(n is None for n, _ in answers):
            return None, False
        best = max(range(len(answers)), key=lambda i: (answers[i][0], -i))
        self._chosen[request.request_id] = best
        return answers[best]

    def wait_for_lookups(self, timeout_s: float) -> None:
        for connector in self.connectors:
            connector.wait_for_lookups(timeout_s / len(self.connectors))

    def update_state_after_alloc(self, request, block_ids: list[int], num_external_tokens: int) -> None:
        chosen = self._chosen.pop(request.request_id, 0)
        for i, connector in enumerate(self.connectors):
            connector.update_state_after_alloc(request, block_ids, num_external_tokens if i == chosen else 0)

    def build_connector_meta(self, scheduler_output, requests: Mapping) -> MultiMetadata:
        return MultiMetadata([c.build_connector_meta(scheduler_output, requests) for c in self.connectors])

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        """Hands each connector its own output, then fills the chain's: loads as any connector reports them, a
        save once every connector that kept the request has reported it."""
        subs = output.sub_outputs or []
        saved: set[str] = set()
        for i, connector in enumerate(self.connectors):
            sub = subs[i] if i < len(subs) else KVConnectorOutput()
            connector.update_connector_output(sub)
            output.finished_loading |= sub.finished_loading
            output.failed_loading.update(sub.failed_loading)
            for req_id in sub.finished_saving:
                keepers = self._keepers.get(req_id)
                if keepers is not None:
                    keepers.discard(i)
                    if not keepers:
                        del self._keepers[req_id]
                        saved.add(req_id)
        output.finished_saving = saved

    def load_failure(self, request) -> str | None:
        # Only the connector that loaded the request knows it; the others answer None.
        return next((e for c in self.connectors if (e := c.load_failure(request)) is not None), None)

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict | None]:
        self._chosen.pop(request.request_id, None)
        keepers, params = set(), {}
        for i, connector in enumerate(self.connectors):
            keep, p = connector.request_finished(request, block_ids)
            if keep:
                keepers.add(i)
            for key, value in (p or {}).items():
                params.setdefault(key, value)
        if keepers:
            self._keepers[request.request_id] = keepers
        return bool(keepers), params or None

    def take_events(self) -> list:
        return [e for c in self.connectors for e in c.take_events()]

    def set_handshake_metadata(self, metadata: list[dict | None]) -> None:
        for i, connector in enumerate(self.connectors):
            connector.set_handshake_metadata([None if m is None else m["connectors"][i] for m in metadata])

    def has_pending_work(self) -> bool:
        return any(c.has_pending_work() for c in self.connectors)

    def stats(self) -> dict[str, float]:
        return {
            f"{cfg.kv_connector}.{key}": value
            for cfg, c in zip(self.configs, self.connectors, strict=True)
            for key, value in c.stats().items()
        }

    def shutdown(self) -> None:
        for c in self.connectors:
            c.shutdown()


class MultiConnectorWorker(KVConnectorWorker):
    metadata_type = MultiMetadata

    def __init__(self, config: KVTransferConfig, spec: KVCacheSpec, rank: int = 0) -> None:
        from kvserve.kv_transfer.factory import create_worker_connector

        super().__init__(config, spec, rank)
        self.connectors = [create_worker_connector(c, spec, rank) for c in sub_configs(config)]

    def register_kv_caches(self, kv_caches: list, mirror_pools: list[list] | None = None) -> None:
        super().register_kv_caches(kv_caches, mirror_pools)
        for c in self.connectors:
            c.register_kv_caches(kv_caches, mirror_pools)

    def get_handshake_metadata(self) -> dict | None:
        return {"connectors": [c.get_handshake_metadata() for c in self.connectors]}

    def start_load_kv(self, metadata: KVConnectorMetadata) -> set[str]:
        assert isinstance(metadata, MultiMetadata)
        failed: set[str] = set()
        for connector, sub in zip(self.connectors, metadata.subs, strict=True):
            failed |= connector.start_load_kv(as_type(sub, connector.metadata_type))
        return failed

    def wait_for_layer_load(self, layer_idx: int) -> None:
        for c in self.connectors:
            c.wait_for_layer_load(layer_idx)

    def save_kv_layer(self, layer_idx: int, kv_cache: Any) -> None:
        for c in self.connectors:
            c.save_kv_layer(layer_idx, kv_cache)

    def wait_for_save(self) -> None:
        for c in self.connectors:
            c.wait_for_save()

    def get_finished(self, idle: bool) -> KVConnectorOutput:
        return KVConnectorOutput(sub_outputs=[c.get_finished(idle) for c in self.connectors])

    def shutdown(self) -> None:
        for c in self.connectors:
            c.shutdown()

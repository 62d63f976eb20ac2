"""Connectors by name: each name maps to its scheduler-side and worker-side classes, imported only when chosen (the
scheduler process never imports a worker side's torch code until the runner does)."""

from __future__ import annotations

import importlib

from kvserve.config import KVTransferConfig
from kvserve.kv_cache_spec import KVCacheSpec
from kvserve.kv_transfer.base import KVConnectorScheduler, KVConnectorWorker

# name -> ("module:SchedulerClass", "module:WorkerClass")
_REGISTRY: dict[str, tuple[str, str]] = {
    "offload": (
        "kvserve.kv_transfer.offload.scheduler:OffloadConnectorScheduler",
        "kvserve.kv_transfer.offload.worker:OffloadConnectorWorker",
    ),
    "pool": (
        "kvserve.kv_transfer.pool.scheduler:PoolConnectorScheduler",
        "kvserve.kv_transfer.pool.worker:PoolConnectorWorker",
    ),
    "multi": (
        "kvserve.kv_transfer.multi:MultiConnectorScheduler",
        "kvserve.kv_transfer.multi:MultiConnectorWorker",
    ),
}
_ALIASES = {
    "OffloadConnector": "offload",
    "OffloadingConnector": "offload",
    "MultiConnector": "multi",
    "MooncakeStoreConnector": "pool",
}


def register_connector(name: str, scheduler_cls: str, worker_cls: str) -> None:
    """Add a connector: `scheduler_cls` and `worker_cls` are "module:Class" strings."""
    _REGISTRY[name] = (scheduler_cls, worker_cls)


def connector_names() -> list[str]:
    return sorted(_REGISTRY)


def _resolve(config: KVTransferConfig, side: int) -> type:
    if config.module_path:
        # A module of the user's that registers its connector (register_connector) when imported; imported in every
        # process that builds a side, the executor's workers included.
        importlib.import_module(config.module_path)
    name = _ALIASES.get(config.kv_connector, config.kv_connector)
    if name not in _REGISTRY:
        raise ValueError(
            f"kv_transfer_config: unknown kv_connector {config.kv_connector!r}; "
            f"choose from {', '.join(connector_names())}"
        )
    module, cls = _REGISTRY[name][side].split(":")
    return getattr(importlib.import_module(module), cls)


def validate(config: KVTransferConfig) -> None:
    """Fail at start-up on an unknown name, a chain's included (the classes check their own options when built)."""
    _resolve(config, 0)
    if _ALIASES.get(config.kv_connector, config.kv_connector) == "multi":
        from kvserve.kv_transfer.multi import sub_configs

        for sub in sub_configs(config):
            validate(sub)


def create_scheduler_connector(config: KVTransferConfig, spec: KVCacheSpec) -> KVConnectorScheduler:
    return _resolve(config, 0)(config, spec)


def create_worker_connector(config: KVTransferConfig, spec: KVCacheSpec, rank: int = 0) -> KVConnectorWorker:
    return _resolve(config, 1)(config, spec, rank)


# Prefill/decode disaggregation (kv_transfer/pd/). "MooncakeConnector" (vLLM's name) picks Mooncake's transport.
register_connector(
    "pd", "kvserve.kv_transfer.pd.scheduler:PDConnectorScheduler", "kvserve.kv_transfer.pd.worker:PDConnectorWorker"
)
_ALIASES.update({"PDConnector": "pd", "MooncakeConnector": "pd"})

"""The runner's KV I/O beyond the pool: swap preemption's copies and the KV connector's worker side.

The runner calls `before_forward` once its batch has taken the step's SchedulerOutput, passes `layer_hooks()` to
the model (the connector's per-layer calls, from inside the layer loop) or, where the step cannot call Python
between layers (a replayed CUDA graph), `wait_all_layers` before and `save_all_layers` after it, then
`after_forward` when the step's KV is all written. Everything is a no-op without swap and without a connector. A
request whose synchronous load failed is left out of the forward pass by the runner (before_forward names it).
"""

from __future__ import annotations

from kvserve.attention.base import KVCache
from kvserve.config import KVTransferConfig
from kvserve.core.sched_output import SchedulerOutput
from kvserve.kv_cache_spec import KVCacheSpec
from kvserve.kv_transfer.base import KVConnectorOutput, KVConnectorWorker, as_type
from kvserve.kv_transfer.factory import create_worker_connector
from kvserve.worker.swap import SwapSpace


class LayerHooks:
    """What the model calls around each layer of an eager forward pass (LlamaForCausalLM.forward)."""

    def __init__(self, connector: KVConnectorWorker, kv_caches: list[KVCache]) -> None:
        self.connector = connector
        self.kv_caches = kv_caches

    def before_layer(self, layer_idx: int) -> None:
        self.connector.wait_for_layer_load(layer_idx)

    def after_layer(self, layer_idx: int) -> None:
        self.connector.save_kv_layer(layer_idx, self.kv_caches[layer_idx])


class KVIO:
    def __init__(
        self,
        kv_caches: list[KVCache],
        spec: KVCacheSpec,
        rank: int,
        num_swap_blocks: int,
        kv_transfer_config: KVTransferConfig | None,
        mirror_pools: list[list[KVCache]] | None = None,
    ) -> None:
        """`mirror_pools`: pools addressed by the target's block ids (a model proposer's), moved with it."""
        self.num_layers = len(kv_caches)
        self.kv_caches = kv_caches
        pools = [kv_caches, *(mirror_pools or [])]
        self.swap = SwapSpace(num_swap_blocks, pools) if num_swap_blocks else None
        self.connector: KVConnectorWorker | None = None
        if kv_transfer_config is not None:
            self.connector = create_worker_connector(kv_transfer_config, spec, rank)
            self.connector.register_kv_caches(kv_caches, mirror_pools or [])
        self._hooks = LayerHooks(self.connector, kv_caches) if self.connector is not None else None

    def handshake_metadata(self) -> dict | None:
        return self.connector.get_handshake_metadata() if self.connector is not None else None

    def before_forward(self, so: SchedulerOutput) -> set[str]:
        """Swaps, then the connector's loads. Returns the requests to leave out of this step's forward pass: their
        synchronous KV load failed."""
        if so.blocks_to_swap_out or so.blocks_to_swap_in:
            assert self.swap is not None, "swap pairs without a swap space"
            # Out first: the freed device blocks may be reused by this step (a step never swaps both ways).
            self.swap.swap_out(so.blocks_to_swap_out)
            self.swap.swap_in(so.blocks_to_swap_in)
        if self.connector is None or so.kv_connector_metadata is None:
            return set()
        return self.connector.start_load_kv(as_type(so.kv_connector_metadata, self.connector.metadata_type))

    def layer_hooks(self) -> LayerHooks | None:
        """The per-layer calls for an eager forward pass (None without a connector)."""
        return self._hooks

    def wait_all_layers(self) -> None:
        if self.connector is not None:
            for layer in range(self.num_layers):
                self.connector.wait_for_layer_load(layer)

    def save_all_layers(self) -> None:
        if self.connector is not None:
            for layer, kv in enumerate(self.kv_caches):
                self.connector.save_kv_layer(layer, kv)

    def after_forward(self, so: SchedulerOutput) -> KVConnectorOutput | None:
        """The step's KV is written (the proposer's mirror pass included): saves complete, the report."""
        if self.connector is None:
            return None
        self.connector.wait_for_save()
        return self.connector.get_finished(idle=so.is_empty)

    def shutdown(self) -> None:
        if self.connector is not None:
            self.connector.shutdown()

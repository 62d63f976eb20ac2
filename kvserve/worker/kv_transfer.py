"""The runner's side of moving KV beyond the pool: swap preemption's copies and the KV connector's worker side.

The runner calls `before_forward` once its batch has taken the step's SchedulerOutput and `after_forward` when the
step's KV is written; both are no-ops without swap and without a connector. A request whose synchronous load failed
is left out of the forward pass by the runner (before_forward names it).
"""

from __future__ import annotations

from kvserve.attention.base import KVCache
from kvserve.config import KVTransferConfig
from kvserve.core.sched_output import SchedulerOutput
from kvserve.kv_transfer.base import KVConnectorInfo, KVConnectorOutput
from kvserve.kv_transfer.factory import create_worker_connector
from kvserve.worker.swap import SwapSpace


class KVTransfer:
    def __init__(
        self,
        kv_caches: list[KVCache],
        info: KVConnectorInfo,
        num_swap_blocks: int,
        kv_transfer_config: KVTransferConfig | None,
        mirror_pools: list[list[KVCache]] | None = None,
    ) -> None:
        """`mirror_pools`: pools addressed by the target's block ids (a model proposer's), swapped with it."""
        self.num_layers = len(kv_caches)
        self.kv_caches = kv_caches
        pools = [kv_caches, *(mirror_pools or [])]
        self.swap = SwapSpace(num_swap_blocks, pools) if num_swap_blocks else None
        self.connector = None
        if kv_transfer_config is not None:
            self.connector = create_worker_connector(kv_transfer_config, info)
            self.connector.register_kv_caches(kv_caches, mirror_pools or [])

    def before_forward(self, so: SchedulerOutput) -> set[str]:
        """Returns the requests to leave out of this step's forward pass: their synchronous KV load failed."""
        if so.blocks_to_swap_out or so.blocks_to_swap_in:
            assert self.swap is not None, "swap pairs without a swap space"
            # Out first: the freed device blocks may be reused by this step (a step never swaps both ways).
            self.swap.swap_out(so.blocks_to_swap_out)
            self.swap.swap_in(so.blocks_to_swap_in)
        failed: set[str] = set()
        if self.connector is not None and so.kv_connector_metadata is not None:
            failed = self.connector.start_load_kv(so.kv_connector_metadata)
            if not so.is_empty:
                for layer in range(self.num_layers):
                    self.connector.wait_for_layer_load(layer)
        return failed

    def after_forward(self, so: SchedulerOutput) -> KVConnectorOutput | None:
        if self.connector is None:
            return None
        if not so.is_empty:
            for layer, kv in enumerate(self.kv_caches):
                self.connector.save_kv_layer(layer, kv)
        self.connector.wait_for_save()
        return self.connector.get_finished(idle=so.is_empty)

    def shutdown(self) -> None:
        if self.connector is not None:
            self.connector.shutdown()

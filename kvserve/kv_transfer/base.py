"""The KV connector interface, in two halves that only exchange plain dataclasses.

The scheduler side lives beside the scheduler (pure Python, no torch): it says how many more prompt tokens an
external store holds for a request, learns which blocks were allocated for them, and builds one metadata value per
step, which rides in `SchedulerOutput.kv_connector_metadata` to the worker side. The worker side lives beside the
model runner: it starts the loads, may wait per layer, saves what the metadata asks, and reports back through
`ModelRunnerOutput.kv_connector_output` (a `KVConnectorOutput`), which the scheduler hands to its side.

Contract of a load. The scheduler side says, per hit, whether the load is asynchronous:
- asynchronous: the request waits in WAITING_FOR_REMOTE_KVS with its blocks allocated but not yet in the prefix
  cache, for at least one step; it is scheduled only after the worker reports the load finished (or failed: then
  the blocks that did not load are recomputed);
- synchronous: the request is scheduled at once, its loaded tokens counted as computed and its remaining tokens
  scheduled; the worker completes the load in `start_load_kv`, before the step's forward pass. If the load fails,
  the runner leaves the request out of that forward pass and the scheduler sends it again from the tokens that did
  load; its blocks join the prefix cache only once the load is reported done.
So no forward pass ever reads a block whose load is in flight or failed, and a failed load never loses the request.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvserve.config import KVTransferConfig

if TYPE_CHECKING:
    from kvserve.core.sched_output import SchedulerOutput
    from kvserve.request import Request


@dataclass(frozen=True)
class KVConnectorInfo:
    """What both halves need to know about the worker's KV cache (the runner builds it once)."""

    block_size: int  # tokens per block
    num_layers: int
    # K and V of one block across all layers, plus the same block of every pool that mirrors the pool's block ids
    # (a draft model's: KVConnectorWorker.register_kv_caches)
    block_bytes: int
    # Identifies the model and the bytes' layout (dtype, backend, packing): blocks saved under another layout
    # must never be loaded.
    layout_id: str


@dataclass
class KVConnectorMetadata:
    """Base of a connector's per-step message from its scheduler side to its worker side."""


@dataclass
class KVConnectorOutput:
    """The worker side's report after a step (plain values)."""

    finished_loading: set[str] = field(default_factory=set)  # requests whose loads completed
    # Requests whose loads failed: req_id -> how many of the requested external tokens did load (a prefix of them,
    # a multiple of the block size); the rest is recomputed.
    failed_loading: dict[str, int] = field(default_factory=dict)
    finished_saving: set[str] = field(default_factory=set)  # finished requests whose delayed saves completed
    report: Any = None  # connector-specific, read by its own scheduler side


class KVConnectorScheduler(ABC):
    """Scheduler side. The scheduler calls, per step: `get_num_new_matched_tokens` for a waiting request after its
    prefix-cache lookup, `update_state_after_alloc` once the request's blocks are allocated (every admission, with
    0 external tokens when there was no hit), `build_connector_meta` at the end of `schedule()`, then
    `update_connector_output` with the worker's report, and `request_finished` when a request ends."""

    def __init__(self, config: KVTransferConfig, info: KVConnectorInfo) -> None:
        self.config = config
        self.info = info

    @abstractmethod
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        """(tokens, load_async): the prompt tokens after the first `num_computed_tokens` (a multiple of the block
        size: the local prefix-cache hits) that the store can load, in whole blocks, leaving at least one token to
        compute; and whether their load takes more than the worker's `start_load_kv` call (False: it completes
        there, and the request computes its remaining tokens in the same step). No side effects: the scheduler may
        ask again if the request cannot be admitted now."""

    @abstractmethod
    def update_state_after_alloc(self, request: Request, block_ids: list[int], num_external_tokens: int) -> None:
        """`block_ids` are all the request's blocks; those covering tokens [request.num_computed_tokens,
        + num_external_tokens) are to be loaded (nothing when 0)."""

    @abstractmethod
    def build_connector_meta(
        self, scheduler_output: SchedulerOutput, requests: Mapping[str, Request]
    ) -> KVConnectorMetadata:
        """This step's loads and saves for the worker side; `requests` are the scheduler's live requests."""

    def update_connector_output(self, output: KVConnectorOutput) -> None:  # noqa: B027 - optional hook
        """The worker's report of a step (before the scheduler acts on finished and failed loads)."""

    def request_finished(self, request: Request, block_ids: list[int]) -> bool:
        """A request ended (finished, aborted or dropped). True: keep its blocks until the worker reports the
        request in `finished_saving` (an asynchronous save still reads them)."""
        return False

    def has_pending_work(self) -> bool:
        """True while work the worker side has started still awaits its report (the engine keeps stepping, idle
        steps included, until it arrives, so a finished workload leaves every tier's index complete)."""
        return False

    def stats(self) -> dict[str, float]:
        """Cumulative counters for LLM.stats() and /metrics."""
        return {}


class KVConnectorWorker(ABC):
    """Worker side. Per step the runner calls `start_load_kv` before the forward pass, `wait_for_layer_load(i)` and,
    after it, `save_kv_layer(i, kv)` for every layer, `wait_for_save()`, then `get_finished()`.

    NOTE: kvserve's models run all layers in one call, so on the CPU the per-layer hooks bracket the whole forward
    pass; a device backend can call them from inside the layer loop to overlap copies with compute.
    """

    def __init__(self, config: KVTransferConfig, info: KVConnectorInfo) -> None:
        self.config = config
        self.info = info
        self.kv_caches: list = []
        self.mirror_pools: list[list] = []

    def register_kv_caches(self, kv_caches: list, mirror_pools: list[list] | None = None) -> None:
        """Per layer (K, V) tensors of the pool, `[num_blocks, block_size, num_kv_heads, head_dim]` each.
        `mirror_pools`: pools in the same form addressed by the same block ids (a draft model's KV), whose blocks
        a connector that stores blocks stores and loads with the pool's (info.block_bytes counts them)."""
        self.kv_caches = kv_caches
        self.mirror_pools = list(mirror_pools or [])

    @abstractmethod
    def start_load_kv(self, metadata: KVConnectorMetadata) -> set[str]:
        """Complete this step's synchronous loads and start its asynchronous ones (into blocks no forward pass
        reads until they are reported finished). Returns the ids of requests whose synchronous load failed: the
        runner leaves them out of this step's forward pass. Every synchronous load is reported in this step's
        `get_finished`, in `finished_loading` or `failed_loading`."""

    def wait_for_layer_load(self, layer_idx: int) -> None:  # noqa: B027 - optional hook
        """Block until the loads this step's forward pass needs for this layer are in place."""

    def save_kv_layer(self, layer_idx: int, kv_cache: Any) -> None:  # noqa: B027 - optional hook
        """This layer's K/V of the step are written: a save may start."""

    def wait_for_save(self) -> None:  # noqa: B027 - optional hook
        """Block until the saves that read blocks which a later step may overwrite have copied them."""

    @abstractmethod
    def get_finished(self, idle: bool) -> KVConnectorOutput:
        """The report of this step. `idle`: the step computed nothing, so the worker may wait a little for an
        in-flight load rather than let the engine spin."""

    def shutdown(self) -> None:  # noqa: B027 - optional hook
        """Finish or drop background work; called once when the engine stops."""

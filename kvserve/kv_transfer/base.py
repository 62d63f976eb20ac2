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

Beyond loads and saves (vLLM v1's widened interface, which disaggregation builds on):
- `get_num_new_matched_tokens` may answer None, "not yet": the request stays waiting, in its place, and is asked
  again at the next step while the others go ahead (a remote lookup in flight, a peer not yet reachable);
- `request_finished` returns (keep the blocks until `finished_saving` reports the request, kv_transfer_params for
  the client's final output: e.g. where a decode instance can fetch the KV);
- a request's own `kv_transfer_params` (from the client, the OpenAI body's field) ride on the request;
- `take_events` yields KV events for the connector's tiers (kvserve.core.kv_events), published with the pool's;
- the worker side may publish handshake metadata (`get_handshake_metadata`: its side channel's address), which
  the executor gathers from every rank and the scheduler side receives (`set_handshake_metadata`).

Tensor parallelism: every rank runs a worker side over its own slice of each block; the executor aggregates
their reports (kv_transfer/aggregate.py): a load or save counts as done when every rank has reported it, a load
as failed when any rank failed it (with the fewest tokens any rank loaded).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec

from kvserve.config import KVTransferConfig
from kvserve.kv_cache_spec import KVCacheSpec

if TYPE_CHECKING:
    from kvserve.core.kv_events import KVCacheEvent
    from kvserve.core.sched_output import SchedulerOutput
    from kvserve.request import Request


@dataclass
class KVConnectorMetadata:
    """Base of a connector's per-step message from its scheduler side to its worker side. Subclasses are plain
    dataclasses of msgpack-able fields: the message crosses process boundaries (the mp executor's wire)."""


@dataclass
class KVConnectorOutput:
    """The worker side's report after a step (plain values). From one rank as the worker side returns it; after
    the executor's aggregation (kv_transfer/aggregate.py), for the whole engine, with `report` the list of the
    ranks' own reports in rank order (None when no rank had one)."""

    finished_loading: set[str] = field(default_factory=set)  # requests whose loads completed
    # Requests whose loads failed: req_id -> how many of the requested external tokens did load (a prefix of them,
    # a multiple of the block size); the rest is recomputed.
    failed_loading: dict[str, int] = field(default_factory=dict)
    finished_saving: set[str] = field(default_factory=set)  # finished requests whose delayed saves completed
    report: Any = None  # connector-specific, read by its own scheduler side
    # A chain of connectors (kv_transfer/multi.py): one output per connector, aggregated each on its own.
    sub_outputs: list[KVConnectorOutput] | None = None


def as_type(value: Any, cls: type) -> Any:
    """`value` as `cls`: unchanged when it already is one (in-process executors, Ray), converted when it crossed
    the mp executor's msgpack wire as plain maps and arrays."""
    if value is None or isinstance(value, cls):
        return value
    return msgspec.convert(value, cls)


class KVConnectorScheduler(ABC):
    """Scheduler side. The scheduler calls, per step: `get_num_new_matched_tokens` for a waiting request after its
    prefix-cache lookup, `update_state_after_alloc` once the request's blocks are allocated (every admission, with
    0 external tokens when there was no hit), `build_connector_meta` at the end of `schedule()`, then
    `update_connector_output` with the worker's (aggregated) report, and `request_finished` when a request ends.
    After each step the engine drains `take_events`."""

    # The type of the worker side's `report` (one rank's), for reports that crossed a process boundary as maps.
    report_type: type | None = None

    def __init__(self, config: KVTransferConfig, spec: KVCacheSpec) -> None:
        self.config = config
        self.spec = spec

    @abstractmethod
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """(tokens, load_async): the prompt tokens after the first `num_computed_tokens` (a multiple of the block
        size: the local prefix-cache hits) that the store can load, in whole blocks, leaving at least one token to
        compute; and whether their load takes more than the worker's `start_load_kv` call (False: it completes
        there, and the request computes its remaining tokens in the same step). tokens None: not known yet, ask
        again next step (the request keeps its place). No side effects that matter if the request is not admitted
        now: the scheduler may ask again."""

    @abstractmethod
    def update_state_after_alloc(self, request: Request, block_ids: list[int], num_external_tokens: int) -> None:
        """`block_ids` are all the request's blocks; those covering tokens [request.num_computed_tokens,
        + num_external_tokens) are to be loaded (nothing when 0)."""

    def wait_for_lookups(self, timeout_s: float) -> None:  # noqa: B027 - optional hook
        """The scheduler has nothing to run but requests this connector asked it to ask about again: block up to
        `timeout_s` for an answer, rather than let the engine spin."""

    @abstractmethod
    def build_connector_meta(
        self, scheduler_output: SchedulerOutput, requests: Mapping[str, Request]
    ) -> KVConnectorMetadata:
        """This step's loads and saves for the worker side; `requests` are the scheduler's live requests."""

    def update_connector_output(self, output: KVConnectorOutput) -> None:  # noqa: B027 - optional hook
        """The engine's aggregated report of a step (before the scheduler acts on finished and failed loads). A
        connector may rewrite the output's fields here (the multi-connector does)."""

    def load_failure(self, request: Request) -> str | None:
        """An asynchronous load of `request` failed (`update_connector_output` has seen the report): None to
        recompute the tokens that did not load (the default), or a message to end the request with instead (finish
        reason "abort", the message in its final output's kv_transfer_params["error"]), e.g. when the remote KV
        is known to be incompatible or the user turned the recompute fallback off."""
        return None

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict | None]:
        """A request ended (finished, aborted or dropped). Returns (keep: hold its blocks until the worker reports
        the request in `finished_saving`, since an asynchronous save or a remote reader still needs them;
        kv_transfer_params for the request's final output, or None)."""
        return False, None

    def take_events(self) -> list[KVCacheEvent]:
        """KV events of the connector's tiers since the last call, oldest first."""
        return []

    def set_handshake_metadata(self, metadata: list[dict | None]) -> None:  # noqa: B027 - optional hook
        """What each rank's worker side published (`KVConnectorWorker.get_handshake_metadata`), in rank order."""

    def decode_report(self, report: Any) -> Any:
        """One rank's report as `report_type` (see `as_type`)."""
        return as_type(report, self.report_type) if self.report_type is not None else report

    def has_pending_work(self) -> bool:
        """True while work the worker side has started still awaits its report (the engine keeps stepping, idle
        steps included, until it arrives, so a finished workload leaves every tier's index complete)."""
        return False

    def stats(self) -> dict[str, float]:
        """Cumulative counters for LLM.stats() and /metrics."""
        return {}

    def shutdown(self) -> None:  # noqa: B027 - optional hook
        """Release what the scheduler side holds (connections, background threads); called once at engine stop."""


class KVConnectorWorker(ABC):
    """Worker side, one per tensor-parallel rank. Per step the runner calls `start_load_kv` before the forward
    pass, `wait_for_layer_load(i)` before layer i and `save_kv_layer(i, kv)` after it (from inside the model's
    layer loop when the step runs eagerly; around the whole forward pass when it replays a CUDA graph),
    `wait_for_save()` after the step's KV is all written (a draft model's mirror pass included), then
    `get_finished()`."""

    # The scheduler side's metadata class, for metadata that crossed a process boundary as maps.
    metadata_type: type = KVConnectorMetadata

    def __init__(self, config: KVTransferConfig, spec: KVCacheSpec, rank: int = 0) -> None:
        self.config = config
        self.spec = spec
        self.rank = rank
        self.block_bytes = spec.rank_block_bytes[rank]  # this rank's slice of a block
        self.kv_caches: list = []
        self.mirror_pools: list[list] = []

    def register_kv_caches(self, kv_caches: list, mirror_pools: list[list] | None = None) -> None:
        """Per layer (K, V) tensors of the pool, `[num_blocks, block_size, num_kv_heads, head_dim]` each.
        `mirror_pools`: pools in the same form addressed by the same block ids (a draft model's KV), whose blocks
        a connector that stores blocks stores and loads with the pool's (`block_bytes` counts them)."""
        self.kv_caches = kv_caches
        self.mirror_pools = list(mirror_pools or [])

    def get_handshake_metadata(self) -> dict | None:
        """What the scheduler side must know of this rank (e.g. a side channel's address); None: nothing."""
        return None

    @abstractmethod
    def start_load_kv(self, metadata: KVConnectorMetadata) -> set[str]:
        """Complete this step's synchronous loads and start its asynchronous ones (into blocks no forward pass
        reads until they are reported finished). Returns the ids of requests whose synchronous load failed: the
        runner leaves them out of this step's forward pass. Every synchronous load is reported in this step's
        `get_finished`, in `finished_loading` or `failed_loading`."""

    def wait_for_layer_load(self, layer_idx: int) -> None:  # noqa: B027 - optional hook
        """Block until the loads this step's forward pass needs for this layer are in place."""

    def save_kv_layer(self, layer_idx: int, kv_cache: Any) -> None:  # noqa: B027 - optional hook
        """This layer's K/V of the step are written: a save of this layer may start (and overlap later layers)."""

    def wait_for_save(self) -> None:  # noqa: B027 - optional hook
        """Block until the saves that read blocks which a later step may overwrite have copied them."""

    @abstractmethod
    def get_finished(self, idle: bool) -> KVConnectorOutput:
        """The report of this step. `idle`: the step computed nothing, so the worker may wait a little for an
        in-flight load rather than let the engine spin."""

    def shutdown(self) -> None:  # noqa: B027 - optional hook
        """Finish or drop background work; called once when the engine stops."""

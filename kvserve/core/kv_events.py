"""KV cache events: which blocks a cache tier now holds or dropped (vLLM's event names and fields).

The block pool queues them for the engine's own pool (medium "device") when events are enabled; a connector's
scheduler side queues them for its tiers ("cpu", "disk", "pool"). The scheduler drains both after each step
(`Scheduler.take_kv_events`), and the engine-core process publishes them (a global index, a cache-aware router),
so the engine core itself does no I/O. Block hashes are the prefix cache's chained 16-byte digests: they depend
only on the tokens (and cache salt), so the same prefix has the same hashes on every instance.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from kvserve.core.hashing import BlockHash

MEDIUM_DEVICE = "device"  # the engine's own KV pool (CPU or GPU memory)


@dataclass
class BlockStored:
    """Blocks `block_hashes` (a chain, in order) became available in `medium`."""

    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None  # the first block's parent (None: the first block of a sequence)
    token_ids: list[int]  # the tokens of these blocks, block_size per block
    block_size: int
    lora_id: int | None = None
    medium: str | None = MEDIUM_DEVICE


@dataclass
class BlockRemoved:
    block_hashes: list[BlockHash]
    medium: str | None = MEDIUM_DEVICE


@dataclass
class AllBlocksCleared:
    """Everything `medium` held is gone (a prefix-cache reset)."""

    medium: str | None = MEDIUM_DEVICE


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass
class KVEventBatch:
    """The events of one engine step, in the order they happened."""

    ts: float  # wall-clock time of the step (seconds)
    events: list[KVCacheEvent] = field(default_factory=list)


_TYPES = {cls.__name__: cls for cls in (BlockStored, BlockRemoved, AllBlocksCleared)}


def batch_to_wire(batch: KVEventBatch) -> dict[str, Any]:
    """A batch as plain values for msgpack: each event a map with its "type" (the wire format of the publisher in
    engine/kv_events_publisher.py; the router's indexer reads it back with `batch_from_wire`)."""
    return {"ts": batch.ts, "events": [{"type": type(e).__name__, **asdict(e)} for e in batch.events]}


def batch_from_wire(data: dict[str, Any]) -> KVEventBatch:
    """The inverse of batch_to_wire; events of unknown types are skipped (a newer publisher)."""
    events: list[KVCacheEvent] = []
    for raw in data.get("events", []):
        cls = _TYPES.get(raw.pop("type", None))
        if cls is not None:
            events.append(cls(**raw))
    return KVEventBatch(float(data.get("ts", 0.0)), events)

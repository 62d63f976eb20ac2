"""The pool connector's worker side: one rank's staging buffer, its store client and the I/O thread.

Blocks pass through a staging buffer registered with the store (Mooncake reads and writes it directly): a slot
holds one stored block, header and payload (kv_transfer/common/block_format.py). Saves are copied into free slots
at the end of the step that filled their blocks (`wait_for_save`: a later step may reuse a block, never a slot in
use) and put on the I/O thread; a save that finds no free slot is dropped (the pool is a cache). Loads run wholly
on the I/O thread: fetch into slots, check each block's header and checksum, copy it into the request's fresh
blocks (no forward pass reads them until the load is reported), and report how many leading blocks arrived; the
scheduler recomputes the rest. The store client is opened on the I/O thread, so a store that is down fails loads
(a miss) and saves (dropped), never the engine.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from kvserve.attention.base import blocks_view
from kvserve.config import KVTransferConfig
from kvserve.kv_cache_spec import KVCacheSpec
from kvserve.kv_transfer.base import KVConnectorOutput, KVConnectorWorker
from kvserve.kv_transfer.common import block_format
from kvserve.kv_transfer.pool.options import KeyScheme, PoolOptions, open_store
from kvserve.kv_transfer.pool.scheduler import PoolMetadata, PoolReport

logger = logging.getLogger(__name__)

_IDLE_WAIT_S = 0.01


class PoolConnectorWorker(KVConnectorWorker):
    metadata_type = PoolMetadata

    def __init__(self, config: KVTransferConfig, spec: KVCacheSpec, rank: int = 0) -> None:
        super().__init__(config, spec, rank)
        self.options = PoolOptions.from_config(config)
        self.keys = KeyScheme(spec)
        self.digest = block_format.layout_digest(f"{spec.layout_id}|rank={rank}")
        self.slot_bytes = block_format.stored_size(self.block_bytes)
        num_slots = self.options.staging_bytes // self.slot_bytes
        if num_slots < 1:
            raise ValueError(f"kv_transfer_config: staging_bytes holds no block of {self.slot_bytes} bytes")
        # torch.empty: pages fault in as slots are first used.
        self.staging = torch.empty((num_slots, self.slot_bytes), dtype=torch.uint8)
        self._free = list(range(num_slots - 1, -1, -1))
        self._lock = threading.Lock()
        self._io = ThreadPoolExecutor(1, thread_name_prefix="kv-pool-io")
        self._store = None
        self._registered = False
        self.pools: list[torch.Tensor] = []
        self._pending_saves: list[tuple[int, str]] = []
        self._loads: dict[str, Future] = {}  # req_id -> blocks that arrived
        self._planned: dict[str, int] = {}  # req_id -> blocks to load
        self._puts: list[Future] = []
        self._counters: dict[str, float] = {}

    def register_kv_caches(self, kv_caches: list, mirror_pools: list[list] | None = None) -> None:
        super().register_kv_caches(kv_caches, mirror_pools)
        self.pools = [blocks_view(pool) for pool in [kv_caches, *self.mirror_pools]]
        total = sum(pool[0].numel() * pool.element_size() for pool in self.pools)
        assert total == self.block_bytes, (total, self.block_bytes)

    # ------------------------------------------------------------------ on the I/O thread

    def _client(self):
        if self._store is None:
            store = open_store(self.options)
            store.register_buffer(self.staging.data_ptr(), self.staging.numel())
            self._store = store
        return self._store

    def _drop_client(self, e: Exception) -> None:
        logger.warning("KV pool: store unavailable (%s)", e)
        if self._store is not None:
            try:
                self._store.close()
            except Exception:  # noqa: BLE001 - closing a broken client
                pass
        self._store = None

    def _slots(self, n: int) -> list[int]:
        with self._lock:
            if len(self._free) < n:
                return []
            return [self._free.pop() for _ in range(n)]

    def _release(self, slots: list[int]) -> None:
        with self._lock:
            self._free.extend(slots)

    def _parts(self, slot: int) -> list[torch.Tensor]:
        """A slot's payload as one view per pool, in the pools' order."""
        row = self.staging[slot, block_format.HEADER_BYTES :]
        parts, offset = [], 0
        for pool in self.pools:
            size = pool[0].numel() * pool.element_size()
            parts.append(row[offset : offset + size].view(pool.dtype).view(pool.shape[1:]))
            offset += size
        return parts

    def _load(self, loads: list[tuple[int, str]]) -> int:
        """Blocks of `loads` that arrived whole and were copied in, in order (the first failure ends it)."""
        start = time.perf_counter()
        done = 0
        while done < len(loads):
            chunk = loads[done : done + max(1, min(len(self._free), 64))]
            slots = self._slots(len(chunk))
            if not slots:
                time.sleep(0.001)  # saves hold every slot for a moment
                continue
            try:
                ok = self._client().get_into(
                    [self.keys.key(h, self.rank) for _, h in chunk],
                    [self.staging[s].data_ptr() for s in slots],
                    [self.slot_bytes] * len(chunk),
                )
            except Exception as e:  # noqa: BLE001 - the store went away: the rest is a miss
                self._drop_client(e)
                ok = [False] * len(chunk)
            try:
                for (block_id, h), slot, arrived in zip(chunk, slots, ok, strict=True):
                    if not arrived:
                        return done
                    try:
                        block_format.check(memoryview(self.staging[slot].numpy()), self.digest, self.block_bytes)
                    except block_format.BadBlock as e:
                        logger.warning("KV pool: block %s is a miss (%s)", h[:16], e)
                        return done
                    for pool, part in zip(self.pools, self._parts(slot), strict=True):
                        pool[block_id].copy_(part)
                    done += 1
            finally:
                self._release(slots)
                self._count("load_time_s", time.perf_counter() - start)
        self._count("loaded_bytes", done * self.block_bytes)
        return done

    def _put(self, saves: list[tuple[str, int]]) -> tuple[list[str], list[str]]:
        """(stored, failed) hash hexes."""
        start = time.perf_counter()
        try:
            ok = self._client().put_from(
                [self.keys.key(h, self.rank) for h, _ in saves],
                [self.staging[s].data_ptr() for _, s in saves],
                [self.slot_bytes] * len(saves),
            )
        except Exception as e:  # noqa: BLE001 - the store went away: the saves are dropped
            self._drop_client(e)
            ok = [False] * len(saves)
        finally:
            self._release([s for _, s in saves])
        self._count("save_time_s", time.perf_counter() - start)
        stored = [h for (h, _), good in zip(saves, ok, strict=True) if good]
        return stored, [h for (h, _), good in zip(saves, ok, strict=True) if not good]

    def _count(self, key: str, value: float) -> None:
        with self._lock:
            self._counters[key] = self._counters.get(key, 0) + value

    # ------------------------------------------------------------------ the step

    def start_load_kv(self, metadata) -> set[str]:
        for req_id, loads in metadata.loads.items():
            self._planned[req_id] = len(loads)
            self._loads[req_id] = self._io.submit(self._load, [(int(b), h) for b, h in loads])
        self._pending_saves = [(int(b), h) for b, h in metadata.saves]
        return set()

    def wait_for_save(self) -> None:
        saves, self._pending_saves = self._pending_saves, []
        if not saves:
            return
        # As many as there are free slots, leading blocks first (a chain is only found from its start); the rest
        # are dropped (the pool is a cache) and reported so.
        with self._lock:
            n = min(len(saves), len(self._free))
        slots = self._slots(n)
        if n < len(saves):
            self._puts.append(_done(([], [h for _, h in saves[n:]])))
            saves = saves[:n]
        if not saves:
            return
        for (block_id, _), slot in zip(saves, slots, strict=True):
            for pool, part in zip(self.pools, self._parts(slot), strict=True):
                part.copy_(pool[block_id])
            payload = memoryview(self.staging[slot, block_format.HEADER_BYTES :].numpy())
            header = block_format.header(self.digest, payload)
            self.staging[slot, : block_format.HEADER_BYTES].copy_(
                torch.frombuffer(bytearray(header), dtype=torch.uint8)
            )
        self._puts.append(self._io.submit(self._put, [(h, s) for (_, h), s in zip(saves, slots, strict=True)]))

    def get_finished(self, idle: bool) -> KVConnectorOutput:
        if idle and self._loads and not any(f.done() for f in self._loads.values()):
            # Idle steps run only for the I/O thread's results: wait a little rather than spin.
            _wait_any(list(self._loads.values()), _IDLE_WAIT_S)
        out = KVConnectorOutput(report=PoolReport())
        bs = self.spec.block_size
        for req_id, future in list(self._loads.items()):
            if not future.done():
                continue
            del self._loads[req_id]
            loaded = future.result()
            if loaded == self._planned.pop(req_id):
                out.finished_loading.add(req_id)
            else:
                out.failed_loading[req_id] = loaded * bs
        still = []
        for future in self._puts:
            if not future.done():
                still.append(future)
                continue
            stored, failed = future.result()
            out.report.saved += stored
            out.report.save_failed += failed
        self._puts = still
        with self._lock:
            out.report.counters, self._counters = self._counters, {}
        return out

    def shutdown(self) -> None:
        """Let queued puts finish (a restarted instance then finds them), then close the store client."""
        self._io.shutdown(wait=True)
        if self._store is not None:
            self._store.close()
            self._store = None


def _done(value) -> Future:
    f: Future = Future()
    f.set_result(value)
    return f


def _wait_any(futures: list[Future], timeout: float) -> None:
    from concurrent.futures import FIRST_COMPLETED, wait

    wait(futures, timeout=timeout, return_when=FIRST_COMPLETED)

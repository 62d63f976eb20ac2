"""The offload connector's worker side: the RAM tier's memory, the disk tier's files, and the copies.

RAM loads and saves are tensor copies on the calling thread, one strided copy per block across every layer (a block
is a few hundred KiB: the copy is far cheaper than a thread hand-off on the CPU engine), plus one per pool that
mirrors the pool's block ids (a draft model's KV, stored after the target's in the same slot and file). Disk
writes and disk loads run on one I/O thread, in order, so a delete, a write and a later read of the same file never
race; a request with disk blocks finishes loading when that thread has read, checked and copied them. A bad file
(missing, short, foreign, checksum) fails the load from that block on, is deleted, and is reported so the scheduler
side forgets it; the scheduler recomputes those tokens.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait

import torch

from kvserve.attention.base import blocks_view
from kvserve.config import KVTransferConfig
from kvserve.kv_cache_spec import KVCacheSpec
from kvserve.kv_transfer.base import KVConnectorOutput, KVConnectorWorker
from kvserve.kv_transfer.offload import disk_format
from kvserve.kv_transfer.offload.options import OffloadOptions, rank_dir
from kvserve.kv_transfer.offload.scheduler import DISK, OffloadMetadata, OffloadReport

logger = logging.getLogger(__name__)

_IDLE_WAIT_S = 0.01  # how long an idle step waits for an in-flight disk load before returning


class OffloadConnectorWorker(KVConnectorWorker):
    metadata_type = OffloadMetadata

    def __init__(self, config: KVTransferConfig, spec: KVCacheSpec, rank: int = 0) -> None:
        super().__init__(config, spec, rank)
        self.options = OffloadOptions.from_config(config)
        # The slots the scheduler side counts (the budget over every rank's slice of a block), each this rank's.
        self.num_slots = self.options.cpu_bytes // spec.block_bytes
        # The pool, then the pools that mirror its block ids (a draft's), each [num_blocks, 2 * num_layers, ...].
        self.pools: list[torch.Tensor] = []
        self.ram: torch.Tensor | None = None  # [num_slots, block_bytes] uint8: each pool's block in turn
        self.dir = rank_dir(self.options.disk_path, spec, rank) if self.options.disk_path else None
        if self.dir is not None:
            os.makedirs(self.dir, exist_ok=True)
        self._digest = disk_format.layout_digest(f"{spec.layout_id}|rank={rank}")
        self._io = ThreadPoolExecutor(1, thread_name_prefix="kv-offload-io") if self.dir else None
        self._pending_saves: list[tuple[int, int, bytes, bool]] = []
        self._disk_loads: dict[str, Future] = {}  # req_id -> future of (num blocks loaded, bad hash or None)
        self._writes: list[Future] = []
        self._finished: set[str] = set()
        self._lock = threading.Lock()
        self._counters: dict[str, float] = {}

    def register_kv_caches(self, kv_caches: list, mirror_pools: list[list] | None = None) -> None:
        super().register_kv_caches(kv_caches, mirror_pools)
        self.pools = [blocks_view(pool) for pool in [kv_caches, *self.mirror_pools]]
        total = sum(pool[0].numel() * pool.element_size() for pool in self.pools)
        assert total == self.block_bytes, (total, self.block_bytes)
        # torch.empty: pages are faulted in when a slot is first written, so an unused budget costs nothing.
        # A slot holds a block in the disk files' payload order.
        self.ram = torch.empty((self.num_slots, total), dtype=torch.uint8)

    def _parts(self, row: torch.Tensor) -> list[torch.Tensor]:
        """A block's bytes (a RAM slot, or a disk file's payload) as one view per pool, in the pools' order."""
        parts, offset = [], 0
        for pool in self.pools:
            size = pool[0].numel() * pool.element_size()
            parts.append(row[offset : offset + size].view(pool.dtype).view(pool.shape[1:]))
            offset += size
        return parts

    def _load_block(self, block_id: int, row: torch.Tensor) -> None:
        for pool, part in zip(self.pools, self._parts(row), strict=True):
            pool[block_id].copy_(part)

    def _count(self, key: str, value: float) -> None:
        with self._lock:
            self._counters[key] = self._counters.get(key, 0) + value

    # ------------------------------------------------------------------ loads

    def start_load_kv(self, metadata) -> set[str]:
        """RAM blocks are copied in now (a load wholly from RAM is synchronous, and a RAM copy cannot fail); disk
        blocks are read on the I/O thread."""
        assert isinstance(metadata, OffloadMetadata) and self.ram is not None
        if metadata.disk_deletes:
            assert self._io is not None
            self._io.submit(self._delete, list(metadata.disk_deletes))
        self._pending_saves = list(metadata.saves)
        for req_id, loads in metadata.loads.items():
            ram = [(block_id, slot) for block_id, slot, _ in loads if slot != DISK]
            if ram:
                start = time.perf_counter()
                for block_id, slot in ram:
                    self._load_block(block_id, self.ram[slot])
                self._count("load_time_s", time.perf_counter() - start)
                self._count("ram_loaded_bytes", len(ram) * self.block_bytes)
            disk = [(i, block_id, block_hash) for i, (block_id, slot, block_hash) in enumerate(loads) if slot == DISK]
            if disk:
                assert self._io is not None
                self._disk_loads[req_id] = self._io.submit(self._load_from_disk, disk)
            else:
                self._finished.add(req_id)
        return set()

    def _load_from_disk(self, disk: list[tuple[int, int, bytes]]) -> tuple[int | None, bytes | None]:
        """Runs on the I/O thread. Returns (index in the request's loads of the first block that failed, or None;
        that block's hash)."""
        assert self.dir is not None
        start = time.perf_counter()
        for index, block_id, block_hash in disk:
            path = os.path.join(self.dir, disk_format.file_name(block_hash))
            try:
                payload = disk_format.read_block(path, self._digest, self.block_bytes)
            except disk_format.BadBlockFile as e:
                logger.warning("KV disk tier: %s is a miss (%s); recomputing from there", path, e)
                if os.path.exists(path):
                    os.unlink(path)
                self._count("load_time_s", time.perf_counter() - start)
                return index, block_hash
            self._load_block(block_id, torch.frombuffer(payload, dtype=torch.uint8))
            self._count("disk_loaded_bytes", len(payload))
        self._count("load_time_s", time.perf_counter() - start)
        return None, None

    # ------------------------------------------------------------------ saves

    def wait_for_save(self) -> None:
        """Copy this step's full blocks into their RAM slots (before the next step may overwrite the blocks), and
        queue the disk writes of those the disk lacks from a snapshot of each."""
        saves, self._pending_saves = self._pending_saves, []
        if not saves:
            return
        assert self.ram is not None and self.pools
        start = time.perf_counter()
        # In order: two saves of one step may share a slot (the first evicted by the second), and the index holds
        # the last. A disk write gets its own copy, since the slot may be reused before the I/O thread reads it.
        for block_id, slot, block_hash, to_disk in saves:
            for pool, part in zip(self.pools, self._parts(self.ram[slot]), strict=True):
                part.copy_(pool[block_id])
            if to_disk:
                assert self._io is not None
                payload = memoryview(self.ram[slot].clone().numpy())
                self._writes.append(self._io.submit(self._write, block_hash, payload))
        self._count("ram_saved_bytes", len(saves) * self.block_bytes)
        self._count("save_time_s", time.perf_counter() - start)

    def _write(self, block_hash: bytes, payload: memoryview) -> tuple[bytes, bool]:
        """Runs on the I/O thread. Returns (the block's hash, whether its file was written)."""
        assert self.dir is not None
        start = time.perf_counter()
        try:
            disk_format.write_block(os.path.join(self.dir, disk_format.file_name(block_hash)), self._digest, payload)
        except OSError as e:
            logger.warning("KV disk tier: cannot write a block (%s)", e)
            return block_hash, False
        self._count("disk_saved_bytes", len(payload))
        self._count("disk_write_time_s", time.perf_counter() - start)
        return block_hash, True

    def _delete(self, hashes: list[bytes]) -> None:
        assert self.dir is not None
        for block_hash in hashes:
            try:
                os.unlink(os.path.join(self.dir, disk_format.file_name(block_hash)))
            except FileNotFoundError:
                pass

    # ------------------------------------------------------------------ report

    def get_finished(self, idle: bool) -> KVConnectorOutput:
        if idle and (self._disk_loads or self._writes) and not self._finished:
            # Idle steps run only for the I/O thread's results (the scheduler waits for both): wait a little for
            # one rather than spin.
            in_flight = [*self._disk_loads.values(), *self._writes]
            wait(in_flight, timeout=_IDLE_WAIT_S, return_when="FIRST_COMPLETED")
        out = KVConnectorOutput(finished_loading=self._finished, report=OffloadReport())
        self._finished = set()
        for req_id, future in list(self._disk_loads.items()):
            if not future.done():
                continue
            del self._disk_loads[req_id]
            failed_at, bad_hash = future.result()
            if failed_at is None:
                out.finished_loading.add(req_id)
            else:
                out.failed_loading[req_id] = failed_at * self.spec.block_size
                out.report.disk_bad.append(bad_hash)
        still = []
        for future in self._writes:
            if not future.done():
                still.append(future)
            else:
                block_hash, written = future.result()
                (out.report.disk_written if written else out.report.disk_write_failed).append(block_hash)
        self._writes = still
        with self._lock:
            out.report.counters, self._counters = self._counters, {}
        return out

    def shutdown(self) -> None:
        """Let queued disk writes finish, so a restarted engine finds them."""
        if self._io is not None:
            self._io.shutdown(wait=True)
            self._io = None

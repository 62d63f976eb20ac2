"""The offload connector's scheduler side: which blocks the RAM and disk tiers hold, what to load and save.

Pure Python. The tiers' contents live on the worker side; this side keeps their indexes, keyed by the prefix
cache's chained block hashes, so a hit anywhere means the same whole prefix:

- RAM tier: `cpu_bytes / block_bytes` slots, LRU. A block is saved as soon as the step that fills it has run
  (every full, computed block of a scheduled request that RAM lacks); the copy happens after that step's forward
  pass, before any later step can overwrite the block, so the entry is usable from the next step on.
- Disk tier: written behind RAM (each RAM save of a block the disk lacks also queues a file write on the worker's
  I/O thread); an entry exists only once the worker reports the file written, and start-up indexes the files a
  previous engine left (oldest first). LRU within `disk_bytes`; evicted files are deleted by the worker.
With tensor parallelism every rank holds its own slice of each block (its RAM tier, its own disk directory); the
indexes here are shared, since the ranks run the same steps, and a block is on disk only once every rank has
written its part (start-up indexes only blocks whose part every rank's directory has).
A hit held wholly in RAM loads synchronously (the worker copies it in before the step's forward pass, and the request
computes its remaining tokens in that step); a hit with any block on disk loads asynchronously. Loads pin their
entries until the worker reports them done; a block that failed to load leaves the index.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field

from kvserve.config import KVTransferConfig
from kvserve.core.hashing import BlockHash
from kvserve.kv_cache_spec import KVCacheSpec
from kvserve.kv_transfer.base import KVConnectorMetadata, KVConnectorOutput, KVConnectorScheduler
from kvserve.kv_transfer.offload import disk_format
from kvserve.kv_transfer.offload.index import TierIndex
from kvserve.kv_transfer.offload.options import OffloadOptions, rank_dir

logger = logging.getLogger(__name__)

DISK = -1  # the "slot" of a load that reads a disk file


@dataclass
class OffloadMetadata(KVConnectorMetadata):
    # req_id -> [(device block id, RAM slot or DISK, block hash)], in block order.
    loads: dict[str, list[tuple[int, int, BlockHash]]] = field(default_factory=dict)
    # (device block id, RAM slot, block hash, also write it to disk), copied after the step's forward pass.
    saves: list[tuple[int, int, BlockHash, bool]] = field(default_factory=list)
    disk_deletes: list[BlockHash] = field(default_factory=list)


@dataclass
class OffloadReport:
    """The worker side's connector-specific report."""

    disk_written: list[BlockHash] = field(default_factory=list)
    disk_write_failed: list[BlockHash] = field(default_factory=list)  # not on disk: may be written again later
    disk_bad: list[BlockHash] = field(default_factory=list)  # failed to load: drop from the index
    counters: dict[str, float] = field(default_factory=dict)  # increments of the worker's counters


class OffloadConnectorScheduler(KVConnectorScheduler):
    report_type = OffloadReport

    def __init__(self, config: KVTransferConfig, spec: KVCacheSpec) -> None:
        super().__init__(config, spec)
        self.options = OffloadOptions.from_config(config)
        self.block_size = spec.block_size
        num_slots = self.options.cpu_bytes // spec.block_bytes
        if num_slots < 1:
            raise ValueError(
                f"kv_transfer_config: cpu_bytes {self.options.cpu_bytes} holds no block of {spec.block_bytes} bytes"
            )
        self.ram = TierIndex(num_slots)
        self._free_slots = list(range(num_slots - 1, -1, -1))
        self.disk: TierIndex | None = None
        self._disk_pending: set[BlockHash] = set()  # writes queued, not yet reported
        self._pending_deletes: list[BlockHash] = []
        # Disk writes reported by some ranks, not yet all: block hash -> ranks that wrote their part.
        self._disk_written: dict[BlockHash, int] = {}
        if self.options.disk_path is not None:
            file_bytes = sum(disk_format.file_size(b) for b in spec.rank_block_bytes)
            self.disk = TierIndex(max(1, self.options.disk_bytes // file_bytes))
            self._scan_disk()
        # Per request: its device block ids (mirrored from the scheduler outputs) and how many leading blocks were
        # considered for saving.
        self._block_ids: dict[str, list[int]] = {}
        self._num_saved: dict[str, int] = {}
        self._loads: dict[str, list[tuple[int, int, BlockHash]]] = {}  # issued at the next build
        self._pinned: dict[str, list[tuple[TierIndex, BlockHash]]] = {}  # loads in flight
        self.counters: dict[str, float] = {
            "ram_hit_blocks": 0,
            "disk_hit_blocks": 0,
            "miss_blocks": 0,
            "ram_saved_blocks": 0,
            "disk_saved_blocks": 0,
            "ram_evicted_blocks": 0,
            "disk_evicted_blocks": 0,
            "failed_loads": 0,
        }

    def _scan_disk(self) -> None:
        """Index the blocks a previous engine left whose part every rank's directory holds, oldest first; delete
        truncated files, parts without their siblings, and the oldest blocks beyond the budget."""
        assert self.disk is not None and self.options.disk_path is not None
        spec = self.spec
        dirs = [rank_dir(self.options.disk_path, spec, r) for r in range(spec.tp_size)]
        parts: list[dict[BlockHash, float]] = []
        for directory, block_bytes in zip(dirs, spec.rank_block_bytes, strict=True):
            os.makedirs(directory, exist_ok=True)
            size = disk_format.file_size(block_bytes)
            found: dict[BlockHash, float] = {}
            with os.scandir(directory) as it:
                for entry in it:
                    block_hash = disk_format.hash_of(entry.name)
                    if block_hash is None:
                        continue
                    st = entry.stat()
                    if st.st_size != size:  # truncated (files are replaced whole, so never a write in progress)
                        logger.warning("KV disk tier: deleting %s (size %d, expected %d)", entry.path, st.st_size, size)
                        os.unlink(entry.path)
                        continue
                    found[block_hash] = st.st_mtime
            parts.append(found)
        complete = set(parts[0]).intersection(*parts[1:])
        ordered = sorted(complete, key=lambda h: max(p[h] for p in parts))
        excess = max(0, len(ordered) - self.disk.capacity)
        doomed = set(ordered[:excess])  # over the budget (it may have shrunk): the oldest go
        for directory, found in zip(dirs, parts, strict=True):
            for block_hash in found:
                if block_hash in doomed or block_hash not in complete:
                    os.unlink(os.path.join(directory, disk_format.file_name(block_hash)))
        for block_hash in ordered[excess:]:
            self.disk.insert(block_hash, None)
        if ordered:
            logger.info("KV disk tier: %d blocks found in %s", len(ordered) - excess, dirs[0])

    # ------------------------------------------------------------------ lookups and loads

    def _tier_of(self, block_hash: BlockHash) -> TierIndex | None:
        if block_hash in self.ram:
            return self.ram
        if self.disk is not None and block_hash in self.disk:
            return self.disk
        return None

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        """RAM hits load synchronously (a copy before the forward pass); a hit with any block on disk loads on the
        worker's I/O thread, asynchronously."""
        start = num_computed_tokens // self.block_size
        end = (request.num_tokens - 1) // self.block_size  # at least one token is left to compute
        n, on_disk = 0, False
        for block_hash in request.block_hashes[start:end]:
            tier = self._tier_of(block_hash)
            if tier is None:
                break
            n += 1
            on_disk = on_disk or tier is not self.ram
        return n * self.block_size, on_disk

    def update_state_after_alloc(self, request, block_ids: list[int], num_external_tokens: int) -> None:
        start = request.num_computed_tokens // self.block_size
        num_blocks = num_external_tokens // self.block_size
        end = (request.num_tokens - 1) // self.block_size
        self.counters["miss_blocks"] += max(0, end - start - num_blocks)
        if not num_blocks:
            return
        loads, pins = [], []
        for i in range(start, start + num_blocks):
            block_hash = request.block_hashes[i]
            tier = self._tier_of(block_hash)
            assert tier is not None, "a matched block left its tier before the load was issued"
            tier.touch(block_hash)
            tier.pin(block_hash)
            pins.append((tier, block_hash))
            slot = self.ram.get(block_hash) if tier is self.ram else DISK
            loads.append((block_ids[i], slot, block_hash))
            self.counters["ram_hit_blocks" if tier is self.ram else "disk_hit_blocks"] += 1
        self._loads[request.request_id] = loads
        self._pinned[request.request_id] = pins

    # ------------------------------------------------------------------ saves

    def build_connector_meta(self, scheduler_output, requests: Mapping) -> OffloadMetadata:
        for req_id in scheduler_output.finished_req_ids:
            self._block_ids.pop(req_id, None)
            self._num_saved.pop(req_id, None)
        for new in scheduler_output.scheduled_new_reqs:
            self._block_ids[new.req_id] = list(new.block_ids)
            self._num_saved[new.req_id] = 0
        for cached in scheduler_output.scheduled_cached_reqs:
            self._block_ids[cached.req_id].extend(cached.new_block_ids)
        meta = OffloadMetadata(loads=self._loads, disk_deletes=self._pending_deletes)
        self._loads, self._pending_deletes = {}, []
        for req_id in scheduler_output.num_scheduled_tokens:
            request = requests[req_id]
            # Blocks full of known tokens whose KV is written by the end of this step (drafts never fill a hashed
            # block: they follow the known tokens).
            num_full = min(len(request.block_hashes), request.num_computed_tokens // self.block_size)
            block_ids = self._block_ids[req_id]
            for i in range(self._num_saved[req_id], num_full):
                self._plan_save(request.block_hashes[i], block_ids[i], meta)
            self._num_saved[req_id] = max(self._num_saved[req_id], num_full)
        return meta

    def _plan_save(self, block_hash: BlockHash, block_id: int, meta: OffloadMetadata) -> None:
        if block_hash in self.ram:
            self.ram.touch(block_hash)
            return
        evicted = self.ram.make_room()
        if evicted is False:
            return  # every slot is being loaded from: skip this save
        if evicted is not None:
            self._free_slots.append(evicted[1])
            self.counters["ram_evicted_blocks"] += 1
        slot = self._free_slots.pop()
        # Usable from the next step on: the worker copies it after this step's forward pass, before next step's loads.
        self.ram.insert(block_hash, slot)
        self.counters["ram_saved_blocks"] += 1
        to_disk = self.disk is not None and block_hash not in self.disk and block_hash not in self._disk_pending
        if to_disk:
            self._disk_pending.add(block_hash)
        meta.saves.append((block_id, slot, block_hash, to_disk))

    # ------------------------------------------------------------------ reports

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        """`output.report`: the ranks' OffloadReports. A block written by every rank joins the disk index; one
        that failed to write or to load on any rank leaves it (and every rank's part is deleted)."""
        for req_id in output.finished_loading | set(output.failed_loading):
            self._unpin(req_id)
        self.counters["failed_loads"] += len(output.failed_loading)
        for raw in output.report or []:
            if raw is not None:
                self._apply_report(self.decode_report(raw))

    def _apply_report(self, report: OffloadReport) -> None:
        for block_hash in report.disk_bad:
            if self.disk is not None and block_hash in self.disk:
                self.disk.remove(block_hash)
                self._pending_deletes.append(block_hash)
        for block_hash in report.disk_write_failed:
            if block_hash in self._disk_pending:
                self._disk_pending.discard(block_hash)
                self._disk_written.pop(block_hash, None)
                self._pending_deletes.append(block_hash)  # the parts other ranks wrote
        if self.disk is not None:
            for block_hash in report.disk_written:
                if block_hash not in self._disk_pending:
                    continue  # another rank failed it
                ranks = self._disk_written.get(block_hash, 0) + 1
                if ranks < self.spec.tp_size:
                    self._disk_written[block_hash] = ranks
                    continue
                self._disk_written.pop(block_hash, None)
                self._disk_pending.discard(block_hash)
                if block_hash in self.disk:
                    continue
                evicted = self.disk.make_room()
                if evicted is False:
                    self._pending_deletes.append(block_hash)
                    continue
                if evicted is not None:
                    self._pending_deletes.append(evicted[0])
                    self.counters["disk_evicted_blocks"] += 1
                self.disk.insert(block_hash, None)
                self.counters["disk_saved_blocks"] += 1
        for key, value in report.counters.items():  # bytes and seconds: summed over the ranks
            self.counters[key] = self.counters.get(key, 0) + value

    def _unpin(self, req_id: str) -> None:
        for tier, block_hash in self._pinned.pop(req_id, []):
            if block_hash in tier:
                tier.unpin(block_hash)

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict | None]:
        # A load already planned still goes out and is reported (the scheduler holds a loading request's blocks
        # until then), which is when its pins go.
        self._block_ids.pop(request.request_id, None)
        self._num_saved.pop(request.request_id, None)
        return False, None

    def has_pending_work(self) -> bool:
        return bool(self._disk_pending)

    def stats(self) -> dict[str, float]:
        out = dict(self.counters)
        out["ram_blocks"] = len(self.ram)
        out["ram_capacity_blocks"] = self.ram.capacity
        out["ram_pinned_blocks"] = self.ram.num_pinned
        if self.disk is not None:
            out["disk_blocks"] = len(self.disk)
            out["disk_capacity_blocks"] = self.disk.capacity
            out["disk_pinned_blocks"] = self.disk.num_pinned
        return out

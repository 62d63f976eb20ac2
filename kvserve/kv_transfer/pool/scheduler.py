"""The pool connector's scheduler side: what the shared pool holds for a prompt, what to load, what to write.

Lookups. After the local prefix cache misses, the prompt's next blocks are looked up in the store on a background
thread (every tensor-parallel rank's part of each block must be there). The scheduler waits a few milliseconds for
the answer (a healthy store gives it in one or two); a slower one passes the request over ("ask again"), keeping
its place while others run, and an idle engine waits for the answer rather than spin (`wait_for_lookups`). A lookup
that takes longer than `lookup_timeout_s` is a miss, and the pool is then left alone for a few seconds (a store
that is down costs each request nothing). The answer is used once, within a second: the pool may evict at any time,
so a hit is only a hint and a failed load is recomputed.

Loads are asynchronous (the request waits in WAITING_FOR_REMOTE_KVS while the worker's I/O thread fetches its
blocks into the request's fresh blocks). Saves are written through: every block full of computed tokens that
the pool does not hold, after the step that fills it (the worker copies it to its staging buffer at the end of
that step, and puts it in the background). A block counts as stored once every rank has stored its part; then a
BlockStored event (medium "pool") tells the global index.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field

from kvserve.config import KVTransferConfig
from kvserve.core.hashing import BlockHash
from kvserve.core.kv_events import BlockStored
from kvserve.kv_cache_spec import KVCacheSpec
from kvserve.kv_transfer.base import KVConnectorMetadata, KVConnectorOutput, KVConnectorScheduler
from kvserve.kv_transfer.pool.options import KeyScheme, PoolOptions, open_store

logger = logging.getLogger(__name__)

MEDIUM_POOL = "pool"
_ANSWER_TTL_S = 1.0  # a lookup's answer is used within this long, or asked again
_BACKOFF_S = 5.0  # after a failed or slow lookup, the pool is not asked for this long
_KNOWN_CAPACITY = 1 << 16  # hashes remembered as stored (so they are not written again)
_INLINE_WAIT_S = 0.005  # how long a lookup is waited for before the request is passed over ("ask again")


@dataclass
class PoolMetadata(KVConnectorMetadata):
    loads: dict[str, list[tuple[int, str]]] = field(default_factory=dict)  # req_id -> [(block id, hash hex)]
    saves: list[tuple[int, str]] = field(default_factory=list)  # [(block id, hash hex)], after the forward pass


@dataclass
class PoolReport:
    """One rank's report of a step."""

    saved: list[str] = field(default_factory=list)  # hash hex of blocks whose part this rank stored
    save_failed: list[str] = field(default_factory=list)
    counters: dict[str, float] = field(default_factory=dict)


@dataclass
class _Lookup:
    future: Future
    start: int  # first block looked up
    asked: float  # when
    answered: float | None = None


class PoolConnectorScheduler(KVConnectorScheduler):
    report_type = PoolReport

    def __init__(self, config: KVTransferConfig, spec: KVCacheSpec) -> None:
        super().__init__(config, spec)
        self.options = PoolOptions.from_config(config)
        self.keys = KeyScheme(spec)
        self.block_size = spec.block_size
        self._store = None  # opened on the lookup thread (a store that is down must not stop the engine)
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="kv-pool-lookup")
        self._answered = threading.Event()
        self._lookups: dict[str, _Lookup] = {}
        self._backoff_until = 0.0
        self._loads: dict[str, list[tuple[int, str]]] = {}  # planned, sent at the next build
        self._loading: dict[str, int] = {}  # req_id -> blocks being loaded
        self._block_ids: dict[str, list[int]] = {}
        self._num_saved: dict[str, int] = {}  # leading blocks of each request considered for saving
        self._saving: dict[str, int] = {}  # hash hex -> ranks that reported their part stored
        self._known: OrderedDict[str, None] = OrderedDict()  # hash hex stored (by us, or found by lookups)
        self._events: list = []
        self.counters: dict[str, float] = {
            "lookups": 0,
            "lookup_timeouts": 0,
            "hit_blocks": 0,
            "miss_blocks": 0,
            "loaded_blocks": 0,
            "failed_loads": 0,
            "saved_blocks": 0,
            "failed_saves": 0,
        }

    # ------------------------------------------------------------------ lookups

    def _lookup(self, hashes: list[str]) -> int:
        """On the lookup thread: how many of the leading blocks every rank's part of is in the store."""
        try:
            if self._store is None:
                self._store = open_store(self.options)
            tp = self.keys.tp_size
            keys = [self.keys.key(h, r) for h in hashes for r in range(tp)]
            held = self._store.exists(keys)
            n = 0
            while n < len(hashes) and all(held[n * tp : (n + 1) * tp]):
                n += 1
            return n
        except Exception as e:  # the store is unreachable: a miss
            logger.warning("KV pool lookup failed: %s", e)
            self._store = None
            self._backoff_until = time.monotonic() + _BACKOFF_S
            return 0
        finally:
            self._answered.set()

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        bs = self.block_size
        start = num_computed_tokens // bs
        end = (request.num_tokens - 1) // bs  # at least one token is left to compute
        if end <= start:
            return 0, False
        now = time.monotonic()
        entry = self._lookups.get(request.request_id)
        if entry is not None and (entry.start > start or (entry.answered and now - entry.answered > _ANSWER_TTL_S)):
            entry = None  # the local cache lost blocks since, or the answer is stale: ask again
        if entry is None:
            if now < self._backoff_until:
                return 0, False
            hashes = [h.hex() for h in request.block_hashes[start:end]]
            self._answered.clear()
            entry = _Lookup(self._executor.submit(self._lookup, hashes), start, now)
            self._lookups[request.request_id] = entry
            self.counters["lookups"] += 1
            # A healthy store answers within a millisecond or two: wait that long here, so that the request is
            # admitted in this very step; a slower answer is asked for again at the next step.
            try:
                entry.future.result(timeout=_INLINE_WAIT_S)
            except FutureTimeout:
                return None, False
        if not entry.future.done():
            if now - entry.asked > self.options.lookup_timeout_s:
                # Slow store: a miss now, and no more lookups for a while (the thread is still busy with this one).
                del self._lookups[request.request_id]
                self.counters["lookup_timeouts"] += 1
                self._backoff_until = now + _BACKOFF_S
                return 0, False
            return None, False
        entry.answered = entry.answered or now
        found = max(0, entry.future.result() - (start - entry.start))
        return found * bs, found > 0

    def wait_for_lookups(self, timeout_s: float) -> None:
        if any(not e.future.done() for e in self._lookups.values()):
            self._answered.wait(timeout_s)

    def update_state_after_alloc(self, request, block_ids: list[int], num_external_tokens: int) -> None:
        self._lookups.pop(request.request_id, None)
        bs = self.block_size
        start = request.num_computed_tokens // bs
        end = (request.num_tokens - 1) // bs
        n = num_external_tokens // bs
        self.counters["hit_blocks"] += n
        self.counters["miss_blocks"] += max(0, end - start - n)
        if n:
            self._loading[request.request_id] = n
            self._loads[request.request_id] = [
                (block_ids[i], request.block_hashes[i].hex()) for i in range(start, start + n)
            ]
            for i in range(start, start + n):
                self._remember(request.block_hashes[i].hex())

    # ------------------------------------------------------------------ saves

    def build_connector_meta(self, scheduler_output, requests: Mapping) -> PoolMetadata:
        for req_id in scheduler_output.finished_req_ids:
            self._block_ids.pop(req_id, None)
            self._num_saved.pop(req_id, None)
        bs = self.block_size
        for new in scheduler_output.scheduled_new_reqs:
            self._block_ids[new.req_id] = list(new.block_ids)
            # Blocks computed before admission were hits: the local cache (saved when first computed here) or loads
            # from the pool (in it already).
            self._num_saved[new.req_id] = new.num_computed_tokens // bs
        for cached in scheduler_output.scheduled_cached_reqs:
            self._block_ids[cached.req_id].extend(cached.new_block_ids)
        meta = PoolMetadata(loads=self._loads)
        self._loads = {}
        for req_id in scheduler_output.num_scheduled_tokens:
            request = requests[req_id]
            num_full = min(len(request.block_hashes), request.num_computed_tokens // bs)
            block_ids = self._block_ids[req_id]
            for i in range(self._num_saved[req_id], num_full):
                h = request.block_hashes[i].hex()
                if h not in self._known and h not in self._saving:
                    self._saving[h] = 0
                    meta.saves.append((block_ids[i], h))
            self._num_saved[req_id] = max(self._num_saved[req_id], num_full)
        return meta

    def _remember(self, h: str) -> None:
        self._known[h] = None
        self._known.move_to_end(h)
        if len(self._known) > _KNOWN_CAPACITY:
            self._known.popitem(last=False)

    # ------------------------------------------------------------------ reports

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        for req_id in output.finished_loading:
            self.counters["loaded_blocks"] += self._loading.pop(req_id, 0)
        for req_id, num_tokens in output.failed_loading.items():
            self._loading.pop(req_id, None)
            self.counters["loaded_blocks"] += num_tokens // self.block_size
            self.counters["failed_loads"] += 1
        stored: list[BlockHash] = []
        for raw in output.report or []:
            if raw is None:
                continue
            report = self.decode_report(raw)
            for h in report.save_failed:
                if self._saving.pop(h, None) is not None:
                    self.counters["failed_saves"] += 1
            for h in report.saved:
                if h not in self._saving:
                    continue  # another rank failed it
                self._saving[h] += 1
                if self._saving[h] == self.keys.tp_size:
                    del self._saving[h]
                    self._remember(h)
                    self.counters["saved_blocks"] += 1
                    stored.append(bytes.fromhex(h))
            for key, value in report.counters.items():
                self.counters[key] = self.counters.get(key, 0) + value
        if stored:
            self._events.append(BlockStored(stored, None, [], self.block_size, medium=MEDIUM_POOL))

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict | None]:
        # Saves copy their blocks at the end of the step that fills them: nothing needs the blocks any longer.
        self._lookups.pop(request.request_id, None)
        self._block_ids.pop(request.request_id, None)
        self._num_saved.pop(request.request_id, None)
        return False, None

    def take_events(self) -> list:
        events, self._events = self._events, []
        return events

    def has_pending_work(self) -> bool:
        return bool(self._saving)

    def stats(self) -> dict[str, float]:
        return dict(self.counters)

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
        if self._store is not None:
            self._store.close()
            self._store = None

"""The pd connector's scheduler side (pure Python): which prompts a consumer fetches and into which blocks, which
finished requests a producer keeps for their consumers, and what each tells its client.

Producer (kv_producer / kv_both), a request with {"do_remote_decode": true}: when it finishes (not aborted), its
full prompt blocks are kept (`request_finished` -> keep) and named to the workers, which hold them under a lease
until a consumer has pulled them, released them, or the lease expires; the blocks are freed when every rank has
reported the lease ended (`finished_saving`). Its final output carries the params a consumer needs (params.py).

Consumer (kv_consumer / kv_both), a request with {"do_remote_prefill": true, ...}: the prompt's full blocks past
its own prefix-cache hits are fetched (the last partial block, or the whole last block when the prompt fills its
blocks, is computed here: at least one token must be, to sample from), asynchronously: the request waits in
WAITING_FOR_REMOTE_KVS meanwhile. Requests naming the same remote request (the samples of n > 1) share one fetch:
while one loads, the others are asked again next step, and once it has loaded they find its blocks in the prefix
cache. A request that ends without fetching releases the producer's lease. A failed fetch is recomputed, unless
the producer refused the handshake (the engines are incompatible) or `recompute_on_failure` is off: then the request
ends with finish reason "abort" and kv_transfer_params {"error": ...}.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field

from kvserve.config import KVTransferConfig
from kvserve.kv_cache_spec import KVCacheSpec
from kvserve.kv_transfer.base import KVConnectorOutput, KVConnectorScheduler
from kvserve.kv_transfer.pd import wire
from kvserve.kv_transfer.pd.meta import PDMetadata, PDReport, RecvSpec, ReleaseSpec
from kvserve.kv_transfer.pd.options import PDOptions
from kvserve.kv_transfer.pd.params import RemoteSource, producer_params, wants_remote_decode, wants_remote_prefill
from kvserve.request import Request, RequestStatus

logger = logging.getLogger(__name__)

_LOADING, _LOADED, _FAILED = "loading", "loaded", "failed"


@dataclass
class _Fetch:
    """One remote request's KV on this consumer: who fetches it, how it went, which live requests name it."""

    loader: str | None = None
    state: str | None = None
    live: set[str] = field(default_factory=set)


class PDConnectorScheduler(KVConnectorScheduler):
    report_type = PDReport

    def __init__(self, config: KVTransferConfig, spec: KVCacheSpec) -> None:
        super().__init__(config, spec)
        self.options = PDOptions.from_config(config)
        self.produces = config.kv_role in ("kv_producer", "kv_both")
        self.consumes = config.kv_role in ("kv_consumer", "kv_both")
        self.engine_id = config.engine_id or f"kvserve-{uuid.uuid4().hex[:12]}"
        self.ranks: list[tuple[str, int]] = []  # each rank's side channel (producers)
        # Consumer state.
        self._sources: dict[str, RemoteSource] = {}  # req_id -> where its prompt KV is (parsed once)
        self._fetches: dict[tuple[str, str], _Fetch] = {}
        self._done: set[str] = set()  # requests past their fetch (loaded, failed or not needed): never again
        self._errors: dict[str, tuple[str, str]] = {}  # req_id -> (kind, message) of its failed fetch
        self._recvs: dict[str, RecvSpec] = {}
        self._releases: list[ReleaseSpec] = []
        # Producer state.
        self._leases: dict[str, list[int]] = {}  # kept, not yet named to the workers
        self._num_kept = 0
        self.counters = {
            "remote_prefills": 0,  # fetches started
            "remote_prefill_blocks": 0,
            "remote_prefill_failures": 0,
            "remote_decodes": 0,  # requests kept for a consumer
        }
        self._worker_counters: dict[str, float] = {}

    def set_handshake_metadata(self, metadata: list[dict | None]) -> None:
        if self.produces:
            self.ranks = [(m["host"], m["port"]) for m in metadata if m is not None]
            assert len(self.ranks) == self.spec.tp_size, metadata

    # ------------------------------------------------------------------ consumer

    def _source(self, request: Request) -> RemoteSource | None:
        req_id = request.request_id
        if not self.consumes or req_id in self._done or not wants_remote_prefill(request.kv_transfer_params):
            return None
        source = self._sources.get(req_id)
        if source is None:
            try:
                source = RemoteSource.from_params(request.kv_transfer_params or {}, self.spec.tp_size)
            except ValueError as e:
                logger.warning("request %s: %s; computing its prompt here", req_id, e)
                self._done.add(req_id)
                return None
            self._sources[req_id] = source
            self._fetches.setdefault(source.key, _Fetch()).live.add(req_id)
        return source

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        source = self._source(request)
        if source is None:
            return 0, False
        fetch = self._fetches[source.key]
        if fetch.state == _LOADING and fetch.loader != request.request_id:
            return None, False  # a sibling is fetching the same blocks: ask again once they are in
        if fetch.state is not None:
            return 0, False  # fetched by a sibling (now prefix-cache hits), or failed: compute the rest here
        bs = self.spec.block_size
        # Whole blocks, leaving at least one prompt token to compute (it samples the first output token).
        usable = min(source.num_blocks, (request.num_prompt_tokens - 1) // bs)
        first = num_computed_tokens // bs
        return max(0, usable - first) * bs, True

    def update_state_after_alloc(self, request: Request, block_ids: list[int], num_external_tokens: int) -> None:
        source = self._source(request)
        if source is None:
            return
        req_id = request.request_id
        self._done.add(req_id)
        fetch = self._fetches[source.key]
        if not num_external_tokens:
            if fetch.state is None:  # nothing to fetch (all hit locally, or a short prompt): free the producer's
                fetch.state = _LOADED
                if source.num_blocks:
                    self._release(source)
            return
        bs = self.spec.block_size
        first = request.num_computed_tokens // bs
        dst = block_ids[first : first + num_external_tokens // bs]
        self._recvs[req_id] = RecvSpec(source.engine_id, source.request_id, list(source.ranks), first, dst)
        fetch.loader, fetch.state = req_id, _LOADING
        self.counters["remote_prefills"] += 1
        self.counters["remote_prefill_blocks"] += len(dst)

    def _release(self, source: RemoteSource) -> None:
        self._releases.append(ReleaseSpec(source.engine_id, source.request_id, list(source.ranks)))

    def load_failure(self, request: Request) -> str | None:
        kind, message = self._errors.pop(request.request_id, (wire.ERROR, "the KV transfer failed"))
        source = self._sources.get(request.request_id)
        where = f" from engine {source.engine_id}" if source is not None else ""
        if kind == wire.MISMATCH:
            return f"remote prefill refused{where}: {message}"
        if not self.options.recompute_on_failure:
            return f"remote prefill failed{where}: {message} (recompute_on_failure is off)"
        logger.warning(
            "request %s: remote prefill failed%s (%s); recomputing its prompt", request.request_id, where, message
        )
        return None

    # ------------------------------------------------------------------ both

    def build_connector_meta(self, scheduler_output, requests: Mapping[str, Request]) -> PDMetadata:
        meta = PDMetadata(self._leases, self._recvs, self._releases)
        self._leases, self._recvs, self._releases = {}, {}, []
        return meta

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        reports = [self.decode_report(r) for r in (output.report or [])]
        for rank_report in reports:
            if rank_report is None:
                continue
            for req_id, (kind, message) in rank_report.errors.items():
                # The first rank's reason, unless another rank's is a mismatch (the one that must be told).
                if req_id not in self._errors or kind == wire.MISMATCH:
                    self._errors[req_id] = (kind, message)
        if reports and all(r is not None for r in reports):
            self._worker_counters = {
                "leases_held": max(r.leases_held for r in reports),
                "leases_expired": max(r.leases_expired for r in reports),
                "bytes_sent": sum(r.bytes_sent for r in reports),
                "bytes_received": sum(r.bytes_received for r in reports),
            }
        for req_id, state in [(r, _LOADED) for r in output.finished_loading] + [
            (r, _FAILED) for r in output.failed_loading
        ]:
            source = self._sources.get(req_id)
            if source is None:
                continue
            fetch = self._fetches.get(source.key)
            if fetch is not None and fetch.loader == req_id:
                fetch.state = state
            if state == _FAILED:
                self.counters["remote_prefill_failures"] += 1

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict | None]:
        req_id = request.request_id
        self._forget_consumer(request)
        params = request.kv_transfer_params
        if not self.produces or not wants_remote_decode(params) or request.status == RequestStatus.FINISHED_ABORTED:
            return False, None
        bs = self.spec.block_size
        num_blocks = min(min(request.num_computed_tokens, request.num_prompt_tokens) // bs, len(block_ids))
        kept = list(block_ids[:num_blocks])
        out = producer_params(self.engine_id, req_id, kept, self.ranks)
        if not kept:
            return False, out  # a prompt shorter than a block: nothing to fetch
        self._leases[req_id] = kept
        self.counters["remote_decodes"] += 1
        return True, out

    def _forget_consumer(self, request: Request) -> None:
        req_id = request.request_id
        source = self._sources.pop(req_id, None)
        self._done.discard(req_id)
        self._errors.pop(req_id, None)
        if source is None:
            return
        fetch = self._fetches[source.key]
        fetch.live.discard(req_id)
        if fetch.state is None and not fetch.live and source.num_blocks:
            # Ended before anyone fetched (aborted in the queue): the producer need not hold the blocks any longer.
            self._release(source)
        if fetch.loader == req_id and fetch.state == _LOADING:
            fetch.loader, fetch.state = None, _FAILED  # aborted mid-fetch: its siblings compute their prompts
        if not fetch.live:
            del self._fetches[source.key]

    def has_pending_work(self) -> bool:
        # Releases and leases ride the next step's metadata: step once more to deliver them.
        return bool(self._releases or self._leases)

    def stats(self) -> dict[str, float]:
        return {**self.counters, **self._worker_counters}

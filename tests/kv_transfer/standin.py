"""A stand-in KV connector that exercises the whole connector API, for tests (it registers itself as "standin" when
imported: pass `"kv_connector_module_path": "tests.kv_transfer.standin"`, so the mp executor's workers import it
too).

It is a small pool: a finished request's full blocks are saved to files under `store_dir` (one file per block and
tensor-parallel rank) *after* the request ends, so the scheduler keeps the request's blocks until every rank has
written its part (`request_finished` -> keep); later requests load the blocks it holds asynchronously, rank r
finishing its part r + 1 steps after the load starts (so the executor's aggregation over ranks is exercised).
Per request, through its kv_transfer_params:
- {"ask_again": n}: the first n lookups answer "not yet";
- every finished request's final output carries {"echo": its params, "saved_blocks": how many blocks it saves}.
Events: BlockStored (medium "standin") once a block's save is complete on every rank. Counters in `stats()`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

from kvserve.core.kv_events import BlockStored
from kvserve.kv_transfer.base import KVConnectorMetadata, KVConnectorOutput, KVConnectorScheduler, KVConnectorWorker
from kvserve.kv_transfer.factory import register_connector


@dataclass
class StandinMeta(KVConnectorMetadata):
    loads: dict[str, list[tuple[int, str]]] = field(default_factory=dict)  # req_id -> [(block id, hash hex)]
    saves: dict[str, list[tuple[int, str]]] = field(default_factory=dict)  # req_id -> [(block id, hash hex)]


class StandinScheduler(KVConnectorScheduler):
    def __init__(self, config, spec) -> None:
        super().__init__(config, spec)
        self.store_dir = config.options["store_dir"]
        self.stored: set[bytes] = {bytes.fromhex(f) for f in _stored_hashes(self.store_dir, spec.tp_size)}
        self.asks: dict[str, int] = {}
        self._loads: dict[str, list[tuple[int, str]]] = {}
        self._saves: dict[str, list[tuple[int, str]]] = {}
        self._saving: dict[str, list[bytes]] = {}  # req_id -> hashes being saved
        self._events: list = []
        self.handshake: list | None = None
        self.counters = {"loaded_blocks": 0, "saved_blocks": 0, "ask_again": 0}

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        asks = self.asks.get(request.request_id, 0)
        self.asks[request.request_id] = asks + 1
        if asks < int((request.kv_transfer_params or {}).get("ask_again", 0)):
            self.counters["ask_again"] += 1
            return None, False
        bs = self.spec.block_size
        n = 0
        for h in request.block_hashes[num_computed_tokens // bs : (request.num_tokens - 1) // bs]:
            if h not in self.stored:
                break
            n += 1
        return n * bs, True

    def update_state_after_alloc(self, request, block_ids, num_external_tokens):
        if not num_external_tokens:
            return
        bs = self.spec.block_size
        start = request.num_computed_tokens // bs
        end = start + num_external_tokens // bs
        self._loads[request.request_id] = [(block_ids[i], request.block_hashes[i].hex()) for i in range(start, end)]
        self.counters["loaded_blocks"] += end - start

    def build_connector_meta(self, scheduler_output, requests):
        meta = StandinMeta(self._loads, self._saves)
        self._loads, self._saves = {}, {}
        return meta

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        for req_id in output.finished_saving:
            hashes = self._saving.pop(req_id)
            self.stored.update(hashes)
            if hashes:
                self._events.append(BlockStored(hashes, None, [], self.spec.block_size, medium="standin"))

    def request_finished(self, request, block_ids):
        self.asks.pop(request.request_id, None)
        bs = self.spec.block_size
        num_full = min(len(request.block_hashes), request.num_computed_tokens // bs, len(block_ids))
        fresh = [(block_ids[i], request.block_hashes[i]) for i in range(num_full)]
        fresh = [(b, h) for b, h in fresh if h not in self.stored]
        params = {"echo": request.kv_transfer_params, "saved_blocks": len(fresh)}
        if not fresh or request.status.name == "FINISHED_ABORTED":
            return False, params
        self._saves[request.request_id] = [(b, h.hex()) for b, h in fresh]
        self._saving[request.request_id] = [h for _, h in fresh]
        self.counters["saved_blocks"] += len(fresh)
        return True, params

    def take_events(self):
        events, self._events = self._events, []
        return events

    def set_handshake_metadata(self, metadata):
        self.handshake = metadata

    def has_pending_work(self) -> bool:
        return bool(self._saving)

    def stats(self):
        return dict(self.counters)


class StandinWorker(KVConnectorWorker):
    metadata_type = StandinMeta

    def __init__(self, config, spec, rank=0) -> None:
        super().__init__(config, spec, rank)
        self.dir = os.path.join(config.options["store_dir"], f"rank{rank}")
        os.makedirs(self.dir, exist_ok=True)
        self._in_flight: dict[str, list] = {}  # req_id -> [steps left, loads]
        self._saved: set[str] = set()
        self._pending_saves: dict[str, list[tuple[int, str]]] = {}

    def get_handshake_metadata(self):
        return {"rank": self.rank, "pid": os.getpid()}

    def _pools(self) -> list[torch.Tensor]:
        from kvserve.attention.base import blocks_view

        return [blocks_view(p) for p in [self.kv_caches, *self.mirror_pools]]

    def start_load_kv(self, metadata) -> set[str]:
        for req_id, loads in metadata.loads.items():
            self._in_flight[req_id] = [self.rank + 1, loads]
        self._pending_saves.update(metadata.saves)
        return set()

    def wait_for_save(self) -> None:
        pools = self._pools()
        for req_id, saves in self._pending_saves.items():
            for block_id, hex_hash in saves:
                data = b"".join(p[block_id].contiguous().view(torch.uint8).numpy().tobytes() for p in pools)
                tmp = os.path.join(self.dir, hex_hash + ".tmp")
                with open(tmp, "wb") as f:
                    f.write(data)
                os.replace(tmp, os.path.join(self.dir, hex_hash + ".bin"))
            self._saved.add(req_id)
        self._pending_saves = {}

    def get_finished(self, idle: bool) -> KVConnectorOutput:
        out = KVConnectorOutput(finished_saving=self._saved)
        self._saved = set()
        pools = self._pools()
        for req_id in list(self._in_flight):
            entry = self._in_flight[req_id]
            entry[0] -= 1
            if entry[0] > 0:
                continue
            for block_id, hex_hash in entry[1]:
                with open(os.path.join(self.dir, hex_hash + ".bin"), "rb") as f:
                    data = f.read()
                offset = 0
                for p in pools:
                    part = p[block_id]
                    size = part.numel() * part.element_size()
                    part.copy_(
                        torch.frombuffer(bytearray(data[offset : offset + size]), dtype=part.dtype).view(part.shape)
                    )
                    offset += size
            del self._in_flight[req_id]
            out.finished_loading.add(req_id)
        return out


def _stored_hashes(store_dir: str, tp_size: int) -> set[str]:
    """Blocks whose part every rank wrote."""
    parts = []
    for rank in range(tp_size):
        d = os.path.join(store_dir, f"rank{rank}")
        parts.append({f[:-4] for f in os.listdir(d) if f.endswith(".bin")} if os.path.isdir(d) else set())
    return set.intersection(*parts) if parts else set()


register_connector("standin", f"{__name__}:StandinScheduler", f"{__name__}:StandinWorker")

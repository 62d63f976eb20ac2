"""The engine's view of a step's connector reports, from every tensor-parallel rank's (vLLM's KVOutputAggregator).

Each rank's worker side loads and saves its own slice of every block, and reports each request once per kind of
event, possibly in different steps (a disk read finishing on one rank a step before another). A request counts:
- loaded when every rank has reported it loaded; failed when every rank has reported it, at least one as failed,
  with the fewest tokens any rank loaded (a block is usable only if every rank's slice of it arrived);
- saved when every rank has reported it saved.
A request reported by some ranks only waits here until the rest report it. The connector-specific `report` of each
rank passes through as a list in rank order (the connector's scheduler side knows how to combine them), and a
multi-connector's sub-outputs are aggregated each on its own.
"""

from __future__ import annotations

from kvserve.kv_transfer.base import KVConnectorOutput, as_type

_LOADED = -1  # a rank's load result: all tokens loaded


class KVOutputAggregator:
    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self._loads: dict[str, list[int]] = {}  # req_id -> each reporting rank's result (_LOADED or tokens)
        self._saves: dict[str, int] = {}  # req_id -> ranks that reported the save
        self._subs: list[KVOutputAggregator] = []

    def aggregate(self, outputs: list[KVConnectorOutput | None]) -> KVConnectorOutput | None:
        """One output per rank (None: that rank has no connector output this step), in rank order."""
        outputs = [as_type(o, KVConnectorOutput) for o in outputs]
        if all(o is None for o in outputs):
            return None
        assert len(outputs) == self.world_size, (len(outputs), self.world_size)
        out = KVConnectorOutput()
        for o in outputs:
            if o is None:
                continue
            for req_id in o.finished_loading:
                self._loads.setdefault(req_id, []).append(_LOADED)
            for req_id, num_tokens in o.failed_loading.items():
                self._loads.setdefault(req_id, []).append(num_tokens)
            for req_id in o.finished_saving:
                self._saves[req_id] = self._saves.get(req_id, 0) + 1
        for req_id in [r for r, results in self._loads.items() if len(results) == self.world_size]:
            failed = [n for n in self._loads.pop(req_id) if n != _LOADED]
            if failed:
                out.failed_loading[req_id] = min(failed)
            else:
                out.finished_loading.add(req_id)
        for req_id in [r for r, n in self._saves.items() if n == self.world_size]:
            del self._saves[req_id]
            out.finished_saving.add(req_id)
        reports = [None if o is None else o.report for o in outputs]
        out.report = reports if any(r is not None for r in reports) else None
        subs = [None if o is None else o.sub_outputs for o in outputs]
        num_subs = max((len(s) for s in subs if s is not None), default=0)
        if num_subs:
            while len(self._subs) < num_subs:
                self._subs.append(KVOutputAggregator(self.world_size))
            out.sub_outputs = [
                self._subs[i].aggregate([None if s is None else s[i] for s in subs]) or KVConnectorOutput()
                for i in range(num_subs)
            ]
        return out

    @property
    def num_pending(self) -> int:
        """Requests some ranks have reported and others not yet."""
        return len(self._loads) + len(self._saves) + sum(a.num_pending for a in self._subs)

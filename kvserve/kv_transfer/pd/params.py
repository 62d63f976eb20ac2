"""kv_transfer_params of the pd connector, both ways (vLLM's field names, plus kvserve's per-rank addresses).

In (client -> prefill instance):  {"do_remote_decode": true}
Out (prefill instance -> client -> decode instance):
    {"do_remote_prefill": true, "do_remote_decode": false, "remote_engine_id": ..., "remote_request_id": ...,
     "remote_host": rank 0's host, "remote_port": rank 0's side-channel port, "remote_block_ids": [...],
     "remote_ranks": [[host, port], ...] (every rank's side channel), "remote_tp_size": N}
A decode instance given only remote_host/remote_port (vLLM's proxies) assumes rank r at remote_port + r.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


def wants_remote_decode(params: dict | None) -> bool:
    return bool(params) and bool(params.get("do_remote_decode"))


def wants_remote_prefill(params: dict | None) -> bool:
    return bool(params) and bool(params.get("do_remote_prefill"))


@dataclass(frozen=True)
class RemoteSource:
    """Where a decode instance fetches a request's prompt KV."""

    engine_id: str
    request_id: str  # the request's id on the prefill instance (its lease's name)
    ranks: tuple[tuple[str, int], ...]  # (host, side-channel port) of each tensor-parallel rank, in rank order
    num_blocks: int  # full prompt blocks the prefill instance holds

    @property
    def key(self) -> tuple[str, str]:
        return self.engine_id, self.request_id

    @classmethod
    def from_params(cls, params: dict[str, Any], tp_size: int) -> RemoteSource:
        """ValueError names the missing or malformed field."""

        def need(name: str, kind: type | tuple[type, ...]) -> Any:
            value = params.get(name)
            if not isinstance(value, kind) or isinstance(value, bool):
                raise ValueError(f"kv_transfer_params: {name} missing or malformed ({value!r})")
            return value

        engine_id = need("remote_engine_id", str)
        request_id = need("remote_request_id", str)
        block_ids = need("remote_block_ids", list)
        ranks = params.get("remote_ranks")
        if ranks is None:
            host, port = need("remote_host", str), need("remote_port", int)
            ranks = [[host, port + r] for r in range(tp_size)]
        if not isinstance(ranks, list) or not all(
            isinstance(r, (list, tuple)) and len(r) == 2 and isinstance(r[0], str) and isinstance(r[1], int)
            for r in ranks
        ):
            raise ValueError(f"kv_transfer_params: remote_ranks must be [[host, port], ...], got {ranks!r}")
        return cls(engine_id, request_id, tuple((h, p) for h, p in ranks), len(block_ids))


def producer_params(
    engine_id: str, request_id: str, block_ids: list[int], ranks: list[tuple[str, int]]
) -> dict[str, Any]:
    """What a prefill instance tells its client (and, through it, the decode instance)."""
    host, port = ranks[0]
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": engine_id,
        "remote_request_id": request_id,
        "remote_host": host,
        "remote_port": port,
        "remote_block_ids": list(block_ids),
        "remote_ranks": [[h, p] for h, p in ranks],
        "remote_tp_size": len(ranks),
    }

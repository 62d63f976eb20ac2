"""The plain values between the pd connector's halves (msgpack-able: they cross the mp executor's wire)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvserve.kv_transfer.base import KVConnectorMetadata


@dataclass
class RecvSpec:
    """One request's prompt blocks to fetch: rank r pulls its slice from `ranks[r]`."""

    engine_id: str
    remote_request_id: str
    ranks: list[tuple[str, int]]
    first_block: int  # index among the producer's held blocks of the first one to fetch
    dst_block_ids: list[int]


@dataclass
class ReleaseSpec:
    engine_id: str
    remote_request_id: str
    ranks: list[tuple[str, int]]


@dataclass
class PDMetadata(KVConnectorMetadata):
    leases: dict[str, list[int]] = field(default_factory=dict)  # producer: req_id -> its kept prompt blocks
    recvs: dict[str, RecvSpec] = field(default_factory=dict)  # consumer: req_id -> what to pull
    releases: list[ReleaseSpec] = field(default_factory=list)  # consumer: leases it will not read


@dataclass
class PDReport:
    """One rank's report: why its failed loads failed, and its running counters."""

    errors: dict[str, tuple[str, str]] = field(default_factory=dict)  # req_id -> (wire kind, message)
    leases_held: int = 0
    leases_expired: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0

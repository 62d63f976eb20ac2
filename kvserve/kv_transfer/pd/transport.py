"""Mooncake's TransferEngine as the pd connector's second transport: TCP, P2P handshake (the peer is named by its
"host:rpc_port", which travels on our side channel, so no metadata server or etcd is needed). Each rank registers
its KV pool once; a push is one batched synchronous write, one descriptor per contiguous run of each tensor.

Failures come back as a negative code: a dead peer at once, a silent one after MC_TCP_PROGRESS_TIMEOUT_SEC (3 s,
set by kv_transfer/common/mooncake.py where the user has not).
"""

from __future__ import annotations

import logging
import os
import threading

from kvserve.kv_transfer.common import mooncake

logger = logging.getLogger(__name__)

# Eight TCP lanes per peer moved 128 x 1 MiB fastest over a veth here (/work/trial/FINDINGS.md, 4 by default).
_DEFAULT_ENV = {"MC_TCP_LANES_PER_PEER": "8"}


class MooncakeEngine:
    def __init__(self, host: str) -> None:
        for key, value in _DEFAULT_ENV.items():
            os.environ.setdefault(key, value)
        engine = mooncake.load("mooncake.engine")
        self.engine = engine.TransferEngine()
        rc = self.engine.initialize(host, "P2PHANDSHAKE", "tcp", "")
        if rc != 0:
            raise RuntimeError(f"Mooncake TransferEngine.initialize({host!r}, P2PHANDSHAKE, tcp) failed: {rc}")
        self.endpoint = f"{host}:{self.engine.get_rpc_port()}"
        self._registered: list[int] = []
        self._lock = threading.Lock()  # one batch at a time per engine: the calls are not documented thread-safe

    def register(self, ranges: list[tuple[int, int]]) -> None:
        for addr, size in ranges:
            rc = self.engine.register_memory(addr, size)
            if rc != 0:
                raise RuntimeError(f"Mooncake register_memory of {size} bytes failed: {rc}")
            self._registered.append(addr)

    def write(self, peer: str, srcs: list[int], dsts: list[int], lens: list[int]) -> None:
        """Write the ranges into the peer's registered memory; RuntimeError when the transfer fails."""
        with self._lock:
            rc = self.engine.batch_transfer_sync_write(peer, srcs, dsts, lens)
        if rc != 0:
            raise RuntimeError(f"Mooncake write of {sum(lens)} bytes to {peer} failed ({rc})")

    def close(self) -> None:
        for addr in self._registered:
            self.engine.unregister_memory(addr)
        self._registered = []

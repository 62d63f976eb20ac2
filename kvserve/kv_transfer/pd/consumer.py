"""The consumer rank's pulls: one background task per request, over a connection to the producer rank's side channel
(kept open for the next pulls: a warm TCP window moves a small request several times faster than a fresh
connection's slow start). Results are collected for the worker's next report; `wait` lets an idle step sleep until
one comes.

A pull that fails for any reason (connection refused or reset, timeout, the producer's refusal) leaves the blocks it
wrote unusable: the load is reported failed with 0 tokens, and the scheduler side decides between a recompute and
an error (wire.MISMATCH is never recomputed: the engines are misconfigured and the user must know).
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from kvserve.kv_transfer.pd import wire
from kvserve.kv_transfer.pd.regions import KVRegions, recv_all
from kvserve.kv_transfer.pd.transport import MooncakeEngine

logger = logging.getLogger(__name__)

_KEEP_IDLE_S = 60.0  # a kept-open connection unused this long is closed, not reused (the producer keeps its 120 s)
_MAX_IDLE_PER_PEER = 4


@dataclass
class PullTask:
    req_id: str
    host: str
    port: int
    remote_request_id: str
    first_block: int
    dst_block_ids: list[int]


class PullFailed(Exception):
    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


class Puller:
    def __init__(
        self,
        handshake: wire.Handshake,
        regions: KVRegions,
        transport: str,
        mooncake: MooncakeEngine | None,
        timeout_s: float,
        connect_timeout_s: float,
        max_workers: int = 4,
    ) -> None:
        self.handshake = handshake
        self.regions = regions
        self.transport = transport
        self.mooncake = mooncake
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="pd-pull")
        self._cond = threading.Condition()
        self._loaded: set[str] = set()
        self._failed: dict[str, tuple[str, str]] = {}  # req_id -> (kind, message)
        self.num_in_flight = 0
        self.bytes_received = 0
        # Kept-open connections per producer rank, with when each was last used.
        self._idle: dict[tuple[str, int], list[tuple[socket.socket, float]]] = {}
        self._closed = False

    def start(self, task: PullTask) -> None:
        with self._cond:
            self.num_in_flight += 1
        self._pool.submit(self._run, task)

    def release(self, host: str, port: int, engine_id: str, request_ids: list[str]) -> None:
        """Tell the producer rank these leases will not be read (best effort, in the background)."""
        self._pool.submit(self._send_release, host, port, engine_id, request_ids)

    def take_results(self) -> tuple[set[str], dict[str, tuple[str, str]]]:
        with self._cond:
            loaded, failed = self._loaded, self._failed
            self._loaded, self._failed = set(), {}
            return loaded, failed

    def wait(self, timeout_s: float) -> None:
        """Block up to `timeout_s` while pulls are in flight and none has finished since the last take."""
        with self._cond:
            if self.num_in_flight and not self._loaded and not self._failed:
                self._cond.wait(timeout_s)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        with self._cond:
            self._closed = True
            for idle in self._idle.values():
                for sock, _ in idle:
                    sock.close()
            self._idle = {}

    # ------------------------------------------------------------------ the background tasks

    def _run(self, task: PullTask) -> None:
        try:
            nbytes = self._pull(task)
            result: tuple[str, str] | None = None
        except PullFailed as e:
            result = (e.kind, str(e))
        except (OSError, ValueError) as e:  # socket errors and timeouts, malformed frames
            result = (wire.ERROR, f"{type(e).__name__}: {e}")
        except Exception as e:  # never leave a load unreported
            logger.exception("pull of %s", task.req_id)
            result = (wire.ERROR, f"{type(e).__name__}: {e}")
        with self._cond:
            self.num_in_flight -= 1
            if result is None:
                self._loaded.add(task.req_id)
                self.bytes_received += nbytes
            else:
                self._failed[task.req_id] = result
            self._cond.notify_all()
        if result is not None:
            logger.warning(
                "KV pull of %s from %s:%d failed (%s): %s", task.req_id, task.host, task.port, result[0], result[1]
            )

    def _pull(self, task: PullTask) -> int:
        self.regions.check_ids(task.dst_block_ids)
        mooncake = self.transport == "mooncake"
        if mooncake:
            assert self.mooncake is not None
        pull = wire.Pull(
            self.handshake,
            task.remote_request_id,
            task.first_block,
            task.dst_block_ids,
            self.transport,
            self.mooncake.endpoint if mooncake else None,
            self.regions.bases if mooncake else None,
        )
        peer = (task.host, task.port)
        sock, reply = self._request(peer, pull)
        try:
            if reply.kind != wire.OK:
                raise PullFailed(reply.kind, reply.error)
            expected = self.regions.nbytes(len(task.dst_block_ids))
            if reply.nbytes != expected:
                raise PullFailed(wire.MISMATCH, f"the producer sends {reply.nbytes} bytes, {expected} expected")
            if mooncake:
                done = wire.recv_done(sock)
                if not done.ok:
                    raise PullFailed(wire.ERROR, done.error)
            else:
                recv_all(sock, self.regions.recv_views(task.dst_block_ids))
        except PullFailed:
            self._check_in(peer, sock)  # the exchange ended cleanly: the connection can serve the next pull
            raise
        except BaseException:
            sock.close()
            raise
        self._check_in(peer, sock)
        return expected

    def _request(self, peer: tuple[str, int], message: wire.Pull) -> tuple[socket.socket, wire.Reply]:
        """Send `message` and read the reply, on a kept-open connection to `peer` if there is one (once more on a
        fresh one if that fails before any reply: the producer may have closed it meanwhile)."""
        for _ in range(2):
            sock, reused = self._check_out(peer)
            try:
                wire.send_frame(sock, message)
                return sock, wire.recv_reply(sock)
            except OSError:
                sock.close()
                if not reused:
                    raise
        raise AssertionError("unreachable")

    def _check_out(self, peer: tuple[str, int]) -> tuple[socket.socket, bool]:
        now = time.monotonic()
        with self._cond:
            idle = self._idle.get(peer, [])
            while idle:
                sock, since = idle.pop()
                if now - since < _KEEP_IDLE_S:
                    return sock, True
                sock.close()
        sock = socket.create_connection(peer, timeout=self.connect_timeout_s)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        # Every blocking call fails after timeout_s without progress (a silent or stopped producer).
        sock.settimeout(self.timeout_s)
        return sock, False

    def _check_in(self, peer: tuple[str, int], sock: socket.socket) -> None:
        with self._cond:
            idle = self._idle.setdefault(peer, [])
            if len(idle) < _MAX_IDLE_PER_PEER and not self._closed:
                idle.append((sock, time.monotonic()))
                return
        sock.close()

    def _send_release(self, host: str, port: int, engine_id: str, request_ids: list[str]) -> None:
        peer = (host, port)
        try:
            sock, _ = self._check_out(peer)
            try:
                wire.send_frame(sock, wire.Release(engine_id, request_ids))
            except OSError:
                sock.close()
                raise
            self._check_in(peer, sock)
        except OSError as e:
            logger.info("releasing %s at %s:%d: %s", request_ids, host, port, e)

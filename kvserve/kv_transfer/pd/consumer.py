"""The consumer rank's pulls: one background task per request, each a short-lived connection to the producer rank's
side channel. Results are collected for the worker's next report; `wait` lets an idle step sleep until one comes.

A pull that fails for any reason (connection refused or reset, timeout, the producer's refusal) leaves the blocks it
wrote unusable: the load is reported failed with 0 tokens, and the scheduler side decides between a recompute and
an error (wire.MISMATCH is never recomputed: the engines are misconfigured and the user must know).
"""

from __future__ import annotations

import logging
import socket
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from kvserve.kv_transfer.pd import wire
from kvserve.kv_transfer.pd.regions import KVRegions, recv_all
from kvserve.kv_transfer.pd.transport import MooncakeEngine

logger = logging.getLogger(__name__)


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
        with socket.create_connection((task.host, task.port), timeout=self.connect_timeout_s) as sock:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            # Every blocking call below fails after timeout_s without progress (a silent or stopped producer).
            sock.settimeout(self.timeout_s)
            wire.send_frame(sock, pull)
            reply = wire.recv_reply(sock)
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
        return expected

    def _send_release(self, host: str, port: int, engine_id: str, request_ids: list[str]) -> None:
        try:
            with socket.create_connection((host, port), timeout=self.connect_timeout_s) as sock:
                sock.settimeout(self.timeout_s)
                wire.send_frame(sock, wire.Release(engine_id, request_ids))
        except OSError as e:
            logger.info("releasing %s at %s:%d: %s", request_ids, host, port, e)

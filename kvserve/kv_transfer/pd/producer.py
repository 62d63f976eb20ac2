"""The producer rank's side channel: a TCP server whose connections carry a consumer's `Pull`s (each answered by
pushing the request's blocks) and `Release`s, one after another. One thread accepts; each connection gets a thread
of its own (connections are few: a consumer keeps a handful per producer rank; a slow one must not hold up the
others)."""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time

import msgspec

from kvserve.kv_transfer.pd import wire
from kvserve.kv_transfer.pd.leases import LeaseError, LeaseTable
from kvserve.kv_transfer.pd.regions import KVRegions, send_all
from kvserve.kv_transfer.pd.transport import MooncakeEngine

logger = logging.getLogger(__name__)

# A kept-open consumer connection with no request for this long is closed (consumers drop theirs sooner).
IDLE_CONNECTION_S = 120.0


class SideChannelServer:
    def __init__(
        self,
        host: str,
        port: int,
        handshake: wire.Handshake,
        regions: KVRegions,
        leases: LeaseTable,
        mooncake: MooncakeEngine | None,
        timeout_s: float,
        lease_wait_s: float,
        stall_s: float = 0.0,
    ) -> None:
        self.handshake = handshake
        self.regions = regions
        self.leases = leases
        self.mooncake = mooncake
        self.timeout_s = timeout_s
        self.lease_wait_s = lease_wait_s
        self.stall_s = stall_s  # fault injection (options.debug_push_stall_s)
        self.bytes_sent = 0
        self._sock = socket.create_server((host, port), backlog=64)
        self.host, self.port = host, self._sock.getsockname()[1]
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._accept_loop, name=f"pd-side-channel-{self.port}", daemon=True)
        self._thread.start()

    def _accept_loop(self) -> None:
        while not self._stopped.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return  # closed by stop()
            threading.Thread(target=self._serve, args=(conn,), name="pd-push", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        """One consumer connection, kept open for its later pulls (a warm TCP window: a fresh connection's slow
        start costs more than a small transfer); closed after an idle while or a push that failed midway."""
        with conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            while not self._stopped.is_set():
                conn.settimeout(IDLE_CONNECTION_S)
                try:
                    message = wire.recv_request(conn)
                except (OSError, ValueError, msgspec.MsgspecError) as e:
                    if not isinstance(e, ConnectionError):
                        logger.info("side channel: connection closed (%s)", e)
                    return
                conn.settimeout(self.timeout_s)
                if isinstance(message, wire.Release):
                    self.leases.release(message.request_ids)
                elif not self._push(conn, message):
                    return

    def _push(self, conn: socket.socket, pull: wire.Pull) -> bool:
        """Answer one pull; False when the connection is no longer usable (the transfer broke off)."""
        problem = wire.incompatibility(self.handshake, pull.handshake)
        if problem is not None:
            logger.error("refusing a KV pull of request %s: %s", pull.request_id, problem)
            wire.send_frame(conn, wire.Reply(wire.MISMATCH, problem))
            self.leases.release([pull.request_id])  # its only reader can never use it
            return True
        if pull.transport == "mooncake" and (self.mooncake is None or not pull.mooncake_endpoint or not pull.dst_bases):
            wire.send_frame(
                conn,
                wire.Reply(wire.MISMATCH, "transport mooncake: the prefill instance's transport is tcp (set both)"),
            )
            return True
        try:
            held = self.leases.take(pull.request_id, self.lease_wait_s)
        except LeaseError as e:
            wire.send_frame(conn, wire.Reply(wire.LEASE, str(e)))
            return True
        ok = False
        try:
            end = pull.first_block + len(pull.dst_block_ids)
            if pull.first_block < 0 or end > len(held):
                wire.send_frame(
                    conn, wire.Reply(wire.ERROR, f"blocks [{pull.first_block}, {end}) asked, {len(held)} held")
                )
                return True
            src = held[pull.first_block : end]
            nbytes = self.regions.nbytes(len(src))
            wire.send_frame(conn, wire.Reply(wire.OK, nbytes=nbytes))
            if pull.transport == "mooncake":
                assert self.mooncake is not None and pull.mooncake_endpoint and pull.dst_bases is not None
                time.sleep(self.stall_s)
                try:
                    self.mooncake.write(
                        pull.mooncake_endpoint, *self.regions.mooncake_batch(src, pull.dst_block_ids, pull.dst_bases)
                    )
                except (RuntimeError, ValueError) as e:
                    wire.send_frame(conn, wire.Done(False, str(e)))
                    return True
                wire.send_frame(conn, wire.Done(True))
            else:
                views = self.regions.send_views(src, pull.dst_block_ids)
                if self.stall_s:
                    half = len(views) // 2
                    send_all(conn, views[:half])
                    time.sleep(self.stall_s)
                    views = views[half:]
                send_all(conn, views)
            self.bytes_sent += nbytes
            ok = True
            return True
        except OSError as e:
            logger.warning("push of request %s failed: %s", pull.request_id, e)
            return False
        finally:
            # The blocks are no longer read (sent, or the reader is gone): the lease ends either way.
            self.leases.sent(pull.request_id, ok)

    def stop(self) -> None:
        self._stopped.set()
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()

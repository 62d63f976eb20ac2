"""The indexer: a thread of the router that subscribes to every instance's KV events (ZMQ SUB, the wire of
engine/kv_events_publisher.py) and applies them to the global prefix index (router/index.py).

Each instance's batches carry sequence numbers. On watch, an instance with a replay socket is asked for every
batch it still holds, so that a router started beside warm instances knows what they stored before it came (the
SUB socket's copies of those batches are then skipped). A gap (the PUB socket dropped messages) is filled from the
replay socket too; otherwise, and when the number goes back (the instance restarted), the instance's entries are
dropped, since some of them may be wrong, and rebuilt from the events that follow. An index that cannot be
written marks every instance stale; once it can be written again their entries are dropped and rebuilt the same
way. An instance that leaves the rotation is forgotten. All of this keeps
the index a hint that is either right or missing, never a cause of a failed request.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field

import msgspec
import zmq

from kvserve.core.kv_events import batch_from_wire
from kvserve.router.index import IndexWriter

logger = logging.getLogger(__name__)

_END = -1
_RETRY_S = 2.0  # how often an unreachable index is tried again


@dataclass
class _Source:
    instance: str
    endpoint: str
    replay_endpoint: str | None
    socket: zmq.Socket
    last_seq: int | None = None
    # After the catch-up replay on watch: the SUB socket's batches up to this one were applied from the replay.
    replayed_to: int | None = None


@dataclass
class IndexerStats:
    batches: int = 0
    gaps: int = 0
    replays: int = 0
    resyncs: int = 0
    write_errors: int = 0
    dropped_batches: int = 0  # while the index was unreachable
    instances: list[str] = field(default_factory=list)


class Indexer:
    def __init__(self, writer: IndexWriter, topic: str = "kv-events") -> None:
        self.writer = writer
        self.topic = topic.encode()
        self.stats = IndexerStats()
        self._ctx = zmq.Context()
        self._commands: queue.Queue = queue.Queue()
        self._sources: dict[str, _Source] = {}
        self._stale: set[str] = set()  # instances whose entries must be dropped once the index answers
        self._index_down_until = 0.0  # while unreachable: batches are dropped until then, then it is tried again
        self._decoder = msgspec.msgpack.Decoder()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-indexer", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ from the router's thread

    def watch(self, instance: str, endpoint: str, replay_endpoint: str | None = None) -> None:
        self._commands.put(("watch", instance, endpoint, replay_endpoint))

    def forget(self, instance: str) -> None:
        self._commands.put(("forget", instance, None, None))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        for source in self._sources.values():
            source.socket.close(linger=0)
        self._ctx.term()
        self.writer.close()

    # ------------------------------------------------------------------ the thread

    def _run(self) -> None:
        poller = zmq.Poller()
        while not self._stop.is_set():
            self._take_commands(poller)
            self._retry_stale()
            for sock, _ in poller.poll(100):
                source = next((s for s in self._sources.values() if s.socket is sock), None)
                if source is not None:
                    self._drain(source)

    def _take_commands(self, poller: zmq.Poller) -> None:
        while True:
            try:
                command, instance, endpoint, replay = self._commands.get_nowait()
            except queue.Empty:
                return
            old = self._sources.pop(instance, None)
            if old is not None:
                poller.unregister(old.socket)
                old.socket.close(linger=0)
            self._resync(instance)  # its entries may be stale: dropped, rebuilt from its events
            if command == "watch":
                sock = self._ctx.socket(zmq.SUB)
                sock.setsockopt(zmq.SUBSCRIBE, self.topic)
                sock.setsockopt(zmq.RCVHWM, 100_000)
                sock.connect(endpoint)
                source = _Source(instance, endpoint, replay, sock)
                self._sources[instance] = source
                poller.register(sock, zmq.POLLIN)
                logger.info("indexing KV events of %s from %s", instance, endpoint)
                self._catch_up(source)
            self.stats.instances = sorted(self._sources)

    def _drain(self, source: _Source) -> None:
        while True:
            try:
                _, seq_bytes, payload = source.socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            except ValueError:
                continue
            seq = int.from_bytes(seq_bytes, "big")
            if source.replayed_to is not None:
                if seq <= source.replayed_to:
                    continue  # applied from the catch-up replay already
                source.replayed_to = None
            last = source.last_seq
            if last is not None and seq <= last:
                logger.info(
                    "instance %s restarted (event %d after %d): resyncing its index entries", source.instance, seq, last
                )
                self._resync(source.instance)
            elif last is not None and seq > last + 1:
                self.stats.gaps += 1
                if not self._replay(source, last + 1, seq):
                    self._resync(source.instance)
            source.last_seq = seq
            self._apply(source.instance, payload)

    def _apply(self, instance: str, payload: bytes) -> None:
        if self._stale:
            self.stats.dropped_batches += 1  # the index is (or was) down: rebuilt from later events
            return
        try:
            batch = batch_from_wire(self._decoder.decode(payload))
        except (msgspec.DecodeError, TypeError, ValueError) as e:
            logger.warning("bad KV event batch from %s: %s", instance, e)
            return
        try:
            self.writer.apply(instance, batch)
            self.stats.batches += 1
        except self.writer.errors as e:
            self.stats.write_errors += 1
            logger.warning("prefix index unreachable (%s): its entries will be dropped and rebuilt", e)
            self._stale.update(self._sources)
            self._index_down_until = time.monotonic() + _RETRY_S

    def _catch_up(self, source: _Source) -> None:
        """Apply every batch a newly watched instance still holds (its replay buffer, oldest first). Batches it
        dropped from the buffer are missing from the index, never wrong there: a block's removal comes after its
        store."""
        if source.replay_endpoint and self._replay(source, 0, None):
            source.replayed_to = source.last_seq

    def _replay(self, source: _Source, start: int, stop: int | None) -> bool:
        """Fetch batches [start, stop) from the instance's replay socket and apply them; False if it cannot.
        `stop` None (the catch-up): from the oldest batch it holds at or after `start` to its newest, each
        recorded as the last seen."""
        if not source.replay_endpoint:
            return False
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVTIMEO, 1000)
        try:
            sock.connect(source.replay_endpoint)
            sock.send_multipart([b"", start.to_bytes(8, "big", signed=True)])
            expected = start
            while True:
                _, seq_bytes, payload = sock.recv_multipart()
                seq = int.from_bytes(seq_bytes, "big", signed=True)
                if seq == _END:
                    return stop is None or expected >= stop
                if stop is None:
                    self._apply(source.instance, payload)
                    source.last_seq = seq
                    expected = seq + 1
                    continue
                if seq != expected:
                    return False  # the instance no longer has them
                if seq < stop:
                    self._apply(source.instance, payload)
                expected += 1
        except (zmq.ZMQError, ValueError):
            return False
        finally:
            self.stats.replays += 1
            sock.close(linger=0)

    def _resync(self, instance: str) -> None:
        self.stats.resyncs += 1
        if time.monotonic() < self._index_down_until:
            self._stale.add(instance)
            return
        try:
            self.writer.clear(instance)
            self._stale.discard(instance)
        except self.writer.errors:
            self._stale.add(instance)
            self._index_down_until = time.monotonic() + _RETRY_S

    def _retry_stale(self) -> None:
        if self._stale and time.monotonic() >= self._index_down_until:
            for instance in list(self._stale):
                self._resync(instance)

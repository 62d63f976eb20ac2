"""The engine-core process's KV event publisher (vLLM's ZMQ wire): after each step's events are drained
(`EngineCore.take_kv_events`), one multipart message per batch on a PUB socket:

    [topic, sequence number (8 bytes, big-endian), msgpack(batch)]      (core/kv_events.py: batch_to_wire)

Sequence numbers start at 0 with each engine start, so a subscriber sees a gap (missed messages: PUB drops for
slow or late subscribers) or a restart (the number goes back). With `replay_endpoint`, a ROUTER socket answers a
request [8-byte start sequence] with every buffered batch from there, each [seq, payload], then [-1]; the last
`buffer_steps` batches are kept. The "null" publisher drops everything (the events are still collected).
"""

from __future__ import annotations

import collections
import logging

import msgspec
import zmq

from kvserve.config import KVEventsConfig
from kvserve.core.kv_events import KVEventBatch, batch_to_wire

logger = logging.getLogger(__name__)

END = (-1).to_bytes(8, "big", signed=True)


class KVEventPublisher:
    def __init__(self, config: KVEventsConfig) -> None:
        self.config = config
        self.topic = config.topic.encode()
        self.seq = 0
        self._buffer: collections.deque[tuple[int, bytes]] = collections.deque(maxlen=max(1, config.buffer_steps))
        self._encoder = msgspec.msgpack.Encoder()
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.setsockopt(zmq.SNDHWM, 100_000)
        self._pub.bind(config.endpoint)
        self._replay = None
        if config.replay_endpoint:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.LINGER, 0)
            self._replay.bind(config.replay_endpoint)
        logger.info("publishing KV events on %s (replay: %s)", config.endpoint, config.replay_endpoint)

    def publish(self, batch: KVEventBatch) -> None:
        payload = self._encoder.encode(batch_to_wire(batch))
        seq = self.seq
        self.seq += 1
        self._buffer.append((seq, payload))
        try:
            self._pub.send_multipart([self.topic, seq.to_bytes(8, "big"), payload], zmq.NOBLOCK)
        except zmq.Again:
            pass  # no room: subscribers see the gap and ask for a replay

    def serve_replays(self) -> None:
        """Answer the replay requests waiting now (never blocks)."""
        if self._replay is None:
            return
        while True:
            try:
                identity, _, start = self._replay.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            except ValueError:
                continue  # malformed request
            first = int.from_bytes(start, "big", signed=True)
            for seq, payload in self._buffer:
                if seq >= first:
                    self._replay.send_multipart([identity, b"", seq.to_bytes(8, "big"), payload])
            self._replay.send_multipart([identity, b"", END, b""])

    def close(self) -> None:
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
        self._ctx.term()


def make_publisher(config: KVEventsConfig | None) -> KVEventPublisher | None:
    if config is None or config.publisher == "null":
        return None
    return KVEventPublisher(config)

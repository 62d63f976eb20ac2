"""The router's indexer against a real KV event publisher (ZMQ on loopback), with a writer that records what it
is given: a router that starts after an instance has stored blocks still indexes them, once each, and the batches
after keep their order."""

from __future__ import annotations

import threading
import time

from kvserve.config import KVEventsConfig
from kvserve.core.kv_events import BlockStored, KVEventBatch
from kvserve.engine.kv_events_publisher import KVEventPublisher
from kvserve.process_utils import free_port
from kvserve.router.indexer import Indexer


class RecordingWriter:
    errors = (OSError,)

    def __init__(self) -> None:
        self.applied: list[tuple[str, int]] = []  # (instance, the batch's marker token)
        self.cleared: list[str] = []

    def apply(self, instance: str, batch: KVEventBatch) -> None:
        self.applied.append((instance, batch.events[0].token_ids[0]))

    def clear(self, instance: str, media=()) -> None:
        self.cleared.append(instance)

    def close(self) -> None:
        pass


def batch(marker: int) -> KVEventBatch:
    return KVEventBatch(ts=0.0, events=[BlockStored([marker.to_bytes(8, "big")], None, [marker] * 4, 4)])


def wait_for(cond, timeout: float = 10.0) -> None:
    deadline = time.time() + timeout
    while not cond() and time.time() < deadline:
        time.sleep(0.02)
    assert cond()


def test_a_late_router_indexes_what_the_instance_stored_before_it_once_and_in_order():
    config = KVEventsConfig(endpoint=f"tcp://127.0.0.1:{free_port()}", replay_endpoint=f"tcp://127.0.0.1:{free_port()}")
    publisher = KVEventPublisher(config)
    lock, stop = threading.Lock(), threading.Event()

    def engine_loop() -> None:  # the engine core answers replays once per loop turn
        while not stop.is_set():
            with lock:
                publisher.serve_replays()
            time.sleep(0.01)

    loop = threading.Thread(target=engine_loop, daemon=True)
    loop.start()
    writer = RecordingWriter()
    indexer = None
    try:
        for marker in range(5):  # stored before any router exists: no subscriber sees these
            with lock:
                publisher.publish(batch(marker))
        indexer = Indexer(writer)
        indexer.watch("a", config.endpoint, config.replay_endpoint)
        wait_for(lambda: len(writer.applied) >= 5)
        # The SUB socket joins at its own pace (a batch it missed is a gap, filled from the replay socket): keep
        # publishing until every batch so far is applied, 10 at least.
        marker = 5
        while marker < 200:
            with lock:
                publisher.publish(batch(marker))
            marker += 1
            time.sleep(0.02)
            if marker >= 10 and len(writer.applied) == marker:
                break
        assert writer.applied == [("a", m) for m in range(marker)]
        assert writer.cleared == ["a"]  # the watch's own reset, no resync after it
    finally:
        stop.set()
        loop.join()
        if indexer is not None:
            indexer.close()
        publisher.close()


def test_without_a_replay_socket_only_what_comes_after_the_subscription_is_indexed():
    config = KVEventsConfig(endpoint=f"tcp://127.0.0.1:{free_port()}")
    publisher = KVEventPublisher(config)
    writer = RecordingWriter()
    indexer = Indexer(writer)
    try:
        publisher.publish(batch(0))
        indexer.watch("a", config.endpoint)
        marker = 1
        while not writer.applied and marker < 200:
            publisher.publish(batch(marker))
            marker += 1
            time.sleep(0.02)
        assert writer.applied and ("a", 0) not in writer.applied
    finally:
        indexer.close()
        publisher.close()

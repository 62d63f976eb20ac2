"""The engine core in its own process: a busy loop of (drain inputs, step, send outputs) over ZMQ.

New requests and aborts are read between steps, so they reach the core while it is generating; outputs go back
after every step. The process exits on a Shutdown message, when its parent dies, or when the frontend's
sockets go away; it never outlives the server.
"""

from __future__ import annotations

import gc
import logging
import os
import signal
import sys

import zmq

from kvserve.config import EngineConfig
from kvserve.engine.kv_events_publisher import make_publisher
from kvserve.engine.messages import (
    AbortRequests,
    AddRequest,
    CoreError,
    CoreOutputs,
    Ready,
    Shutdown,
    encoder,
    to_core_decoder,
)
from kvserve.executor.base import WorkerFailedError
from kvserve.process_utils import die_with_parent

logger = logging.getLogger(__name__)

_IDLE_POLL_MS = 500  # how often an idle core checks that its parent is still alive


def run_engine_core(
    config: EngineConfig, input_addr: str, output_addr: str, log_level: int, startup_log_level: int = logging.INFO
) -> None:
    """Process entry point (spawned by the frontend's client). The log levels are the frontend's: kvserve's, and
    that of the one-line platform summary, which the CLI shows even when the rest is quiet."""
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s engine-core %(name)s: %(message)s")
    logging.getLogger("kvserve.startup").setLevel(startup_log_level)
    die_with_parent()
    parent = os.getppid()
    # SIGTERM (from the frontend or the death signal) ends the loop through SystemExit; SIGINT is the frontend's.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    signal.signal(signal.SIGINT, signal.SIG_IGN)

    ctx = zmq.Context()
    inputs = ctx.socket(zmq.PULL)
    inputs.connect(input_addr)
    outputs = ctx.socket(zmq.PUSH)
    outputs.setsockopt(zmq.LINGER, 0)
    outputs.connect(output_addr)
    core = None
    publisher = None
    try:
        from kvserve.engine.core import EngineCore

        core = EngineCore(config)
        publisher = make_publisher(config.kv_events)
        # The objects of start-up (model, modules, tokenizer) live as long as the process: out of the collector's
        # way, so that a full collection in the middle of serving walks only what the steps allocate.
        gc.collect()
        gc.freeze()
        outputs.send(encoder.encode(Ready(core.num_blocks, core.max_tokens_per_request)))
        _busy_loop(core, inputs, outputs, parent, publisher)
    except WorkerFailedError as e:
        # The frontend sees this process exit and fails every pending request; the log says why.
        logger.error("engine core stops: %s", e)
        raise SystemExit(1) from None
    finally:
        if publisher is not None:
            publisher.close()
        if core is not None:
            core.shutdown()
        inputs.close(linger=0)
        outputs.close(linger=0)
        ctx.term()


def _busy_loop(core, inputs: zmq.Socket, outputs: zmq.Socket, parent: int, publisher=None) -> None:
    poller = zmq.Poller()
    poller.register(inputs, zmq.POLLIN)
    while True:
        handled_input = False
        timeout = 0 if core.has_unfinished_requests() else _IDLE_POLL_MS
        while poller.poll(timeout):
            msg = to_core_decoder.decode(inputs.recv())
            handled_input = True
            timeout = 0
            if isinstance(msg, AddRequest):
                try:
                    core.add_request(msg.request)
                except ValueError as e:  # the frontend validates first; this is a last line of defence
                    outputs.send(encoder.encode(CoreError(msg.request.request_id, str(e))))
            elif isinstance(msg, AbortRequests):
                core.abort_requests(msg.request_ids)
            elif isinstance(msg, Shutdown):
                return
        if os.getppid() != parent:
            logger.warning("frontend process is gone; engine core exits")
            return
        if not handled_input and not core.has_unfinished_requests():
            core.check_health()  # an idle engine notices a dead worker too (it raises, ending this process)
        busy = core.has_unfinished_requests()
        step_outputs = core.step() if busy else []
        # Report the state after the step that went idle too: the steps that end a connector's work (a delayed
        # save, a transfer lease) free blocks without producing outputs, and /metrics must not keep the old usage.
        went_idle = busy and not core.has_unfinished_requests()
        if step_outputs or handled_input or went_idle:
            outputs.send(encoder.encode(CoreOutputs(step_outputs, core.make_stats())))
        # Drained every step even without a publisher ("null"): nothing piles up in the block pool.
        batch = core.take_kv_events()
        if publisher is not None:
            if batch is not None:
                publisher.publish(batch)
            publisher.serve_replays()

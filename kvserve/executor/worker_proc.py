"""A worker process of the mp executor: one Worker, a loop of (receive a step or call, run it, answer).

Rank r reads its own PULL socket and answers on the executor's PULL socket as (rank, OK/ERR, payload). Steps are
answered by the driver only (the other ranks' outputs are the same), unless they fail. The process dies with its
parent (the engine core), exits on STOP or SIGTERM, and ignores SIGINT (the frontend's).
"""

from __future__ import annotations

import logging
import os
import pickle
import signal
import sys
import traceback

import zmq

from kvserve.config import EngineConfig
from kvserve.executor import wire
from kvserve.process_utils import die_with_parent
from kvserve.threads import ThreadPlan


def run_worker(
    config: EngineConfig, rank: int, thread_plan: ThreadPlan, in_addr: str, out_addr: str, log_level: int
) -> None:
    logging.basicConfig(level=log_level, format=f"%(asctime)s %(levelname)s worker-{rank} %(name)s: %(message)s")
    die_with_parent()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # All ranks are on this machine: gloo's connections stay on loopback (unless the user chose an interface).
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    from kvserve.worker.worker import Worker

    ctx = zmq.Context()
    inputs = ctx.socket(zmq.PULL)
    inputs.connect(in_addr)
    outputs = ctx.socket(zmq.PUSH)
    outputs.setsockopt(zmq.LINGER, 1000)
    outputs.connect(out_addr)
    worker = Worker(config, rank, thread_plan)
    me = str(rank).encode()
    try:
        while True:
            kind, payload = inputs.recv_multipart()
            if kind == wire.STOP:
                # Every rank got STOP: leave the process group cleanly (its threads abort the process otherwise).
                from kvserve.distributed.parallel_state import destroy_tensor_parallel

                destroy_tensor_parallel()
                return
            try:
                if kind == wire.STEP:
                    out = worker.execute_model(wire.step_decoder.decode(payload))
                    # The driver always answers; another rank only with its KV connector's report.
                    if rank == 0 or out is not None:
                        outputs.send_multipart([me, wire.OK, wire.encoder.encode(out)])
                else:
                    method, args = pickle.loads(payload)
                    result = getattr(worker, method)(*args)
                    outputs.send_multipart([me, wire.OK, pickle.dumps(result)])
            except Exception as e:
                logging.getLogger(__name__).error("worker %d failed:\n%s", rank, traceback.format_exc())
                outputs.send_multipart([me, wire.ERR, f"{type(e).__name__}: {e}".encode()])
    finally:
        worker.shutdown()
        inputs.close(linger=0)
        outputs.close()
        ctx.term()

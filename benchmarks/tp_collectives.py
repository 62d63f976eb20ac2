"""Latency of the tensor-parallel collectives between two local processes (one thread each, each on its own core
when there are two): gloo's all-reduce against the shared-memory one (kvserve/distributed/shm_comm.py), at the
sizes a SmolLM2-135M step sends (hidden 576; the LM head's half of a 49,152 vocabulary for the gather).

    python benchmarks/tp_collectives.py
"""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from kvserve.process_utils import free_port

HIDDEN = 576
VOCAB_HALF = 24576


def timed(fn, x: torch.Tensor, n: int) -> float:
    for _ in range(20):
        fn(x)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(n):
        fn(x)
    return (time.perf_counter() - start) / n


def run(rank: int, port: int) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)
    if len(os.sched_getaffinity(0)) >= 2:
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[rank]})
    from kvserve.distributed.parallel_state import TPGroup, init_tensor_parallel

    tp = init_tensor_parallel(rank, 2, f"tcp://127.0.0.1:{port}")
    assert tp.shm is not None
    gloo_tp = TPGroup(rank, 2)  # the same group without the shared segment
    cases = [
        ("all_reduce", (1, HIDDEN), 1000),
        ("all_reduce", (32, HIDDEN), 1000),
        ("all_reduce", (256, HIDDEN), 300),
        ("all_gather", (1, VOCAB_HALF), 300),
        ("all_gather", (32, VOCAB_HALF), 100),
    ]
    for op, shape, n in cases:
        x = torch.randn(shape)
        if op == "all_reduce":
            gloo = timed(gloo_tp.all_reduce, x, min(n, 300))
            shm = timed(tp.all_reduce, x, n)
        else:
            gloo = timed(gloo_tp.all_gather, x, min(n, 100))
            shm = timed(tp.all_gather, x, n)
        if rank == 0:
            print(f"{op} {list(shape)} fp32: gloo {gloo * 1e6:8.1f} us   shm {shm * 1e6:7.1f} us", flush=True)


if __name__ == "__main__":
    mp.spawn(run, args=(free_port(),), nprocs=2)

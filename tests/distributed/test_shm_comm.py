"""The shared-memory collectives between two real processes: exact sums and gathers, bitwise the same on every
rank, many collectives in a row (the double buffers), the gloo fallback for tensors beyond the buffers, no file
left in /dev/shm, and a peer that never arrives ending in TimeoutError rather than a hang."""

from __future__ import annotations

import glob
import multiprocessing
import traceback

import pytest
import torch

from kvserve.distributed import shm_comm
from kvserve.process_utils import free_port

WORLD = 2
BUFFER_BYTES = 4096  # small, so that the fallback path is cheap to reach


def inputs(rank: int, step: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(shape, generator=g).to(dtype)


def collectives(rank: int) -> None:
    from kvserve.distributed.parallel_state import get_tp_group

    tp = get_tp_group()
    assert tp.shm is not None, "two local ranks should share memory"
    shapes = [(1, 8), (3, 40), (1, 1024), (2, 1000)]  # the last (8000 bytes) is beyond the buffer: gloo
    for step in range(60):
        shape = shapes[step % len(shapes)]
        dtype = torch.bfloat16 if step % 5 == 0 else torch.float32
        parts = [inputs(r, step, shape, dtype) for r in range(WORLD)]
        got = tp.all_reduce(parts[rank].clone())
        assert torch.equal(got, parts[0] + parts[1]), (step, shape)
        gathered = tp.all_gather(parts[rank], dim=-1)
        assert torch.equal(gathered, torch.cat(parts, dim=-1)), (step, shape)
        # Every rank holds bitwise the same sum: exchange it and compare.
        both = tp.all_gather(got.reshape(1, -1), dim=0)
        assert torch.equal(both[0], both[1]), step


def late_peer(rank: int) -> None:
    from kvserve.distributed.parallel_state import get_tp_group

    tp = get_tp_group()
    tp.shm.timeout_s = 0.5  # the process group's own timeout stays long enough for the rendezvous
    if rank == 0:
        with pytest.raises(TimeoutError, match=r"rank\(s\) \[1\] did not reach collective 1"):
            tp.all_reduce(torch.ones(4))


def run_rank(rank: int, port: int, scenario: str, errors) -> None:
    try:
        import os

        os.environ["GLOO_SOCKET_IFNAME"] = "lo"
        torch.set_num_threads(1)
        from kvserve.distributed.parallel_state import destroy_tensor_parallel, init_tensor_parallel

        init_tensor_parallel(rank, WORLD, f"tcp://127.0.0.1:{port}", timeout_s=60.0, shm_buffer_bytes=BUFFER_BYTES)
        {"collectives": collectives, "late_peer": late_peer}[scenario](rank)
        if scenario == "collectives":
            destroy_tensor_parallel()
        else:
            # The group is left half-used on purpose; tearing it down at interpreter exit can abort in gloo's
            # threads ("terminate called without an active exception"), which is not what this test checks.
            os._exit(0)
    except BaseException:
        errors.put(f"rank {rank}:\n{traceback.format_exc()}")


def spawn(scenario: str) -> None:
    ctx = multiprocessing.get_context("spawn")
    errors = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=run_rank, args=(r, port, scenario, errors)) for r in range(WORLD)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    failures = []
    while not errors.empty():
        failures.append(errors.get())
    assert not failures, "\n".join(failures)
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]


pytestmark = pytest.mark.skipif(not shm_comm.supported(), reason="shared-memory collectives are x86-only")


def test_shm_collectives_exact_and_identical_on_every_rank():
    before = set(glob.glob("/dev/shm/kvserve-tp-*"))
    spawn("collectives")
    assert set(glob.glob("/dev/shm/kvserve-tp-*")) <= before  # unlinked once mapped


def test_shm_wait_times_out_on_a_missing_peer():
    spawn("late_peer")

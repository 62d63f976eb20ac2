"""kvserve/host_memory.py: with the thresholds fixed, a step's transient buffers stop faulting in again."""

import json
import os
import platform
import subprocess
import sys

import pytest

from kvserve import host_memory

# A step's pattern in miniature: buffers of 1-24 MiB written and held until the step ends (a forward's
# activations, its logits), then all freed. Also how much of a fresh 24 MiB buffer glibc serves with mmap (mallinfo2's
# hblkhd): a process starts with a 128 KiB mmap threshold, so without the fix its first such buffer is always mmapped.
_LOOP = r"""
import ctypes, json, resource, sys
import torch
from kvserve.host_memory import keep_freed_memory
kept = keep_freed_memory() if sys.argv[1] == "keep" else False

class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
                                               "uordblks", "fordblks", "keepcost")]
mallinfo2 = ctypes.CDLL(None).mallinfo2
mallinfo2.restype = MallInfo2
mapped = mallinfo2().hblkhd
probe = torch.empty(24 << 20, dtype=torch.uint8)
mapped = mallinfo2().hblkhd - mapped
del probe
sizes = [(7 * i * i + 3 * i) % 24 + 1 for i in range(12)]
def step():
    live = []
    for mib in sizes:
        t = torch.empty(mib << 20, dtype=torch.uint8)
        t.fill_(1)
        live.append(t)
for _ in range(3):
    step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    step()
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
print(json.dumps({"kept": kept, "mapped": mapped, "faults": faults, "pages": 10 * sum(sizes) * 256}))
"""


def _run(mode: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "LD_PRELOAD"}
    out = subprocess.run([sys.executable, "-c", _LOOP, mode], capture_output=True, text=True, env=env, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_fixed_thresholds_keep_freed_buffers():
    plain, kept = _run("off"), _run("keep")
    assert kept["kept"] and not plain["kept"]
    # The thresholds take effect: a 24 MiB buffer comes from the heap (kept at free), not from its own mapping.
    assert plain["mapped"] >= 24 << 20, plain
    assert kept["mapped"] == 0, kept
    # And the step pattern stops faulting its pages in again. (Under glibc's own thresholds it refaults most of
    # them in most processes, not in all: those thresholds move with what was freed before, so the plain run's
    # count is not asserted.)
    assert kept["faults"] < 0.01 * kept["pages"], kept


def test_user_settings_win(monkeypatch):
    monkeypatch.setattr(host_memory, "_done", None)
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "1")
    assert host_memory.keep_freed_memory() is False
    monkeypatch.setattr(host_memory, "_done", None)
    monkeypatch.delenv("MALLOC_TRIM_THRESHOLD_")
    monkeypatch.setenv("LD_PRELOAD", "/usr/lib/libtcmalloc_minimal.so.4")
    assert host_memory.keep_freed_memory() is False


def test_large_logits_reuse_one_buffer_and_small_ones_are_plain_copies():
    import torch

    convert = host_memory.LargeFloat32()
    rows = host_memory.MMAP_THRESHOLD // (4 * 1000) + 1  # just past the heap's limit in fp32
    big = torch.randn(rows + 10, 1000).to(torch.bfloat16)
    first = convert(big)
    assert first.dtype == torch.float32 and torch.equal(first, big.float())
    second = convert(big[:rows] * 2)  # fewer rows, still past the limit: the same memory
    assert second.data_ptr() == first.data_ptr() and torch.equal(second, (big[:rows] * 2).float())
    small = torch.randn(8, 1000).to(torch.bfloat16)
    a, b = convert(small), convert(small)
    assert a.data_ptr() != b.data_ptr() and torch.equal(a, small.float())  # below the threshold: fresh each time
    fp32 = torch.randn(rows, 1000)
    assert convert(fp32) is fp32

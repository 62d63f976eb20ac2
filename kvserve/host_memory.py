"""Keep freed host memory in the process instead of handing it back to the OS after every step.

glibc's malloc serves big requests with mmap and gives them back at free(), and trims the heap's top once it is
free past a threshold; both thresholds move with the sizes it has seen. A step allocates and frees the same tens of
megabytes each time (linear outputs, prompt chunks' activations, logits), so memory kept going back and the next
step faulted it in again page by page, zeroed by the kernel, inside the parallel kernels (measured, kind A, the fp32
offline benchmark run three times in one process: 40-460 thousand page faults a run and up to 1.4 s of system time;
with the thresholds fixed 0-34 thousand, none once warm).
vLLM's CPU backend gets the same from tcmalloc, which it asks users to preload; fixing glibc's two thresholds needs no
install. An allocator preloaded instead, or MALLOC_* variables set by the user, are left alone.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform

import torch

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1  # mallopt parameters (malloc.h)
_M_MMAP_THRESHOLD = -3
# Requests below this come from the heap: glibc's largest (HEAP_MAX_SIZE / 2 on 64-bit); above it (a big batch's
# logits) mmap stays, as one fault per page is small beside what such a request's computation costs.
MMAP_THRESHOLD = 32 << 20
# Free memory at the heap's top kept before trimming: several steps' worth of the transient buffers.
TRIM_THRESHOLD = 256 << 20
_USER_VARS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_")

_done: bool | None = None


def keep_freed_memory() -> bool:
    """Fix glibc malloc's mmap and trim thresholds for this process (once; later calls return the first answer).
    Returns whether they were set: False on another libc, under a preloaded allocator or where the user set them."""
    global _done
    if _done is not None:
        return _done
    _done = False
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    if any(var in os.environ for var in _USER_VARS) or any(
        "malloc" in os.environ.get(var, "") for var in ("LD_PRELOAD", "GLIBC_TUNABLES")
    ):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    _done = mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    if not _done:
        logger.info("glibc mallopt refused the mmap/trim thresholds: freed memory goes back to the OS")
    return _done


class LargeFloat32:
    """The fp32 copy of a bf16/fp16 CPU tensor too big for the heap (>= MMAP_THRESHOLD), written into one buffer
    kept across calls instead of a fresh mapping each time. A big batch's logits are the case: at batch 64 with
    four drafts each, 320 rows x 49k vocabulary are 63 MB a step, and faulting them in took 7x the conversion
    itself (kind A, bf16, n-gram at batch 64: 184 ms of a 3.9 s run against 25 ms). The result is overwritten by
    the next call on the same instance: it must not be kept across calls (a step's logits are not)."""

    def __init__(self) -> None:
        self._buffer: torch.Tensor | None = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 or x.device.type != "cpu" or x.numel() * 4 < MMAP_THRESHOLD:
            return x.float()
        if self._buffer is None or self._buffer.numel() < x.numel():
            self._buffer = torch.empty(x.numel(), dtype=torch.float32)
        out = self._buffer[: x.numel()].view(x.shape)
        out.copy_(x)
        return out

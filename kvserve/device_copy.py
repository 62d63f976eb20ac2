"""Host-to-device copies that never wait for the device.

A copy from pageable host memory may first wait for the work already queued on the stream (CUDA stages pageable
memory through a pinned buffer and "may synchronize with the stream" to do so); with async scheduling that is
the whole step in flight, and even in the synchronous loop it keeps the host from queueing the next kernels
while the GPU runs. Staging in pinned memory (torch's caching host allocator, which keeps a pinned block out of
reuse until the copy that reads it is done) makes every such copy asynchronous.
"""

from __future__ import annotations

import numpy as np
import torch


def to_device(t: torch.Tensor | np.ndarray, device: torch.device | str) -> torch.Tensor:
    """A host tensor (or numpy array) on `device`, without waiting for the device: the copy is queued on the
    current stream. The source may be freed or reused as soon as this returns. On the CPU, the same memory."""
    if isinstance(t, np.ndarray):
        t = torch.from_numpy(t)
    device = torch.device(device)
    if device.type != "cuda" or t.device.type != "cpu":
        return t.to(device, non_blocking=True)
    if not t.is_pinned():
        t = t.pin_memory()
    return t.to(device, non_blocking=True)

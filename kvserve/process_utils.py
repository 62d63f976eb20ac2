"""Process and socket helpers shared by the engine-core process, the executors' workers and the KV transfer
side channels (pure Python, no torch)."""

from __future__ import annotations

import ctypes
import signal
import socket


def die_with_parent() -> None:
    """Ask Linux to SIGTERM this process when its parent dies (no orphans even if the parent is SIGKILLed)."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, signal.SIGTERM)
    except OSError:
        pass


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` now (for a rendezvous or a side channel; another process may take it before it
    is bound again, so callers retry or bind it themselves where they can)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]

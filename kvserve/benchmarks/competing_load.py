"""A competing load for benchmarks: K processes that keep one CPU busy each, as on a laptop or a shared server.

Each is a plain Python loop in its own process, unpinned, so the OS schedules it among kvserve's threads the way it
would any other program. Pure Python (no torch): the serving suite starts it beside any server.
"""

from __future__ import annotations

import subprocess
import sys
import time

# Spins until its parent is gone, so that a benchmark killed mid-run leaves no busy process behind.
_BUSY = "import os\nparent = os.getppid()\nwhile os.getppid() == parent:\n    for _ in range(100_000): pass"


class CompetingLoad:
    """`with CompetingLoad(k):` runs k busy processes for the duration of the block (k = 0: nothing)."""

    def __init__(self, num_procs: int) -> None:
        if num_procs < 0:
            raise ValueError(f"competing load must be >= 0 busy processes, got {num_procs}")
        self.num_procs = num_procs
        self._procs: list[subprocess.Popen] = []

    def __enter__(self) -> CompetingLoad:
        self._procs = [subprocess.Popen([sys.executable, "-c", _BUSY]) for _ in range(self.num_procs)]
        if self._procs:
            time.sleep(0.5)  # let them start spinning before the timing does
        return self

    def __exit__(self, *exc) -> None:
        for p in self._procs:
            p.kill()
        for p in self._procs:
            p.wait()
        self._procs = []

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]

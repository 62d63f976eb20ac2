"""Cheap wall-clock accounting of where a step's time goes (a few perf_counter calls per step)."""

from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager


class StepTimer:
    """Accumulates seconds per named phase; `enabled=False` makes `phase` a no-op context."""

    def __init__(self, enabled: bool = False) -> None:
        self.enabled = enabled
        self.seconds: dict[str, float] = defaultdict(float)
        self.steps = 0

    @contextmanager
    def phase(self, name: str):
        if not self.enabled:
            yield
            return
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] += time.perf_counter() - start

    def reset(self) -> None:
        self.seconds.clear()
        self.steps = 0

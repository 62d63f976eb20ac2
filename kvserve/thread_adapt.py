"""Run-time thread count: fewer compute threads while other processes take the CPUs the engine computes on, all of
them again when the competition leaves.

Pure Python (no torch), so the rule is tested on made-up /proc samples. A step waits for its slowest OpenMP thread:
with as many threads as CPUs and another busy process beside them, one thread is always waiting for the CPU and every
parallel region stalls for a scheduler time slice. With one thread fewer than the CPUs taken, nobody waits, and
libgomp's spin waiting (fast on an idle machine, see kvserve/threads.py) stays the default.

What others take is measured, not guessed: over a window of INTERVAL_S, the busy time of the CPUs this process may
use (/proc/stat: user, nice, system, irq, softirq and steal, which the hypervisor gave to another guest) minus this
process's own CPU time. That holds whatever the thread count is now, so the count can go down and come back up.
The rule (decide) keeps a CPU for the engine while at least 60% of it is free, gives it back when others take more,
and takes it again only when they leave at least three quarters of it: the gap between the two keeps the count from
flapping on a load near a threshold, and CONFIRM windows in a row must agree before it changes.

Sampling costs one read of /proc/stat per window, made from the engine's step (EngineCore.step), never per op.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass

logger = logging.getLogger(__name__)

INTERVAL_S = 0.5  # one sample per window; a step that comes sooner does nothing but compare the clock
CONFIRM = 2  # windows in a row that must call for the same change before the count moves
STALE_S = 2.0  # a longer window (the engine sat idle between steps) is not judged: it starts a new one
# A thread goes when other processes take more than 1 - KEEP_FREE of a CPU, and comes back once they leave at least
# TAKE_FREE of one. Beside two spinning threads a busy process gets only 0.5-0.7 of a CPU (it would take a whole
# one if let), while an idle server's own frontend and clients take ~0.1 (docs/benchmarks.md, issue 16).
KEEP_FREE = 0.6
TAKE_FREE = 0.75

# /proc/stat per-CPU columns: user nice system idle iowait irq softirq steal (guest time is inside user and nice).
_BUSY_COLUMNS = (0, 1, 2, 5, 6, 7)


@dataclass(frozen=True)
class CpuSample:
    wall_s: float  # monotonic clock
    busy_ticks: int  # busy time of the watched CPUs, in /proc/stat clock ticks (steal included)
    own_cpu_s: float  # this process's CPU time, all threads


def busy_ticks(proc_stat: str, cpus: Collection[int]) -> int | None:
    """Busy ticks of `cpus` from /proc/stat text, or None if it lists none of them."""
    total, found = 0, False
    wanted = set(cpus)
    for line in proc_stat.splitlines():
        name, _, rest = line.partition(" ")
        if not name.startswith("cpu") or name == "cpu" or int(name[3:]) not in wanted:
            continue
        columns = [int(v) for v in rest.split()]
        total += sum(columns[i] for i in _BUSY_COLUMNS if i < len(columns))
        found = True
    return total if found else None


def others_cpus(prev: CpuSample, cur: CpuSample, ticks_per_s: float) -> float:
    """CPUs' worth of the watched CPUs that other processes (and the hypervisor) took between two samples."""
    seconds = cur.wall_s - prev.wall_s
    if seconds <= 0:
        return 0.0
    busy_s = (cur.busy_ticks - prev.busy_ticks) / ticks_per_s
    return max(0.0, (busy_s - (cur.own_cpu_s - prev.own_cpu_s)) / seconds)


def decide(num_threads: int, others: float, num_cpus: int, max_threads: int) -> int:
    """The thread count for the next window, given what others took of `num_cpus` CPUs in the last one."""
    free = num_cpus - others
    keep = min(max_threads, max(1, math.ceil(free - KEEP_FREE - 1e-9)))  # CPUs at least 60% free
    take = min(max_threads, max(1, math.floor(free + (1 - TAKE_FREE) + 1e-9)))  # CPUs at least 75% free
    if keep < num_threads:
        return keep
    if take > num_threads:
        return take
    return num_threads


def _read_proc_stat() -> str:
    with open("/proc/stat") as f:
        return f.read()


class ThreadAdapter:
    """Call poll() once per engine step; it returns a new thread count when the engine should change to it, else
    None. It starts at `max_threads` (the plan's count) and never goes above it or below one.

    The readers are parameters so that tests replay made-up samples: `read_stat` returns /proc/stat text, `clock`
    a monotonic time in seconds, `own_cpu` this process's CPU seconds."""

    def __init__(
        self,
        cpus: Collection[int],
        max_threads: int,
        *,
        read_stat: Callable[[], str] = _read_proc_stat,
        clock: Callable[[], float] = time.monotonic,
        own_cpu: Callable[[], float] = time.process_time,
        ticks_per_s: float | None = None,
    ) -> None:
        self.cpus = tuple(sorted(cpus))
        self.max_threads = max_threads
        self.num_threads = max_threads
        self.last_others = 0.0  # CPUs other processes took in the last judged window
        self._read_stat, self._clock, self._own_cpu = read_stat, clock, own_cpu
        self._ticks_per_s = ticks_per_s or float(os.sysconf("SC_CLK_TCK"))
        self._prev: CpuSample | None = None
        self._next_s = 0.0
        self._pending: int | None = None  # the count the last windows called for
        self._streak = 0
        self.enabled = True

    def _sample(self) -> CpuSample | None:
        try:
            ticks = busy_ticks(self._read_stat(), self.cpus)
        except (OSError, ValueError):
            ticks = None
        if ticks is None:
            # No /proc/stat (not Linux) or none of our CPUs in it: keep the plan's count for good.
            logger.info("thread adaptation off: cannot read the CPUs' busy time from /proc/stat")
            self.enabled = False
            return None
        return CpuSample(self._clock(), ticks, self._own_cpu())

    def poll(self) -> int | None:
        if not self.enabled:
            return None
        now = self._clock()
        if now < self._next_s:
            return None
        self._next_s = now + INTERVAL_S
        cur = self._sample()
        if cur is None:
            return None
        prev, self._prev = self._prev, cur
        if prev is None or cur.wall_s - prev.wall_s > STALE_S:
            self._pending, self._streak = None, 0
            return None
        others = others_cpus(prev, cur, self._ticks_per_s)
        self.last_others = others
        target = decide(self.num_threads, others, len(self.cpus), self.max_threads)
        logger.debug("others took %.2f CPUs; threads %d, this window calls for %d", others, self.num_threads, target)
        if target == self.num_threads:
            self._pending, self._streak = None, 0
            return None
        # Same direction as the windows before: confirmed once CONFIRM of them agree (the latest count wins).
        same_way = self._pending is not None and (self._pending < self.num_threads) == (target < self.num_threads)
        self._streak = self._streak + 1 if same_way else 1
        self._pending = target
        if self._streak < CONFIRM:
            return None
        logger.info(
            "compute threads %d -> %d: other processes took %.2f of the %d CPUs this engine may use",
            self.num_threads,
            target,
            others,
            len(self.cpus),
        )
        self.num_threads, self._pending, self._streak = target, None, 0
        return target

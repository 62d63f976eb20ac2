"""How many compute threads the engine runs, on which CPUs, and how idle threads wait: decided once, here.

Pure Python (no torch import), so the decision can reach a process before torch starts its thread pool there.

The threads are the CPUs this process may use, the smaller of its affinity mask (`taskset`, a cgroup cpuset) and
its cgroup CPU quota (`docker --cpus 1.5`: cgroup v2 `cpu.max`, v1 `cpu.cfs_quota_us`), rounded down, since a
thread beyond the quota only waits for the next quota period; less a reserve for the frontend's own work when
serving. An explicit count (`--num-threads`, else `KVSERVE_NUM_THREADS`) replaces the automatic one but may not
exceed the limit. torch's intra-op pool, oneDNN, MKL and kvserve's C++ kernels (at::parallel_for) all run on that
one OpenMP pool, so `torch.set_num_threads` and `OMP_NUM_THREADS` size all of them. An automatic count is a ceiling:
at run time the engine uses fewer threads while other processes take its CPUs (kvserve/thread_adapt.py).

How idle OpenMP threads wait is read by libgomp when torch loads it (`OMP_WAIT_POLICY`, `GOMP_SPINCOUNT`), so kvserve
would set a default in the environment first (DEFAULT_WAIT_ENV). It sets none: passive waiting keeps more throughput
than spinning threads beside a busy process, but on an idle machine it made decode slower (each of a step's hundreds
of parallel regions wakes sleeping threads; figures in docs/benchmarks.md, "Busy machines"). libgomp's own short spin
stays the default, and a busy machine is met by running fewer threads than cores taken (thread_adapt.py), which
leaves no spinning thread in another process's way; `OMP_WAIT_POLICY=PASSIVE`
remains an option for a fixed count (docs/benchmarks.md, "Busy machines"). Waiting variables set by the user are
passed on as they are.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass

DEFAULT_WAIT_ENV: dict[str, str] = {}  # libgomp's own default (see the module docstring)
_WAIT_VARS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
# Serving on this many CPUs or more leaves one to the frontend (HTTP, tokenizing, detokenizing, streaming). On
# fewer, the engine keeps them all: a thread less costs it far more than the frontend's share (docs/benchmarks.md).
RESERVE_MIN_CPUS = 4

CGROUP_ROOT = "/sys/fs/cgroup"
PROC_SELF_CGROUP = "/proc/self/cgroup"


@dataclass(frozen=True)
class ThreadPlan:
    """What the engine process runs with. Frozen and picklable: decided in the frontend, applied in the engine."""

    num_threads: int  # compute threads (torch, oneDNN, MKL, kvserve's kernels: one OpenMP pool)
    limit: int  # CPUs this process may use: min(affinity, cgroup quota), or the --cpu-bind list
    reserve: int  # CPUs left to the frontend (serving only)
    source: str  # "auto", "--num-threads" or "KVSERVE_NUM_THREADS"
    limit_reason: str  # where the limit comes from, for the messages: "affinity 8 CPUs, cgroup quota 1.5"
    cpu_bind: tuple[int, ...] | None = None  # OpenMP thread i pinned to cpu_bind[i]; None: the OS places them
    # Follow the CPUs other processes leave free at run time (kvserve/thread_adapt.py), between 1 and num_threads.
    # Only for an automatic, unbound count: an explicit count or a bind list is kept as given.
    adapt: bool = False

    def describe(self) -> str:
        bind = ",".join(map(str, self.cpu_bind)) if self.cpu_bind else "off"
        adapt = "on" if self.adapt else "off"
        return (
            f"{self.source}; {self.limit_reason}; reserve={self.reserve}; bind={bind}; adapt={adapt}; "
            f"omp_wait={describe_wait()}"
        )


def affinity_cpus() -> set[int]:
    """The CPUs this process may run on."""
    try:
        return set(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return set(range(os.cpu_count() or 1))


def cgroup_cpu_quota(root: str | None = None, self_cgroup: str | None = None) -> float | None:
    """The CPU quota of this process's cgroup in CPUs (1.5 = one and a half CPUs), or None when unlimited.

    Reads cgroup v2 (`cpu.max`) and v1 (`cpu.cfs_quota_us` / `cpu.cfs_period_us`) from this process's cgroup up to
    the root and takes the tightest. Inside a container the cgroup is usually mounted at its own root: that is
    looked at too."""
    root = root or CGROUP_ROOT
    try:
        with open(self_cgroup or PROC_SELF_CGROUP) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    quotas: list[float] = []
    for line in lines:
        _, controllers, path = line.split(":", 2) if line.count(":") >= 2 else ("", "", "")
        if controllers == "":  # cgroup v2
            for folder in _ancestors(root, path):
                quota = _read_v2(os.path.join(folder, "cpu.max"))
                if quota is not None:
                    quotas.append(quota)
        elif "cpu" in controllers.split(","):
            for mount in (controllers, "cpu", "cpu,cpuacct", "cpuacct,cpu"):
                for folder in _ancestors(os.path.join(root, mount), path):
                    quota = _read_v1(folder)
                    if quota is not None:
                        quotas.append(quota)
    return min(quotas) if quotas else None


def _ancestors(base: str, path: str) -> list[str]:
    parts = [p for p in path.strip("/").split("/") if p]
    return [os.path.join(base, *parts[:n]) for n in range(len(parts), -1, -1)]


def _read_v2(file: str) -> float | None:
    try:
        with open(file) as f:
            quota, period = (f.read().split() + ["100000"])[:2]  # "max 100000", "150000 100000"; period optional
        if quota == "max":
            return None
        quota_us, period_us = int(quota), int(period)
    except (OSError, ValueError):
        return None
    return quota_us / period_us if quota_us > 0 and period_us > 0 else None


def _read_v1(folder: str) -> float | None:
    try:
        with open(os.path.join(folder, "cpu.cfs_quota_us")) as f:
            quota = int(f.read())
        with open(os.path.join(folder, "cpu.cfs_period_us")) as f:
            period = int(f.read())
    except (OSError, ValueError):
        return None
    return quota / period if quota > 0 and period > 0 else None


def parse_cpu_list(text: str) -> tuple[int, ...]:
    """'0-3,6' -> (0, 1, 2, 3, 6), in the order given; a repeated CPU is an error."""
    cpus: list[int] = []
    for part in text.replace(" ", "").split(","):
        if not part:
            continue
        lo, sep, hi = part.partition("-")
        try:
            first, last = int(lo), int(hi) if sep else int(lo)
        except ValueError:
            raise ValueError(f"cpu_bind {text!r}: use a CPU list such as 0-3 or 0,2,4") from None
        if first < 0 or last < first:
            raise ValueError(f"cpu_bind {text!r}: bad range {part!r}")
        cpus.extend(range(first, last + 1))
    if not cpus:
        raise ValueError(f"cpu_bind {text!r}: no CPUs given")
    if len(set(cpus)) != len(cpus):
        raise ValueError(f"cpu_bind {text!r}: a CPU is listed twice")
    return tuple(cpus)


def plan_threads(num_threads: int | None = None, cpu_bind: str | None = None, serving: bool = False) -> ThreadPlan:
    """Decide the engine's threads. Raises ValueError, naming the limit, for a count < 1 or above the CPUs this
    process may use, and for a bind list with CPUs outside its affinity or a count that does not match it."""
    allowed = affinity_cpus()
    quota = cgroup_cpu_quota()
    source = "--num-threads"
    if num_threads is None and os.environ.get("KVSERVE_NUM_THREADS", "").strip():
        source, text = "KVSERVE_NUM_THREADS", os.environ["KVSERVE_NUM_THREADS"].strip()
        try:
            num_threads = int(text)
        except ValueError:
            raise ValueError(f"KVSERVE_NUM_THREADS={text!r} is not a whole number") from None

    bind = parse_cpu_list(cpu_bind) if cpu_bind else None
    if bind is not None:
        outside = sorted(set(bind) - allowed)
        if outside:
            raise ValueError(
                f"cpu_bind lists CPU(s) {','.join(map(str, outside))} this process may not use; it may use "
                f"{_cpu_list(allowed)}"
            )
        limit, reason = len(bind), f"bound to {len(bind)} CPUs"
    else:
        limit, reason = len(allowed), f"affinity {len(allowed)} CPUs"
    if quota is not None:
        reason += f", cgroup quota {quota:g} CPUs"
        limit = min(limit, max(1, math.floor(quota + 1e-6)))

    if num_threads is not None:
        name = "num_threads" if source == "--num-threads" else source
        if num_threads < 1:
            raise ValueError(f"{name} must be >= 1, got {num_threads} (this process may use {limit} CPUs: {reason})")
        if num_threads > limit:
            raise ValueError(
                f"{name}={num_threads} is more than the {limit} CPUs this process may use ({reason}); "
                f"use at most {limit}"
            )
        if bind is not None and num_threads != len(bind):
            raise ValueError(f"{name}={num_threads} does not match the {len(bind)} CPUs of cpu_bind")
        return ThreadPlan(num_threads, limit, max(0, limit - num_threads), source, reason, bind)
    # The frontend runs outside the bound CPUs, so binding needs no reserve.
    reserve = 1 if serving and bind is None and limit >= RESERVE_MIN_CPUS else 0
    adapt = bind is None and limit - reserve > 1
    return ThreadPlan(limit - reserve, limit, reserve, "auto", reason, bind, adapt)


def rank_thread_plan(plan: ThreadPlan, rank: int, world_size: int) -> ThreadPlan:
    """A tensor-parallel rank's share of `plan` on a machine shared by `world_size` ranks: num_threads / world_size
    threads (at least one), each rank pinned to its own CPUs (the plan's bind list, else this process's affinity
    CPUs, split in rank order), so ranks do not preempt each other's OpenMP threads. Their counts stay fixed: the
    ranks of one step must not drift apart (no run-time adaptation)."""
    if world_size == 1:
        return plan
    per_rank = max(1, plan.num_threads // world_size)
    cpus = list(plan.cpu_bind) if plan.cpu_bind else sorted(affinity_cpus())[: plan.limit]
    bind = tuple(cpus[rank * per_rank : (rank + 1) * per_rank]) if len(cpus) >= per_rank * world_size else None
    reason = f"{plan.limit_reason}; rank {rank} of {world_size}"
    return ThreadPlan(per_rank, plan.limit, plan.reserve, plan.source, reason, bind, adapt=False)


def _cpu_list(cpus: set[int]) -> str:
    return ",".join(map(str, sorted(cpus)))


def wait_env() -> dict[str, str]:
    """How OpenMP threads wait: the user's variables if any is set, else kvserve's default."""
    user = {name: os.environ[name] for name in _WAIT_VARS if name in os.environ}
    return user or dict(DEFAULT_WAIT_ENV)


def describe_wait() -> str:
    env = wait_env()
    policy = env.get("OMP_WAIT_POLICY", "").lower()
    spin = f"spin={env['GOMP_SPINCOUNT']}" if "GOMP_SPINCOUNT" in env else ""
    return "+".join(p for p in (policy, spin) if p) or "default"


def export_wait_policy() -> None:
    """The default OpenMP waiting, for a process that has not loaded torch yet (libgomp reads it then);
    `kvserve/__init__.py` calls it."""
    for name, value in wait_env().items():
        os.environ.setdefault(name, value)


def engine_env(plan: ThreadPlan) -> dict[str, str]:
    """Environment for an engine process that has not started torch: thread count, wait policy, binding."""
    env = {"OMP_NUM_THREADS": str(plan.num_threads), "MKL_NUM_THREADS": str(plan.num_threads)}
    env.update(wait_env())
    if plan.cpu_bind:
        # One place per thread, in order: thread i runs on cpu_bind[i] (libgomp's pinning, like vLLM's
        # VLLM_CPU_OMP_THREADS_BIND).
        env["OMP_PLACES"] = ",".join(f"{{{c}}}" for c in plan.cpu_bind)
        env["OMP_PROC_BIND"] = "close"
    return env


@contextlib.contextmanager
def child_env(plan: ThreadPlan) -> Iterator[None]:
    """Within the block, a started process inherits engine_env(plan); this process's environment is restored."""
    saved = {name: os.environ.get(name) for name in engine_env(plan)}
    os.environ.update(engine_env(plan))
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


_applied: ThreadPlan | None = None


def apply_thread_plan(plan: ThreadPlan) -> None:
    """Give this process the plan's threads (torch's pool, which oneDNN, MKL and the kernels share) and binding.
    The engine core calls it at start-up, in its own process or in the offline LLM's."""
    global _applied
    if plan.cpu_bind:
        # Every thread that exists now (a pool started before the plan) keeps to the bound CPUs; libgomp pins its
        # threads one per CPU where OMP_PLACES reached it before torch started (the engine process).
        for tid in _thread_ids():
            with contextlib.suppress(OSError):
                os.sched_setaffinity(tid, plan.cpu_bind)
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(plan.num_threads)
    _applied = plan


def set_compute_threads(num_threads: int) -> None:
    """Resize the compute pool of this process at run time (thread adaptation). torch.set_num_threads sets the
    OpenMP team size of the calling thread, which runs every step: at::parallel_for, kvserve's kernels and oneDNN
    take their team size from it (a test checks that a step then runs on that many threads)."""
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(num_threads)


def applied_plan() -> ThreadPlan | None:
    """The plan this process runs with (None before an engine applied one)."""
    return _applied


def _thread_ids() -> list[int]:
    try:
        return [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        return [0]

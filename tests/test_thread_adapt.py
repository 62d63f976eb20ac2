"""kvserve.thread_adapt: the run-time thread count from made-up /proc/stat samples (no timing), and an engine whose
thread count changes between steps."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kvserve import threads
from kvserve.thread_adapt import ThreadAdapter, busy_ticks, decide

HZ = 100  # ticks per second in the made-up /proc/stat


def proc_stat(per_cpu: dict[int, tuple[int, int, int]]) -> str:
    """/proc/stat text; per CPU (busy ticks, idle ticks, steal ticks). Busy time is split over user and system, and
    idle over idle and iowait, so that the parser's choice of columns is checked."""
    lines = ["cpu  1 2 3 4 5 6 7 8 0 0"]
    for cpu, (busy, idle, steal) in sorted(per_cpu.items()):
        user, system = busy - busy // 3, busy // 3
        lines.append(f"cpu{cpu} {user} 0 {system} {idle - idle // 10} {idle // 10} 0 0 {steal} 0 0")
    lines.append("intr 12345 0 0")
    return "\n".join(lines) + "\n"


class FakeMachine:
    """Two CPUs whose counters advance by what the test says happened in each 0.5 s window."""

    def __init__(self, cpus=(0, 1)) -> None:
        self.cpus = cpus
        self.now = 100.0
        self.own_s = 0.0
        self.ticks = {c: [0, 0, 0] for c in cpus}  # busy, idle, steal
        self.reads = 0

    def read_stat(self) -> str:
        self.reads += 1
        return proc_stat({c: tuple(v) for c, v in self.ticks.items()})

    def window(self, own: float, others: float, steal: float = 0.0, seconds: float = 0.5) -> None:
        """Advance the clock by `seconds` in which this process ran on `own` CPUs, other processes on
        `others` and the hypervisor took `steal`, spread evenly over the CPUs."""
        n = len(self.cpus)
        for c in self.cpus:
            busy = round((own + others) / n * seconds * HZ)
            steal_ticks = round(steal / n * seconds * HZ)
            self.ticks[c][0] += busy
            self.ticks[c][2] += steal_ticks
            self.ticks[c][1] += round(seconds * HZ) - busy - steal_ticks
        self.own_s += own * seconds
        self.now += seconds

    def adapter(self, max_threads: int = 2) -> ThreadAdapter:
        return ThreadAdapter(
            self.cpus,
            max_threads,
            read_stat=self.read_stat,
            clock=lambda: self.now,
            own_cpu=lambda: self.own_s,
            ticks_per_s=HZ,
        )


def run(machine: FakeMachine, adapter: ThreadAdapter, own: float, others: float, windows: int, steal: float = 0.0):
    """`windows` windows of this load; the thread counts poll() returned after each (None: no change)."""
    changes = []
    for _ in range(windows):
        machine.window(own, others, steal)
        changes.append(adapter.poll())
    return changes


def test_busy_ticks_counts_only_our_cpus_and_busy_columns():
    text = proc_stat({0: (30, 70, 0), 1: (50, 40, 10), 2: (99, 1, 0)})
    assert busy_ticks(text, {0, 1}) == 30 + 50 + 10  # steal counts as busy; idle and iowait do not
    assert busy_ticks(text, {2}) == 99
    assert busy_ticks(text, {5}) is None
    assert busy_ticks("cpu  1 2 3 4\ncpu0 10 0 5 100 7 1 2 3 0 0\n", {0}) == 10 + 5 + 1 + 2 + 3


@pytest.mark.parametrize(
    ("threads_now", "others", "expected"),
    [
        (2, 0.0, 2),
        (2, 0.35, 2),  # under 0.4 of a CPU taken (an idle server's frontend and clients): keep both
        (2, 0.45, 1),
        (2, 0.7, 1),  # one busy process beside two threads (it gets ~2/3 of a CPU)
        (2, 1.6, 1),  # never below one
        (1, 1.0, 1),
        (1, 0.35, 1),  # the gap: neither lowered nor raised between 0.25 and 0.4
        (1, 0.3, 1),
        (1, 0.2, 2),
    ],
)
def test_decide_on_two_cpus(threads_now, others, expected):
    assert decide(threads_now, others, num_cpus=2, max_threads=2) == expected


def test_decide_on_bigger_machines_and_below_the_cpu_count():
    assert decide(8, 2.6, num_cpus=8, max_threads=8) == 5  # 5.4 CPUs free
    assert decide(8, 2.3, num_cpus=8, max_threads=8) == 6  # 5.7: the sixth is 70% free
    assert decide(5, 0.1, num_cpus=8, max_threads=8) == 8  # all back at once
    assert decide(7, 0.9, num_cpus=8, max_threads=7) == 7  # serving reserve: 7.1 free is still 7 threads
    assert decide(2, 4.0, num_cpus=8, max_threads=2) == 2  # a quota of 2 on 8 CPUs: 4 free, nothing to give up


def test_a_competing_process_lowers_the_count_and_its_end_raises_it_again():
    m = FakeMachine()
    a = m.adapter()
    assert a.poll() is None  # the first sample only starts a window
    assert run(m, a, own=2.0, others=0.0, windows=3) == [None] * 3  # our own two threads are not competition
    # A busy process arrives: it gets ~2/3 of a CPU beside our two threads. Two windows confirm the change.
    assert run(m, a, own=1.33, others=0.67, windows=2) == [None, 1]
    assert a.num_threads == 1 and a.last_others == pytest.approx(0.67, abs=0.02)
    # On one thread it keeps its full CPU: no flapping back up.
    assert run(m, a, own=1.0, others=1.0, windows=6) == [None] * 6
    # It ends: its CPU is idle now, and the count comes back after two windows.
    assert run(m, a, own=1.0, others=0.0, windows=2) == [None, 2]
    assert run(m, a, own=2.0, others=0.0, windows=4) == [None] * 4


def test_one_window_of_load_changes_nothing():
    m = FakeMachine()
    a = m.adapter()
    a.poll()
    changes = run(m, a, own=1.0, others=1.0, windows=1) + run(m, a, own=2.0, others=0.1, windows=1)
    changes += run(m, a, own=1.0, others=1.0, windows=1) + run(m, a, own=2.0, others=0.1, windows=3)
    assert changes == [None] * 6 and a.num_threads == 2


def test_steal_time_counts_as_taken():
    """A VM whose vCPUs the hypervisor gives to another guest: busy in /proc/stat as steal, not as our time."""
    m = FakeMachine()
    a = m.adapter()
    a.poll()
    assert run(m, a, own=1.2, others=0.0, steal=0.8, windows=2) == [None, 1]


def test_polls_within_a_window_do_not_read_proc_stat():
    m = FakeMachine()
    a = m.adapter()
    a.poll()
    for _ in range(50):  # steps of 10 ms
        m.now += 0.01
        a.poll()
    assert m.reads == 2  # the first sample and the one at 0.5 s


def test_a_window_spanning_an_idle_gap_is_not_judged():
    m = FakeMachine()
    a = m.adapter()
    a.poll()
    m.window(own=1.0, others=1.0)
    assert a.poll() is None
    m.window(own=0.0, others=1.0, seconds=10.0)  # the engine had nothing to do for 10 s
    assert a.poll() is None and a.num_threads == 2  # a new window starts; the earlier one's vote is dropped
    assert run(m, a, own=1.0, others=1.0, windows=2) == [None, 1]


def test_without_proc_stat_the_count_stays():
    a = ThreadAdapter({0, 1}, 2, read_stat=lambda: "intr 1 2\n", clock=lambda: 1.0, own_cpu=lambda: 0.0)
    assert a.poll() is None and not a.enabled
    assert a.poll() is None and a.num_threads == 2


def test_the_real_machine_is_readable():
    """On Linux the real readers give a sample (values not checked: they are the machine's)."""
    if not os.path.exists("/proc/stat"):
        pytest.skip("no /proc/stat")
    a = ThreadAdapter(threads.affinity_cpus(), 2)
    a.poll()
    assert a.enabled and a._prev is not None and a._prev.busy_ticks > 0


def test_only_an_automatic_unbound_count_of_two_or_more_adapts(monkeypatch):
    monkeypatch.setattr(threads, "affinity_cpus", lambda: {0, 1, 2, 3})
    monkeypatch.setattr(threads, "cgroup_cpu_quota", lambda: None)
    monkeypatch.delenv("KVSERVE_NUM_THREADS", raising=False)
    plan = threads.plan_threads()
    assert plan.adapt and "adapt=on" in plan.describe()
    assert not threads.plan_threads(num_threads=4).adapt
    assert not threads.plan_threads(cpu_bind="0-3").adapt
    assert not threads.rank_thread_plan(plan, 0, 2).adapt
    monkeypatch.setenv("KVSERVE_NUM_THREADS", "3")
    assert not threads.plan_threads().adapt
    monkeypatch.delenv("KVSERVE_NUM_THREADS")
    monkeypatch.setattr(threads, "affinity_cpus", lambda: {0})
    assert not threads.plan_threads().adapt


class ScriptedAdapter:
    """Stands in for ThreadAdapter in a real engine: the counts poll() returns, one per step (then None)."""

    def __init__(self, counts: list[int | None]) -> None:
        self.counts = list(counts)

    def poll(self) -> int | None:
        return self.counts.pop(0) if self.counts else None


def test_an_engine_changes_threads_between_steps_and_outputs_match_hf(tiny_model_factory, monkeypatch):
    import torch

    from kvserve import LLM, SamplingParams
    from tests.conftest import assert_all_blocks_free, hf_greedy, load_hf_model

    monkeypatch.setattr(threads, "affinity_cpus", lambda: {0, 1})
    monkeypatch.setattr(threads, "cgroup_cpu_quota", lambda: None)
    monkeypatch.delenv("KVSERVE_NUM_THREADS", raising=False)
    path = tiny_model_factory("llama-gqa-untied")
    saved = torch.get_num_threads()
    llm = LLM(path, dtype="float32", max_model_len=128)
    try:
        core = llm.engine.engine_core
        assert isinstance(core.thread_adapter, ThreadAdapter)  # an automatic count of 2 adapts
        prompts = [[5 + i, 99, 1000 + 7 * i, 42, 7] for i in range(3)]
        # Down to one thread at the first step, back to two at the fifth.
        core.thread_adapter = ScriptedAdapter([1, None, None, None, 2])
        seen = []
        step = core.step

        def counting_step():
            out = step()
            seen.append(torch.get_num_threads())
            return out

        core.step = counting_step
        outs = llm.generate(
            [{"prompt_token_ids": p} for p in prompts],
            SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
            use_tqdm=False,
        )
        assert seen[:4] == [1, 1, 1, 1] and set(seen[4:]) == {2}
        hf = load_hf_model(path)
        assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf, p, 12) for p in prompts]
        assert_all_blocks_free(llm)
    finally:
        torch.set_num_threads(saved)
        threads._applied = None


_ONE_THREAD_WORKS = """
import os, time, torch
torch.set_num_threads(2)
a = torch.randn(256, 1024, dtype=torch.bfloat16); w = torch.randn(512, 1024, dtype=torch.bfloat16)
from kvserve.kernels.cpu import load_cpu_kernels
k = load_cpu_kernels(); x = torch.randn(256, 3072)

def work(n):
    for _ in range(n):
        torch.nn.functional.linear(a, w)
        if k is not None:
            k.silu_and_mul(x)

def ticks():
    out = {}
    for t in os.listdir('/proc/self/task'):
        f = open(f'/proc/self/task/{t}/stat').read().rsplit(')', 1)[1].split()
        out[int(t)] = int(f[11]) + int(f[12])
    return out

main = os.getpid()
work(200)
time.sleep(0.2)  # the pool's threads stop spinning
for n in (1, 2):
    torch.set_num_threads(n)
    before = ticks()
    work(200)
    after = ticks()
    pool = sum(after[t] - before.get(t, 0) for t in after if t != main)
    print(n, after[main] - before[main], pool)
    time.sleep(0.2)
"""


def test_set_compute_threads_at_run_time_leaves_the_rest_of_the_pool_idle():
    """After the pool ran with two threads, one thread does all the work of oneDNN's bf16 linear and kvserve's
    kernels once the count is set to one (the pool's other thread gets no CPU at all), and shares it again at two."""
    out = subprocess.run([sys.executable, "-c", _ONE_THREAD_WORKS], capture_output=True, text=True, check=True)
    rows = {int(n): (int(main), int(pool)) for n, main, pool in (line.split() for line in out.stdout.splitlines())}
    assert rows[1][1] <= 1 < rows[1][0]  # at most a tick of accounting noise beside the main thread's work
    if (os.cpu_count() or 1) >= 2 and len(threads.affinity_cpus()) >= 2:
        assert rows[2][1] > 1  # able to fail: with two threads the pool does take a share


def test_an_explicit_count_turns_the_engines_adaptation_off(monkeypatch, tiny_model_factory):
    import torch

    from kvserve import LLM

    monkeypatch.setattr(threads, "affinity_cpus", lambda: {0, 1})
    monkeypatch.setattr(threads, "cgroup_cpu_quota", lambda: None)
    path = tiny_model_factory("llama-gqa-untied")
    saved = torch.get_num_threads()
    try:
        fixed = LLM(path, dtype="float32", max_model_len=64, num_threads=2)
        assert fixed.engine.engine_core.thread_adapter is None
    finally:
        torch.set_num_threads(saved)
        threads._applied = None

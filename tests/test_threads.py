"""kvserve.threads: the thread count from affinity and cgroup quota (faked here), explicit counts, binding, and the
environment the engine process starts torch with."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys

import pytest

from kvserve import threads
from kvserve.engine.arg_utils import EngineArgs


@pytest.fixture
def fake_machine(monkeypatch, tmp_path):
    """fake_machine(cpus, v2=None, v1=None, path='/'): affinity `cpus`; cgroup v2 `cpu.max` text or v1
    (quota_us, period_us) for this process's cgroup at `path`, under a fake /sys/fs/cgroup."""

    def install(cpus, v2: str | None = None, v1: tuple[int, int] | None = None, path: str = "/") -> None:
        monkeypatch.setattr(threads, "affinity_cpus", lambda: set(cpus))
        monkeypatch.delenv("KVSERVE_NUM_THREADS", raising=False)
        root = tmp_path / "cgroup"
        self_cgroup = tmp_path / "self_cgroup"
        folder = root / path.strip("/") if v2 is not None else root / "cpu,cpuacct" / path.strip("/")
        folder.mkdir(parents=True, exist_ok=True)
        if v2 is not None:
            (folder / "cpu.max").write_text(v2 + "\n")
            self_cgroup.write_text(f"0::{path}\n")
        elif v1 is not None:
            (folder / "cpu.cfs_quota_us").write_text(f"{v1[0]}\n")
            (folder / "cpu.cfs_period_us").write_text(f"{v1[1]}\n")
            self_cgroup.write_text(f"4:memory:{path}\n3:cpu,cpuacct:{path}\n0::/\n")
        else:
            self_cgroup.write_text("0::/\n")
        monkeypatch.setattr(threads, "CGROUP_ROOT", str(root))
        monkeypatch.setattr(threads, "PROC_SELF_CGROUP", str(self_cgroup))

    yield install


def test_all_cpus_of_the_affinity_mask_without_a_quota(fake_machine):
    fake_machine(range(8))
    plan = threads.plan_threads()
    assert (plan.num_threads, plan.limit, plan.reserve, plan.source) == (8, 8, 0, "auto")


def test_the_count_follows_a_cgroup_v2_quota_below_the_affinity(fake_machine):
    fake_machine(range(8), v2="150000 100000", path="/docker/abc")  # docker --cpus 1.5
    assert threads.cgroup_cpu_quota() == 1.5
    plan = threads.plan_threads()
    assert (plan.num_threads, plan.limit) == (1, 1)  # rounded down: a second thread would only wait for the quota
    assert "cgroup quota 1.5" in plan.limit_reason
    fake_machine(range(8), v2="300000 100000")
    assert threads.plan_threads().num_threads == 3
    fake_machine(range(8), v2="max 100000")
    assert threads.cgroup_cpu_quota() is None and threads.plan_threads().num_threads == 8


def test_the_count_follows_a_cgroup_v1_quota(fake_machine):
    fake_machine(range(16), v1=(400000, 100000), path="/kubepods/pod1")
    assert threads.cgroup_cpu_quota() == 4.0
    assert threads.plan_threads().num_threads == 4
    fake_machine(range(16), v1=(-1, 100000))
    assert threads.cgroup_cpu_quota() is None


def test_a_quota_above_the_affinity_changes_nothing(fake_machine):
    fake_machine({0, 1}, v2="400000 100000")
    assert threads.plan_threads().num_threads == 2


def test_a_tighter_parent_cgroup_wins(fake_machine, tmp_path):
    fake_machine(range(8), v2="400000 100000", path="/a/b")
    (tmp_path / "cgroup" / "a" / "cpu.max").write_text("200000 100000\n")
    assert threads.cgroup_cpu_quota() == 2.0


def test_serving_reserves_a_cpu_for_the_frontend_only_on_bigger_machines(fake_machine):
    fake_machine(range(8))
    plan = threads.plan_threads(serving=True)
    assert (plan.num_threads, plan.reserve) == (7, 1)
    fake_machine({0, 1})
    plan = threads.plan_threads(serving=True)
    assert (plan.num_threads, plan.reserve) == (2, 0)


def test_an_explicit_count_wins_flag_over_environment(fake_machine, monkeypatch):
    fake_machine(range(8))
    monkeypatch.setenv("KVSERVE_NUM_THREADS", "3")
    plan = threads.plan_threads(serving=True)
    assert (plan.num_threads, plan.source, plan.reserve) == (3, "KVSERVE_NUM_THREADS", 5)
    plan = threads.plan_threads(num_threads=5)
    assert (plan.num_threads, plan.source) == (5, "--num-threads")


@pytest.mark.parametrize("bad", [0, -2])
def test_zero_or_negative_count_is_a_clear_error(fake_machine, bad):
    fake_machine({0, 1})
    with pytest.raises(ValueError, match=rf"num_threads must be >= 1, got {bad} \(this process may use 2 CPUs"):
        threads.plan_threads(num_threads=bad)


def test_more_threads_than_cpus_names_the_limit(fake_machine, monkeypatch):
    fake_machine(range(8), v2="200000 100000")
    with pytest.raises(ValueError, match=r"num_threads=3 is more than the 2 CPUs .*cgroup quota 2.*use at most 2"):
        threads.plan_threads(num_threads=3)
    monkeypatch.setenv("KVSERVE_NUM_THREADS", "9")
    with pytest.raises(ValueError, match="KVSERVE_NUM_THREADS=9 is more than the 2 CPUs"):
        threads.plan_threads()
    monkeypatch.setenv("KVSERVE_NUM_THREADS", "many")
    with pytest.raises(ValueError, match="not a whole number"):
        threads.plan_threads()


def test_engine_args_reject_a_bad_count_before_loading_anything(fake_machine):
    fake_machine({0, 1})
    with pytest.raises(ValueError, match="at most 2"):
        EngineArgs(num_threads=4).create_engine_config()
    with pytest.raises(ValueError, match=">= 1"):
        EngineArgs(num_threads=0).create_engine_config(serving=True)


def test_cpu_bind_list_and_its_checks(fake_machine):
    assert threads.parse_cpu_list("0-2,5") == (0, 1, 2, 5)
    for bad in ("", "a-b", "3-1", "1,1"):
        with pytest.raises(ValueError, match="cpu_bind"):
            threads.parse_cpu_list(bad)
    fake_machine(range(4))
    plan = threads.plan_threads(cpu_bind="2,3", serving=True)
    assert (plan.num_threads, plan.cpu_bind, plan.reserve) == (2, (2, 3), 0)
    env = threads.engine_env(plan)
    assert env["OMP_PLACES"] == "{2},{3}" and env["OMP_PROC_BIND"] == "close" and env["OMP_NUM_THREADS"] == "2"
    assert "bind=2,3;" in plan.describe()
    with pytest.raises(ValueError, match=r"CPU\(s\) 7 this process may not use; it may use 0,1,2,3"):
        threads.plan_threads(cpu_bind="3,7")
    with pytest.raises(ValueError, match="does not match the 2 CPUs of cpu_bind"):
        threads.plan_threads(num_threads=1, cpu_bind="0-1")


def test_child_env_sets_the_engine_environment_and_restores_ours(fake_machine, monkeypatch):
    fake_machine({0, 1})
    monkeypatch.setenv("OMP_NUM_THREADS", "7")
    monkeypatch.delenv("MKL_NUM_THREADS", raising=False)
    with threads.child_env(threads.plan_threads(num_threads=1)):
        assert os.environ["OMP_NUM_THREADS"] == "1" and os.environ["MKL_NUM_THREADS"] == "1"
    assert os.environ["OMP_NUM_THREADS"] == "7" and "MKL_NUM_THREADS" not in os.environ


def _report_threads(queue) -> None:
    import torch

    queue.put((torch.get_num_threads(), {k: os.environ[k] for k in threads.DEFAULT_WAIT_ENV}))


def test_a_spawned_engine_process_starts_torch_with_the_plan(fake_machine):
    """What AsyncMPClient does: the child's torch sizes its pool from the inherited environment."""
    fake_machine({0, 1})
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    with threads.child_env(threads.plan_threads(num_threads=1)):
        proc = ctx.Process(target=_report_threads, args=(queue,))
        proc.start()
    num_threads, wait = queue.get(timeout=120)
    proc.join()
    assert num_threads == 1
    assert wait == {k: threads.wait_env()[k] for k in threads.DEFAULT_WAIT_ENV}


def test_importing_kvserve_sets_the_default_waiting_unless_the_user_set_any():
    code = "import os, kvserve; print({k: os.environ.get(k) for k in ('OMP_WAIT_POLICY', 'GOMP_SPINCOUNT')})"
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    expected = {"OMP_WAIT_POLICY": None, "GOMP_SPINCOUNT": None, **threads.DEFAULT_WAIT_ENV}
    assert out.stdout.strip() == str(expected)
    env["OMP_WAIT_POLICY"] = "ACTIVE"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == str({"OMP_WAIT_POLICY": "ACTIVE", "GOMP_SPINCOUNT": None})


def test_kvserve_kernels_run_on_torchs_pool():
    """With torch at one thread, a threaded C++ kernel starts no thread of its own (no second pool from nproc)."""
    code = (
        "import os, torch\n"
        "torch.set_num_threads(1)\n"
        "from kvserve.kernels.cpu import load_cpu_kernels\n"
        "k = load_cpu_kernels()\n"
        "x = torch.randn(4096, 3072)\n"
        "before = len(os.listdir('/proc/self/task'))\n"
        "if k is not None:\n"
        "    k.silu_and_mul(x)\n"
        "print(before, len(os.listdir('/proc/self/task')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    before, after = out.stdout.split()
    assert before == after


def test_apply_sets_torchs_threads_and_the_startup_line_shows_the_plan(fake_machine):
    import torch

    from kvserve import platform

    fake_machine({0, 1})
    saved = torch.get_num_threads()
    try:
        threads.apply_thread_plan(threads.plan_threads(num_threads=1))
        assert torch.get_num_threads() == 1
        line = platform.startup_summary("float32", torch.get_num_threads(), "C++ avx2")
        assert "threads=1/2 cpus (--num-threads; affinity 2 CPUs; reserve=1; bind=off; adapt=off; omp_wait=" in line
        threads.apply_thread_plan(threads.plan_threads())
        line = platform.startup_summary("float32", torch.get_num_threads(), "C++ avx2")
        assert "threads=2/2 cpus (auto; affinity 2 CPUs; reserve=0; bind=off; adapt=on; omp_wait=" in line
    finally:
        torch.set_num_threads(saved)
        threads._applied = None

"""benchmarks/gpu_suite.py still runs: every stage but the tests (which CI runs itself) on the CPU with tiny shapes
(--smoke). A session lent a GPU has minutes of it; a script broken by a change elsewhere must fail here, not there.
The figures of a smoke run mean nothing; only that each stage ran and wrote its part of the JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

pytestmark = pytest.mark.skipif(bool(os.environ.get("KVSERVE_CPU_ISA")), reason="forced ISA level: runs once")


def test_every_stage_runs_on_the_cpu(tmp_path):
    env = dict(os.environ, PYTHONPATH=ROOT)
    cmd = [sys.executable, "benchmarks/gpu_suite.py", "correctness", "perf", "--smoke", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    (path,) = tmp_path.glob("gpu_suite-*.json")
    res = json.loads(path.read_text())
    assert res["errors"] == {}
    assert res["stages"] == ["env", "tests", "parity", "roofline", "throughput"]
    assert res["env"]["copy_bandwidth_GBps"] > 0
    # fp32 on the CPU is the engine's own parity check: token-identical to HF.
    for row in res["parity"].values():
        assert row["float32-eager"]["identical"] and row["float32-graphs"]["identical"], row
        assert row["float32-graphs-async"]["identical"], row
    for mode in ("graphs", "graphs-async", "eager"):
        assert {"step_ms", "roofline_ms", "fraction_of_roofline"} <= set(res["roofline"][mode])
    assert res["throughput"]["kvserve (graphs-async)"]["output_tok_s"] > 0
    assert res["throughput"]["kvserve (graphs)"]["output_tok_s"] > 0
    assert "speedup_graphs_vs_best_hf" in res["throughput"]
    assert "==== gpu_suite summary ====" in proc.stdout


def test_breakdown_and_serve_stages_run_on_the_cpu(tmp_path):
    """The issue-35 stages: the decode-step breakdown (kernels in Triton's interpreter) and `kvserve serve` under
    streaming load, on the tiny stand-ins."""
    env = dict(os.environ, PYTHONPATH=ROOT, TRITON_INTERPRET="1")
    cmd = [sys.executable, "benchmarks/gpu_suite.py", "breakdown", "serve", "--smoke", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    (path,) = tmp_path.glob("gpu_suite-*.json")
    res = json.loads(path.read_text())
    assert res["errors"] == {}
    b = res["breakdown"]
    assert {"before", "after", "floors", "attention_one_layer"} <= set(b)
    assert all("us" in v for v in b["attention_one_layer"]["variants"]), b["attention_one_layer"]
    for mode in ("sync", "async"):
        assert res["serve"][mode]["completed"] == 8 and res["serve"][mode]["errors"] == 0, res["serve"][mode]

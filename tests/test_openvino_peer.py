"""The OpenVINO GenAI peer without OpenVINO: the set-up script's argument handling (a dry run, no network), the
properties each kvserve precision pairs with, and the runner's job/result plumbing against a stand-in `openvino`
package (so a change to either side of the JSON protocol fails here, not in a benchmark session)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from kvserve.benchmarks.openvino_peer import openvino_name, openvino_properties, run_openvino

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SETUP = os.path.join(ROOT, "benchmarks", "peers", "setup_openvino.sh")

pytestmark = pytest.mark.skipif(bool(os.environ.get("KVSERVE_CPU_ISA")), reason="forced ISA level: runs once")


def setup_script(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, SETUP_OPENVINO_DRY_RUN="1", KVSERVE_CACHE_DIR="/nonexistent/cache")
    return subprocess.run(["bash", SETUP, *args], env=env, capture_output=True, text=True, timeout=30)


def test_setup_script_arguments():
    out = setup_script()
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == (
        "venv=.venv-openvino out=/nonexistent/cache/openvino/smollm2-135m-instruct precisions=fp32 int8 default"
    )
    out = setup_script("--out", "/tmp/x", "--precisions", "int8", "--venv", "/tmp/v")
    assert (out.returncode, out.stdout.strip()) == (0, "venv=/tmp/v out=/tmp/x precisions=int8")
    out = setup_script("--precisions", "fp32 int4")
    assert out.returncode == 2 and "unknown precision int4" in out.stderr
    out = setup_script("--bogus")
    assert out.returncode == 2 and "unknown argument --bogus" in out.stderr
    out = setup_script("--help")
    assert out.returncode == 0 and "optimum-cli export openvino" in out.stdout


def test_properties_pair_each_precision_with_its_counterpart():
    assert openvino_properties("auto", "float32", 2, []) == {
        "INFERENCE_NUM_THREADS": "2",
        "INFERENCE_PRECISION_HINT": "f32",
    }
    assert openvino_properties("auto", "bfloat16", 2, []) == {"INFERENCE_NUM_THREADS": "2"}
    assert openvino_properties("bf16", "float32", 1, ["KV_CACHE_PRECISION=f32"]) == {
        "INFERENCE_NUM_THREADS": "1",
        "INFERENCE_PRECISION_HINT": "bf16",
        "KV_CACHE_PRECISION": "f32",
    }
    with pytest.raises(ValueError, match="KEY=VALUE"):
        openvino_properties("auto", "float32", 2, ["KV_CACHE_PRECISION"])
    props = openvino_properties("auto", "float32", 2, [])
    assert openvino_name("/ir/int8/", props) == "openvino-genai int8 f32"


# A stand-in for the two OpenVINO packages: pipelines that "generate" max_new_tokens tokens (or one fewer, when the
# environment asks, to check that a short result is refused) and record the calls they got.
FAKE_OPENVINO = """
class Tensor:
    def __init__(self, data):
        self.data = data

class _Type:
    def to_string(self):
        return "f32"

class Core:
    def get_property(self, device, key):
        return {"FULL_DEVICE_NAME": "Fake CPU", "OPTIMIZATION_CAPABILITIES": ["FP32"]}.get(key, _Type())

    def set_property(self, device, props):
        pass

__version__ = "fake"
"""
FAKE_GENAI = """
import json, os

__version__ = "fake-genai"
SHORT = int(os.environ.get("FAKE_OV_SHORT", "0"))

class SchedulerConfig:
    pass

class GenerationConfig:
    pass

class _Result:
    def __init__(self, n):
        self.m_generation_ids = [[7] * n]

class ContinuousBatchingPipeline:
    def __init__(self, model_dir, scheduler, device, properties):
        self.log = {"model_dir": model_dir, "scheduler": vars(scheduler), "properties": properties, "calls": []}

    def generate(self, ids, configs):
        calls = [[len(t.data[0]), c.max_new_tokens, c.ignore_eos, c.rng_seed] for t, c in zip(ids, configs)]
        self.log["calls"].append(calls)
        with open(os.environ["FAKE_OV_LOG"], "w") as f:
            json.dump(self.log, f)
        return [_Result(c.max_new_tokens - SHORT) for c in configs]
"""


@pytest.fixture
def fake_openvino(tmp_path, monkeypatch):
    for name, text in (("openvino", FAKE_OPENVINO), ("openvino_genai", FAKE_GENAI)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text(textwrap.dedent(text))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    monkeypatch.setenv("FAKE_OV_LOG", str(tmp_path / "log.json"))
    return tmp_path


def test_runner_offline_protocol(fake_openvino, monkeypatch):
    import json

    job = {
        "mode": "offline",
        "model_dir": "/ir/fp32",
        "properties": {"INFERENCE_NUM_THREADS": "2", "INFERENCE_PRECISION_HINT": "f32"},
        "temperature": 1.0,
        "seed": 5,
        "scheduler": {"max_num_batched_tokens": 512, "max_num_seqs": 16},
        "warmup": [[[1, 2], 3]],
        "requests": [[[1, 2, 3], 4], [[4, 5], 6]],
    }
    out = run_openvino(sys.executable, job)
    assert (out["output_tokens"], out["num_requests"], out["openvino_genai"]) == (10, 2, "fake-genai")
    assert out["device"]["cpu"] == "Fake CPU" and out["device"]["inference_precision_hint"] == "f32"
    log = json.loads((fake_openvino / "log.json").read_text())
    assert log["scheduler"] == {"max_num_batched_tokens": 512, "max_num_seqs": 16}
    assert log["properties"] == job["properties"]
    # Warm-up first, then the timed requests: prompt length, output length, ignore_eos, a seed per request.
    assert log["calls"] == [[[2, 3, True, 5]], [[3, 4, True, 5], [2, 6, True, 6]]]

    monkeypatch.setenv("FAKE_OV_SHORT", "1")
    with pytest.raises(subprocess.CalledProcessError):
        run_openvino(sys.executable, job)


def test_missing_environment_names_the_setup_script(tmp_path):
    with pytest.raises(FileNotFoundError, match="setup_openvino.sh"):
        run_openvino(str(tmp_path / "no-python"), {"mode": "offline"})

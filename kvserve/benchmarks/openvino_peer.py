"""OpenVINO GenAI as a benchmark peer of `kvserve bench throughput` and `kvserve bench latency`.

OpenVINO lives in its own environment (`benchmarks/peers/setup_openvino.sh` makes it and the IR folders), never in
kvserve's: this module runs `openvino_runner.py` with that environment's Python on the same requests (token ids)
and reads its figures back. Offline: ContinuousBatchingPipeline with kvserve's scheduling limits (token budget,
sequences per step). Batch 1: LLMPipeline. Both with as many threads as kvserve's torch.

Precision (`--openvino-precision`): `auto` pairs each kvserve run with its counterpart, f32 when kvserve computes
in float32 and OpenVINO's own default otherwise (bf16 on a CPU with native bf16, f32 elsewhere); the weights are
the IR folder's (fp32, fp16 or int8, as exported).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

RUNNER = Path(__file__).with_name("openvino_runner.py")
DEFAULT_PYTHON = ".venv-openvino/bin/python"
PRECISIONS = ("auto", "f32", "bf16", "f16", "default")


def add_openvino_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("OpenVINO GenAI peer (benchmarks/peers/setup_openvino.sh)")
    g.add_argument("--openvino", default=None, metavar="DIR", help="also run OpenVINO GenAI on this IR folder")
    g.add_argument(
        "--openvino-precision",
        choices=PRECISIONS,
        default="auto",
        help="INFERENCE_PRECISION_HINT; auto: f32 when kvserve runs float32, OpenVINO's default otherwise",
    )
    g.add_argument(
        "--openvino-python",
        default=os.environ.get("KVSERVE_OPENVINO_PYTHON", DEFAULT_PYTHON),
        help=f"the OpenVINO environment's Python (default $KVSERVE_OPENVINO_PYTHON or {DEFAULT_PYTHON})",
    )
    g.add_argument(
        "--openvino-property",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an extra OpenVINO CPU property, e.g. KV_CACHE_PRECISION=f32 (repeatable)",
    )


def engine_threads(config) -> int:
    """The compute threads kvserve's engine was planned with (not torch's count in this process, which run-time
    adaptation may have lowered): the OpenVINO run gets as many."""
    if config.threads is not None:
        return config.threads.num_threads
    import torch

    return torch.get_num_threads()


def openvino_properties(precision: str, kvserve_dtype: str, threads: int, extra: list[str]) -> dict[str, str]:
    """The CPU properties of the OpenVINO run: threads, the precision hint (resolved from `auto`), extras."""
    if precision == "auto":
        precision = "f32" if kvserve_dtype == "float32" else "default"
    props = {"INFERENCE_NUM_THREADS": str(threads)}
    if precision != "default":
        props["INFERENCE_PRECISION_HINT"] = precision
    for item in extra:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--openvino-property {item!r}: use KEY=VALUE")
        props[key] = value
    return props


def openvino_name(model_dir: str, props: dict[str, str]) -> str:
    """`openvino-genai <IR folder name> <hint>`, e.g. `openvino-genai int8 default`."""
    hint = props.get("INFERENCE_PRECISION_HINT", "default")
    return f"openvino-genai {os.path.basename(os.path.normpath(model_dir))} {hint}"


def openvino_summary(device: dict, props: dict[str, str]) -> str:
    """One line: OpenVINO's version, the CPU and capabilities it sees, the precisions it computes and caches in."""
    return (
        f"OpenVINO {device['openvino']}: {device['cpu']} ({', '.join(device['optimization_capabilities'])}); "
        f"computes in {device['inference_precision_hint']}, KV cache {device['kv_cache_precision']}; "
        f"properties {props}"
    )


def run_openvino(python: str, job: dict) -> dict:
    """Run one job in the OpenVINO environment; its stderr goes to ours. Raises if the run fails."""
    if not os.path.exists(python):
        raise FileNotFoundError(
            f"no OpenVINO environment at {python}: run benchmarks/peers/setup_openvino.sh or pass --openvino-python"
        )
    with tempfile.TemporaryDirectory() as tmp:
        job_path, result_path = os.path.join(tmp, "job.json"), os.path.join(tmp, "result.json")
        with open(job_path, "w") as f:
            json.dump(job, f)
        subprocess.run([python, str(RUNNER), job_path, result_path], check=True, stdout=sys.stderr)
        with open(result_path) as f:
            return json.load(f)

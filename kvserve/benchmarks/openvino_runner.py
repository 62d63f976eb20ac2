"""OpenVINO GenAI's side of the peer benchmark: a script run by the OpenVINO environment's Python, not by kvserve.

    <openvino venv>/bin/python openvino_runner.py JOB.json RESULT.json

It imports only the standard library and OpenVINO (kvserve's environment has neither openvino nor needs it, and the
OpenVINO environment has no kvserve). kvserve's side (`openvino_peer.py`) writes the job and reads the result.

Job (JSON): {"mode": "offline" | "latency", "model_dir", "properties" (CPU properties, e.g. INFERENCE_NUM_THREADS and
INFERENCE_PRECISION_HINT), "temperature", "seed", and per mode:
- offline: "requests": [[prompt_token_ids, output_len], ...], "warmup" (the same form, run first, untimed),
  "scheduler": SchedulerConfig fields; each list goes to one ContinuousBatchingPipeline.generate call (ignore_eos,
  so each request yields exactly output_len tokens, which is checked);
- latency: "gen_len", "pp_prompts" and "tg_prompts" ([[token ids], ...], the first of each untimed, for warm-up):
  LLMPipeline at batch 1; pp = prompt length / time to first token, tg = 1 / time per output token after the first
  over gen_len tokens (OpenVINO GenAI's own perf metrics), as `kvserve bench latency` reports them.
Result (JSON): the figures, the versions and what OpenVINO reports of the CPU and the compiled precision.
"""

from __future__ import annotations

import json
import sys
import time


def _generation_config(ov_genai, output_len: int, temperature: float, seed: int):
    config = ov_genai.GenerationConfig()
    config.max_new_tokens = output_len
    config.min_new_tokens = output_len
    config.ignore_eos = True
    if temperature > 0:
        config.do_sample = True
        config.temperature = temperature
        config.top_p = 1.0
        config.rng_seed = seed
    return config


def _device_record(ov, properties: dict) -> dict:
    core = ov.Core()
    record = {
        "openvino": ov.__version__,
        "cpu": core.get_property("CPU", "FULL_DEVICE_NAME"),
        "optimization_capabilities": list(core.get_property("CPU", "OPTIMIZATION_CAPABILITIES")),
    }
    # The precision OpenVINO computes in when compiled with these properties (the hint's default depends on the CPU).
    core.set_property(
        "CPU", {k: v for k, v in properties.items() if k in ("INFERENCE_PRECISION_HINT", "KV_CACHE_PRECISION")}
    )
    for key in ("INFERENCE_PRECISION_HINT", "KV_CACHE_PRECISION"):
        value = core.get_property("CPU", key)
        record[key.lower()] = value.to_string() if hasattr(value, "to_string") else str(value)
    return record


def run_offline(ov, ov_genai, job: dict) -> dict:
    scheduler = ov_genai.SchedulerConfig()
    for key, value in job["scheduler"].items():
        setattr(scheduler, key, value)
    pipe = ov_genai.ContinuousBatchingPipeline(job["model_dir"], scheduler, "CPU", job["properties"])
    temperature, seed = job["temperature"], job["seed"]

    def run(requests: list) -> tuple[float, int]:
        ids = [ov.Tensor([list(p)]) for p, _ in requests]
        configs = [_generation_config(ov_genai, n, temperature, seed + i) for i, (_, n) in enumerate(requests)]
        start = time.perf_counter()
        results = pipe.generate(ids, configs)
        seconds = time.perf_counter() - start
        produced = [len(r.m_generation_ids[0]) for r in results]
        wanted = [n for _, n in requests]
        if produced != wanted:
            raise RuntimeError(f"OpenVINO produced {sum(produced)} tokens, expected {sum(wanted)}")
        return seconds, sum(produced)

    run(job["warmup"])  # allocator, kernel selection: outside the timing, as for kvserve
    seconds, output_tokens = run(job["requests"])
    return {"seconds": seconds, "output_tokens": output_tokens, "num_requests": len(job["requests"])}


def run_latency(ov, ov_genai, job: dict) -> dict:
    pipe = ov_genai.LLMPipeline(job["model_dir"], "CPU", **job["properties"])

    def first_token_ms(prompt: list[int]) -> float:
        config = _generation_config(ov_genai, 1, job["temperature"], job["seed"])
        return pipe.generate(ov.Tensor([prompt]), config).perf_metrics.get_ttft().mean

    def per_token_ms(prompt: list[int]) -> float:
        config = _generation_config(ov_genai, job["gen_len"], job["temperature"], job["seed"])
        metrics = pipe.generate(ov.Tensor([prompt]), config).perf_metrics
        if metrics.get_num_generated_tokens() != job["gen_len"]:
            raise RuntimeError(f"OpenVINO generated {metrics.get_num_generated_tokens()} tokens, not {job['gen_len']}")
        return metrics.get_tpot().mean

    # The first prompt of each list warms up, untimed.
    pp = [len(p) / (first_token_ms(p) / 1000) for p in job["pp_prompts"]][1:]
    tg = [1000 / per_token_ms(p) for p in job["tg_prompts"]][1:]
    return {"pp": pp, "tg": tg}


def main(argv: list[str]) -> int:
    import openvino as ov
    import openvino_genai as ov_genai

    job_path, result_path = argv
    with open(job_path) as f:
        job = json.load(f)
    run = {"offline": run_offline, "latency": run_latency}[job["mode"]]
    result = run(ov, ov_genai, job)
    result["device"] = _device_record(ov, job["properties"])
    result["openvino_genai"] = ov_genai.__version__
    with open(result_path, "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

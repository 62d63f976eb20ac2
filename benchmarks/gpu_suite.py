"""The GPU checks and measurements of issue 14, for a machine with a CUDA GPU and no network (docs/gpu.md).

    python3 benchmarks/gpu_suite.py correctness   # env, tests, parity   (~4 min on an H100)
    python3 benchmarks/gpu_suite.py perf          # env, roofline, throughput   (~7 min)
    python3 benchmarks/gpu_suite.py env tests parity roofline throughput   # any stages, in order
    python3 benchmarks/gpu_suite.py env breakdown throughput serve         # issue 35's measurements

Stages:
- env:        the GPU, library versions, and the measured device-to-device copy bandwidth (bytes read + written).
- tests:      the Triton kernel tests and the engine tests on the Triton backend (swap, offload tiers, draft-model
              and EAGLE speculation included), on CUDA (pytest; CUDA graphs captured for real), with a synthetic
              tokenizer (KVSERVE_TEST_TOKENIZER=synthetic).
- parity:     greedy tokens of kvserve vs HF transformers, both on the GPU, on the tiny random models of
              tests/conftest.py: fp32 must be token-identical (CUDA graphs on and off, and with async scheduling);
              bf16 reports the first divergent position per prompt.
- roofline:   batch-1 decode of a Llama-3-8B-shaped model with random bf16 weights (load_format dummy): time per
              decode step, against weight bytes / measured copy bandwidth; in each of MODES (CUDA graphs, CUDA
              graphs with async scheduling, eager).
- throughput: the nano-vllm workload (256 requests, prompt and output lengths uniform in 100..1024, ignore_eos,
              temperature 0.6) on a Qwen3-0.6B-shaped random bf16 model: kvserve in each of MODES, and
              HF transformers `generate` (static batches of 64) on the same GPU in the same run, over the first
              --hf-requests (128) of the same requests: its rate, output tokens per second, is the comparison.
              Each kvserve mode then runs a short profiled window at full batch (--profile-steps): wall and GPU-busy
              time per step, and the host calls that took longest (where the host blocks on the GPU).
- breakdown:  one decode step of the nano-vllm shape at batch 256 (contexts 500..2000): GPU time of the forward,
              LM head and draw, per kernel, against the step's byte and FLOP floors; before (decode rows through
              the prefill kernel, torch Gumbel draw) and after (segment decode kernel, fused draw); then one layer's
              decode attention in each kernel variant (benchmarks/gpu_breakdown.py).
- serve:      `kvserve serve` on the Llama-3-8B shape (random weights) under 64 concurrent streaming clients (256
              requests): output tok/s, TTFT and ITL percentiles, in each of --serve-modes, and the Triton kernels
              compiled while serving (benchmarks/gpu_serve.py).

Every model is built from a config here: nothing is downloaded. Results go to $OUT/gpu_suite-<stages>.json (or
./gpu_suite-<stages>.json) and a summary table is printed last.

`--smoke` runs the same stages on the CPU with tiny shapes and few requests (the tests stage is left to CI): not
a measurement, but a check that the suite itself still runs, so that a session lent a GPU spends none of it on
the script. CI runs it (tests/test_gpu_suite_smoke.py).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402
from gpu_breakdown import profile_window  # noqa: E402
from gpu_serve import record_run  # noqa: E402

STAGES = ("env", "tests", "parity", "roofline", "throughput", "breakdown", "serve")
GROUPS = {"correctness": ("env", "tests", "parity"), "perf": ("env", "roofline", "throughput")}
KERNEL_TESTS = [
    "tests/attention/test_triton_attention.py",
    "tests/kernels/test_triton_ops.py",
    "tests/sample/test_triton_sampling.py",
    "tests/models/test_triton_engine.py",
    "tests/spec_decode/test_triton_proposers.py",
]
GPU_PARTS_TESTS = ["tests/worker/test_gpu_parts.py"]
DEVICE = "cuda"  # "cpu" with --smoke
# Engine modes of the perf stages: CUDA graphs; graphs with async scheduling (the host schedules and launches step
# N+1 while the GPU runs step N); eager.
MODES = ("graphs", "graphs-async", "eager")
# A/B variants of graphs-async (roofline and throughput stages): each suffix sets one switch for that engine.
ROOFLINE_SWITCHES = {
    "-cublas": ("KVSERVE_TRITON_GEMV", "0"),  # cuBLAS for every batch-1 linear
    "-unfused": ("KVSERVE_FUSE_ROTARY_WRITE", "0"),  # rotary and the KV write as two launches
    "-seg256": ("KVSERVE_DECODE_SEGMENT", "256"),  # decode attention split every 256 keys, the default until 128
    "-merge1": ("KVSERVE_DECODE_MERGE_SEGS", "1"),  # the decode merge loads one segment at a time
}
ROOFLINE_MODES = MODES + tuple("graphs-async" + suffix for suffix in ROOFLINE_SWITCHES)
# --smoke: tiny stand-ins for the measured shapes (random weights, as there).
SMOKE_SHAPES = {"llama3-8b": "tiny-llama", "qwen3-0.6b": "tiny-qwen3"}


def mode_engine(folder: str, mode: str, **engine_kwargs):
    """An engine on `folder`'s model (random bf16 weights) in `mode`: graphs or eager, async or not, and the
    mode's variant switch (ROOFLINE_SWITCHES) set while it is built."""
    from kvserve import LLM

    with mode_switches(mode):
        return LLM(
            folder,
            load_format="dummy",
            dtype="bfloat16",
            device=DEVICE,
            max_model_len=2048,
            enforce_eager=mode == "eager",
            async_scheduling="-async" in mode,
            **engine_kwargs,
        )


@contextlib.contextmanager
def mode_switches(mode: str):
    """The environment of a mode's engine while it is built: its variant suffix's switch (ROOFLINE_SWITCHES)."""
    switches = [sw for suffix, sw in ROOFLINE_SWITCHES.items() if mode.endswith(suffix)]
    for var, value in switches:
        os.environ[var] = value
    try:
        yield
    finally:
        for var, _ in switches:
            os.environ.pop(var, None)


def log(msg: str) -> None:
    print(f"[gpu_suite {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def release_memory() -> None:
    """Call after dropping the last reference to an engine (`llm.shutdown(); del llm`): a reference left in the
    caller's frame keeps the model, its KV pool and its graphs on the GPU, and the next engine (or the tests'
    subprocess) runs out of memory."""
    gc.collect()
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
        log(f"GPU memory allocated after release: {torch.cuda.memory_allocated() / 2**30:.2f} GiB")


def shape(name: str) -> str:
    """A model shape of kvserve.benchmarks.synthetic.SHAPES, or its tiny stand-in with --smoke."""
    return SMOKE_SHAPES[name] if DEVICE == "cpu" else name


def copy_bandwidth(nbytes: int = 2 << 30, iters: int = 20) -> float:
    """Bytes/s of a device-to-device copy, counting bytes read plus bytes written (median of `iters`)."""
    if DEVICE == "cpu":
        nbytes = min(nbytes, 64 << 20)
    x = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=DEVICE).normal_()
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    times = []
    for _ in range(iters):
        if DEVICE == "cpu":
            start_s = time.perf_counter()
            y.copy_(x)
            times.append(time.perf_counter() - start_s)
            continue
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        y.copy_(x)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del x, y
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
    return 2 * nbytes / statistics.median(times)


# ---------------------------------------------------------------------------------------------------- stages


def stage_env(res: dict, args) -> None:
    import transformers
    import triton

    if DEVICE == "cpu":
        device = {"gpu": "none: --smoke on the CPU", "memory_gib": 0, "sm": "-", "multiprocessors": os.cpu_count()}
    else:
        props = torch.cuda.get_device_properties(0)
        device = {
            "gpu": props.name,
            "memory_gib": round(props.total_memory / 2**30, 1),
            "sm": f"{props.major}.{props.minor}",
            "multiprocessors": props.multi_processor_count,
        }
    res["env"] = {
        **device,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "transformers": transformers.__version__,
        "python": sys.version.split()[0],
        "copy_bandwidth_GBps": round(copy_bandwidth() / 1e9, 1),
    }
    log(f"env: {res['env']}")


def stage_tests(res: dict, args) -> None:
    if DEVICE == "cpu":
        res["tests"] = {"returncode": 0, "summary": "skipped with --smoke (CI runs these files)", "seconds": 0}
        return
    env = dict(os.environ, KVSERVE_TEST_TOKENIZER="synthetic", PYTHONPATH=os.pathsep.join([ROOT, *sys.path[1:]]))
    env.pop("TRITON_INTERPRET", None)
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "--durations=10",
        "-p",
        "no:cacheprovider",
        *(args.tests or [*KERNEL_TESTS, *GPU_PARTS_TESTS]),
    ]
    log("tests: " + " ".join(cmd))
    if DEVICE == "cuda":
        release_memory()
    # pytest writes straight to a file under --out, so a run cut short by its timeout still leaves its log.
    log_path = os.path.join(args.out, "gpu_suite-tests.log")
    start = time.perf_counter()
    with open(log_path, "w") as log_file:
        try:
            returncode = subprocess.run(
                cmd, cwd=ROOT, env=env, stdout=log_file, stderr=subprocess.STDOUT, timeout=args.tests_timeout
            ).returncode
        except subprocess.TimeoutExpired:
            returncode = f"timed out after {args.tests_timeout} s"
    with open(log_path) as f:
        output = f.read()
    print(output[-6000:], flush=True)
    summary = [line for line in output.splitlines() if " passed" in line or " failed" in line or "error" in line]
    res["tests"] = {
        "returncode": returncode,
        "summary": summary[-1] if summary else "(no summary)",
        "seconds": round(time.perf_counter() - start, 1),
    }


@torch.inference_mode()
def hf_greedy(model, prompt: list[int], num_tokens: int) -> list[int]:
    """HF greedy decoding with its own KV cache, one token at a time, on the model's device."""
    device = next(model.parameters()).device
    out = model(torch.tensor([prompt], device=device), use_cache=True)
    past, tokens = out.past_key_values, []
    nxt = out.logits[0, -1].argmax()
    for i in range(num_tokens):
        tokens.append(int(nxt))
        if i == num_tokens - 1:
            break
        out = model(nxt.view(1, 1), past_key_values=past, use_cache=True)
        past, nxt = out.past_key_values, out.logits[0, -1].argmax()
    return tokens


def parity_prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)

    def toks(n: int) -> list[int]:
        return [rng.randrange(3, 49000) for _ in range(n)]

    shared = toks(40)
    return [shared + toks(9), toks(5), shared + toks(23), toks(17), toks(100), shared[:33] + toks(2)]


def first_divergence(got: list[int], want: list[int]) -> int | None:
    for i, (g, w) in enumerate(zip(got, want, strict=False)):
        if g != w:
            return i
    return None if len(got) == len(want) else min(len(got), len(want))


def stage_parity(res: dict, args) -> None:
    import transformers

    from kvserve import LLM, SamplingParams
    from kvserve.benchmarks.synthetic import synthetic_tokenizer
    from tests.conftest import TINY_MODELS, build_tiny_model

    tokenizer = synthetic_tokenizer(49152)
    tmp = tempfile.mkdtemp(prefix="kvserve-parity-")
    out: dict = {}
    res["parity"] = out  # filled model by model: a later failure keeps the rows before it
    smoke = DEVICE == "cpu"
    names = list(TINY_MODELS)[: args.parity_models or None]
    for name in names[:2] if smoke else names:
        folder = build_tiny_model(name, os.path.join(tmp, name), tokenizer)
        prompts = parity_prompts(len(name))
        row: dict = {}
        for dtype, num_tokens in (("float32", 8 if smoke else 32), ("bfloat16", 8 if smoke else 64)):
            if dtype not in args.parity_dtypes:
                continue
            hf = transformers.AutoModelForCausalLM.from_pretrained(
                folder, dtype=getattr(torch, dtype), attn_implementation="eager"
            )
            hf = hf.to(DEVICE).eval()
            refs = [hf_greedy(hf, p, num_tokens) for p in prompts]
            del hf
            if not smoke:
                torch.cuda.empty_cache()
            params = SamplingParams(temperature=0.0, max_tokens=num_tokens, ignore_eos=True)
            # Async scheduling must not change a token: checked where parity is exact (fp32).
            modes = ("graphs", "eager", "graphs-async") if dtype == "float32" else ("graphs", "eager")
            for mode in modes:
                try:
                    llm = LLM(
                        folder,
                        dtype=dtype,
                        device=DEVICE,
                        max_model_len=512,
                        max_num_seqs=16,
                        kv_cache_memory=1 << 30,
                        enforce_eager=mode == "eager",
                        async_scheduling=mode.endswith("-async"),
                    )
                except ValueError as e:  # a model this device refuses (e.g. sliding window on the GPU)
                    if "do not combine" not in str(e):
                        raise
                    row[f"{dtype}-{mode}"] = {"identical": None, "refused": str(e)[:300]}
                    continue
                outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
                divs = [first_divergence(o.outputs[0].token_ids, r) for o, r in zip(outs, refs, strict=True)]
                key = f"{dtype}-{mode}"
                row[key] = {"identical": all(d is None for d in divs), "first_divergence": divs}
                llm.shutdown()
                del llm
                release_memory()
        out[name] = row
        log(
            f"parity {name}: "
            + ", ".join(
                f"{k} identical={v['identical']} {v.get('first_divergence', 'refused')}" for k, v in row.items()
            )
        )
    res["parity"] = out


def decode_step_time(llm, prompt: list[int], short: int, long: int) -> float:
    """Seconds per decode step of one request: the difference of two greedy runs of `short` and `long` output
    tokens (same prompt, so prefill and start-up cancel), best of two."""
    from kvserve import SamplingParams

    def run(n: int) -> float:
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        start = time.perf_counter()
        llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
        return time.perf_counter() - start

    run(16)
    t_short = min(run(short) for _ in range(2))
    t_long = min(run(long) for _ in range(2))
    return (t_long - t_short) / (long - short)


def weights_read_per_step(model) -> int:
    """Bytes of weights a decode step reads: every parameter, except the embedding table when the LM head has its
    own (a lookup reads one row of it)."""
    embed = model.model.embed_tokens.weight
    tied = model.lm_head.weight is embed
    seen, total = set(), 0
    for p in model.parameters():
        if p.data_ptr() in seen or (p is embed and not tied):
            continue
        seen.add(p.data_ptr())
        total += p.numel() * p.element_size()
    return total


def step_breakdown(llm, prompt: list[int], num_tokens: int, graphs: bool) -> dict:
    """Where a decode step's time goes: the engine's phase timer per step (host clocks; `sample` waits for the GPU),
    and with graphs the GPU time of the batch-1 graph replay plus the LM head alone, back to back (CUDA events),
    so that step time minus GPU time is host work the GPU waits for."""
    from kvserve import SamplingParams

    core = llm.engine.engine_core
    timer, runner = core.timer, core.executor.driver_runner
    timer.enabled = True
    timer.reset()
    start = time.perf_counter()
    llm.generate(
        [{"prompt_token_ids": prompt}],
        SamplingParams(temperature=0.0, max_tokens=num_tokens, ignore_eos=True),
        use_tqdm=False,
    )
    wall = time.perf_counter() - start
    timer.enabled = False
    out = {
        "phase_ms_per_step": {k: round(v / timer.steps * 1e3, 3) for k, v in sorted(timer.seconds.items())},
        "wall_ms_per_step": round(wall / timer.steps * 1e3, 3),
    }
    timer.reset()
    if not graphs or DEVICE != "cuda" or runner.graphs is None or 1 not in runner.graphs.graphs:
        return out
    graph = runner.graphs.graphs[1]
    hidden = runner.graphs.outputs[1][:1]

    def gpu_ms(fn, iters: int = 50) -> float:
        fn()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / iters

    with torch.inference_mode():
        out["gpu_graph_replay_ms"] = round(gpu_ms(graph.replay), 3)
        out["gpu_lm_head_ms"] = round(gpu_ms(lambda: runner.model.compute_logits(hidden)), 3)
        try:  # a diagnosis only: its failure must not cost the stage's figures
            out["kernels"] = kernel_profile(runner)
        except Exception as e:
            out["kernels_error"] = repr(e)
    return out


def kernel_profile(runner, iters: int = 10) -> list[dict]:
    """GPU time per kernel of the batch-1 decode forward (the graph's kernels, launched eagerly under the
    profiler), largest first: which kernels keep a step off the roofline."""
    from torch.profiler import ProfilerActivity, profile

    g = runner.graphs
    ids, pos, metadata = g.tokens[0, :1], g.tokens[1, :1], g.metadata[1]
    runner.model(ids, pos, runner.kv_caches, metadata)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            runner.model(ids, pos, runner.kv_caches, metadata)
        torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        total_us = getattr(e, "device_time_total", 0) or getattr(e, "cuda_time_total", 0)
        if total_us > 0 and e.count:
            rows.append(
                {"kernel": e.key[:90], "us_per_step": round(total_us / iters, 1), "calls_per_step": e.count // iters}
            )
    rows.sort(key=lambda r: -r["us_per_step"])
    return rows[:20]


def stage_roofline(res: dict, args) -> None:
    from kvserve.benchmarks.synthetic import write_model_folder

    bandwidth = res.get("env", {}).get("copy_bandwidth_GBps", 0) * 1e9 or copy_bandwidth()
    folder = write_model_folder(tempfile.mkdtemp(prefix="kvserve-llama3-8b-"), shape("llama3-8b"))
    prompt = [100 + i for i in range(128)]
    out: dict = {"model": "llama3-8b shape, random bf16 weights", "copy_bandwidth_GBps": round(bandwidth / 1e9, 1)}
    for mode in args.roofline_modes:
        graphs = mode != "eager"
        llm = mode_engine(folder, mode, max_num_seqs=8)
        runner = llm.engine.engine_core.executor.driver_runner
        weight_bytes = weights_read_per_step(runner.model)
        step = decode_step_time(llm, prompt, args.roofline_short, args.roofline_long)
        floor = weight_bytes / bandwidth
        key = mode
        out[key] = {
            "step_ms": round(step * 1e3, 3),
            "weight_GB": round(weight_bytes / 1e9, 3),
            "roofline_ms": round(floor * 1e3, 3),
            "fraction_of_roofline": round(floor / step, 3),
            "tokens_per_s": round(1 / step, 1),
            "batch1_linears": {
                "x".join(map(str, key[:2])) + ("+bias" if key[3] else "") + ("+silu" if "silu" in key else ""): {
                    "choice": repr(v["choice"]) if v["choice"] else "cublas",
                    **({"silu_choice": repr(v["silu_choice"])} if "silu_choice" in v else {}),
                    "us": v["us"],
                }
                for key, v in runner.gemv_choices.items()
            },
        }
        out[key].update(step_breakdown(llm, prompt, args.roofline_long, graphs))
        log(f"roofline {key}: {out[key]}")
        llm.shutdown()
        del llm, runner
        release_memory()
    res["roofline"] = out


def tok_s(row: dict) -> float:
    """A mode's output tok/s: the median of its runs where it ran several times (record_run)."""
    return row.get("median_output_tok_s", row["output_tok_s"])


def stage_throughput(res: dict, args) -> None:
    import transformers

    from kvserve.benchmarks.datasets import DatasetSpec, build_dataset
    from kvserve.benchmarks.synthetic import hf_config, write_model_folder
    from kvserve.benchmarks.throughput import run_hf, run_kvserve

    folder = write_model_folder(tempfile.mkdtemp(prefix="kvserve-qwen3-0.6b-"), shape("qwen3-0.6b"))
    vocab = hf_config(shape("qwen3-0.6b")).vocab_size
    lengths = (8, 32) if DEVICE == "cpu" else (100, 1024)
    spec = DatasetSpec("random", num_requests=args.num_requests, seed=0, input_len=lengths, output_len=lengths)
    requests = build_dataset(spec, vocab)
    warm = build_dataset(DatasetSpec("random", 16, seed=1, input_len=(100, 300), output_len=(16, 64)), vocab)
    out: dict = {
        "model": "qwen3-0.6b shape, random bf16 weights",
        "workload": f"{len(requests)} requests, input/output uniform 100..1024, ignore_eos, temperature 0.6",
        "prompt_tokens": sum(r.prompt_len for r in requests),
        "output_tokens": sum(r.output_len for r in requests),
    }
    for mode in args.throughput_modes:
        llm = mode_engine(folder, mode, max_num_seqs=256, max_num_batched_tokens=args.max_num_batched_tokens)
        run_kvserve(llm, warm, "warmup", 0.6)
        timer = llm.engine.engine_core.timer
        timer.enabled = True  # a few clock reads per step: where the step goes, host phases against the GPU's
        timer.reset()
        r = run_kvserve(llm, requests, f"kvserve ({mode})", 0.6)
        timer.enabled = False
        record_run(out, r.name, {"seconds": round(r.seconds, 2), "output_tok_s": round(r.output_tokens_per_s, 1)})
        out[r.name]["steps"] = timer.steps
        out[r.name]["phase_ms_per_step"] = {
            k: round(v / max(timer.steps, 1) * 1e3, 3) for k, v in sorted(timer.seconds.items())
        }
        out[r.name]["num_preemptions"] = llm.stats().get("num_preemptions")
        log(f"throughput {r.name}: {out[r.name]}")
        if args.profile_steps and mode != "eager":
            try:  # a diagnosis only: its failure must not cost the stage's figures
                skip = 6 if DEVICE == "cpu" else args.profile_skip
                window = profile_window(llm, requests, 0.6, skip, args.profile_steps, DEVICE)
                out[r.name]["profile_window"] = window
                log(f"throughput {r.name} profiled window: {window}")
            except Exception as e:
                out[r.name]["profile_window_error"] = repr(e)
        llm.shutdown()
        del llm
        release_memory()
    if "kvserve (graphs)" in out and "kvserve (graphs-async)" in out:
        out["speedup_async_vs_graphs"] = round(tok_s(out["kvserve (graphs-async)"]) / tok_s(out["kvserve (graphs)"]), 3)
    res["throughput"] = out
    if args.hf_requests == 0:  # kvserve alone (a re-measure after a change; the HF ratio needs a full run)
        return
    with torch.device(DEVICE):
        hf = transformers.AutoModelForCausalLM.from_config(hf_config(shape("qwen3-0.6b")), dtype=torch.bfloat16)
    hf.eval()
    hf_requests = requests[: args.hf_requests]
    run_hf(hf, warm[:4], 4, 0, 0.6)
    for bs in args.hf_batch_sizes:
        r = run_hf(hf, hf_requests, bs, 0, 0.6)
        out[r.name] = {
            "seconds": round(r.seconds, 2),
            "output_tok_s": round(r.output_tokens_per_s, 1),
            "num_requests": len(hf_requests),
        }
        log(f"throughput {r.name}: {out[r.name]}")
    best_hf = max(v["output_tok_s"] for k, v in out.items() if k.startswith("hf-generate"))
    if "kvserve (graphs)" in out:
        out["speedup_graphs_vs_best_hf"] = round(out["kvserve (graphs)"]["output_tok_s"] / best_hf, 2)
        if "kvserve (eager)" in out:
            out["speedup_graphs_vs_eager"] = round(
                out["kvserve (graphs)"]["output_tok_s"] / out["kvserve (eager)"]["output_tok_s"], 2
            )


def stage_breakdown(res: dict, args) -> None:
    from gpu_breakdown import stage_breakdown as run

    bandwidth = res.get("env", {}).get("copy_bandwidth_GBps", 0) * 1e9 or copy_bandwidth()
    run(res, args, DEVICE, log, bandwidth, shape, weights_read_per_step)
    release_memory()


def stage_serve(res: dict, args) -> None:
    from gpu_serve import stage_serve as run

    run(res, args, DEVICE, log, shape)


# ---------------------------------------------------------------------------------------------------- main


def breakdown_summary(b: dict) -> list[str]:
    f = b["floors"]
    lines = [
        f"breakdown qwen3-0.6b decode step, batch {b['batch']}, contexts {b['contexts']}: floor {f['floor_ms']} ms "
        f"(bytes {f['bytes_ms']} ms: weights {f['weight_GB']} + KV {f['kv_GB']} + logits {f['logits_GB']} GB at "
        f"{f['copy_GBps']} GB/s; FLOPs {f['flops_ms']} ms at {f['matmul_TFLOPs']} TFLOP/s)"
    ]
    for variant in ("before", "after"):
        r = b.get(variant)
        if r:
            lines.append(
                f"  {variant}: GPU {r['gpu_step_ms']} ms = forward {r['forward_ms']} + LM head {r['lm_head_ms']} + "
                f"draw {r['sample_ms']} ({r['of_floor']:.0%} of floor); kernels by category (us): "
                f"{r.get('by_category_us')}"
            )
    for key in ("attention_one_layer", "attention_one_layer_batch1"):
        a = b.get(key)
        if a:
            lines.append(f"  one layer's decode attention, batch {a['batch']} ({a['bytes_MB']} MB of KV):")
            for v in a["variants"]:
                cell = f"{v['us']} us, {v['GBps']} GB/s" if "us" in v else f"error {v['error'][:80]}"
                lines.append(f"    {v['variant']}: {cell}")
    return lines


def runs_note(row: dict) -> str:
    """A repeated mode's runs (record_run), for the summary: the last run's figures come before it."""
    if "runs" not in row:
        return ""
    return f" (last of {len(row['runs'])} runs: {row['runs']}, median {row['median_output_tok_s']})"


def summary(res: dict) -> str:
    lines = ["", "==== gpu_suite summary ===="]
    if "env" in res:
        e = res["env"]
        lines.append(
            f"{e['gpu']} ({e['memory_gib']} GiB, sm {e['sm']}), torch {e['torch']}, triton {e['triton']}, "
            f"copy {e['copy_bandwidth_GBps']} GB/s"
        )
    if "tests" in res:
        lines.append(f"tests: rc={res['tests']['returncode']} {res['tests']['summary']}")
    if "parity" in res:
        for name, row in res["parity"].items():
            cells = " ".join(
                f"{k}={'same' if v['identical'] else v.get('first_divergence', 'refused')}" for k, v in row.items()
            )
            lines.append(f"parity {name}: {cells}")
    if "roofline" in res:
        for key in ROOFLINE_MODES:
            r = res["roofline"].get(key)
            if r:
                lines.append(
                    f"roofline llama3-8b {key}: {r['step_ms']} ms/step vs {r['roofline_ms']} ms floor = "
                    f"{r['fraction_of_roofline']:.1%} ({r['tokens_per_s']} tok/s)"
                )
                gpu = (
                    f"; GPU: graph {r['gpu_graph_replay_ms']} + LM head {r['gpu_lm_head_ms']}"
                    if "gpu_lm_head_ms" in r
                    else ""
                )
                lines.append(f"  ms/step by phase: {r['phase_ms_per_step']} of {r['wall_ms_per_step']}{gpu}")
                for k in r.get("kernels", [])[:12]:
                    lines.append(f"    {k['us_per_step']:>8} us  x{k['calls_per_step']:<4} {k['kernel']}")
    if "throughput" in res:
        for k, v in res["throughput"].items():
            if isinstance(v, dict):
                lines.append(f"throughput {k}: {v['output_tok_s']} output tok/s in {v['seconds']} s{runs_note(v)}")
                if "phase_ms_per_step" in v:
                    lines.append(f"  {v.get('steps')} steps, ms/step by phase: {v['phase_ms_per_step']}")
                w = v.get("profile_window")
                if w:
                    lines.append(
                        f"  window: {w['wall_ms_per_step']} ms/step wall, GPU busy {w.get('gpu_busy_ms_per_step')} "
                        f"ms ({w.get('gpu_busy_fraction')}); host top: "
                        + ", ".join(f"{h['op']} {h['ms_per_step']}" for h in w["host_top"][:6])
                    )
        t = res["throughput"]
        lines.append(
            f"speedup kvserve graphs / best HF: {t.get('speedup_graphs_vs_best_hf')}x; graphs / eager: "
            f"{t.get('speedup_graphs_vs_eager')}x; async / graphs: {t.get('speedup_async_vs_graphs')}x"
        )
    if "breakdown" in res:
        lines += breakdown_summary(res["breakdown"])
    if "serve" in res:
        for mode, r in res["serve"].items():
            if not isinstance(r, dict):
                continue
            if "error" in r:
                lines.append(f"serve {mode}: ERROR {r['error'][:200]}")
                continue
            lines.append(
                f"serve {mode}: {r['output_tok_s']} output tok/s, {r['completed']} done, {r['errors']} errors; TTFT "
                f"p50/p99 {r['ttft_ms']['median']}/{r['ttft_ms']['p99']} ms; ITL p50/p99 {r['itl_ms']['median']}/"
                f"{r['itl_ms']['p99']} ms (x{r['itl_p99_over_p50']}), >100 ms: {r['itl_over_100ms']} of "
                f"{r['num_itls']}, top {r['itl_top_ms'][-3:]}; Triton compiles while serving: "
                f"{r['triton_compiled_while_serving']}{runs_note(r)}"
            )
    for stage, err in res.get("errors", {}).items():
        lines.append(f"ERROR in {stage}: {err.splitlines()[-1] if err else ''}")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("stages", nargs="+", help=f"stages ({', '.join(STAGES)}) or groups ({', '.join(GROUPS)})")
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument(
        "--hf-requests",
        type=int,
        default=128,
        help="requests HF generate runs: a prefix of the set (all 256 take HF ~5 min on an H100, more than the "
        "perf group has left in a 10-minute call); 0: no HF run",
    )
    p.add_argument("--hf-batch-sizes", type=int, nargs="+", default=[64])
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--roofline-short", type=int, default=64)
    p.add_argument("--roofline-long", type=int, default=576)
    p.add_argument("--throughput-modes", nargs="+", choices=ROOFLINE_MODES, default=list(MODES))
    p.add_argument("--roofline-modes", nargs="+", choices=ROOFLINE_MODES, default=list(MODES))
    p.add_argument("--tests-timeout", type=int, default=420)
    p.add_argument("--tests", nargs="+", default=None, help="test files for the tests stage (default: all listed)")
    p.add_argument("--profile-steps", type=int, default=20, help="throughput: steps in the profiled window (0: none)")
    p.add_argument("--profile-skip", type=int, default=24, help="throughput: steps before the window (prefills)")
    p.add_argument("--breakdown-batch", type=int, default=256)
    p.add_argument("--serve-modes", nargs="+", choices=("sync", "async"), default=["sync", "async"])
    p.add_argument("--serve-requests", type=int, default=256)
    p.add_argument("--serve-concurrency", type=int, default=64)
    p.add_argument("--serve-start-timeout", type=float, default=300)
    p.add_argument("--parity-models", type=int, default=0, help="parity: the first N tiny models (0: all)")
    p.add_argument("--parity-dtypes", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--out", default=os.environ.get("OUT", "."), help="folder for gpu_suite.json")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU: checks the suite, measures nothing")
    args = p.parse_args()
    stages: list[str] = []
    for s in args.stages:
        for stage in GROUPS.get(s, (s,)):
            if stage not in STAGES:
                p.error(f"unknown stage {stage!r}")
            if stage not in stages:
                stages.append(stage)
    if args.smoke:
        global DEVICE
        DEVICE = "cpu"
        args.num_requests, args.hf_requests, args.hf_batch_sizes = 8, 8, [4]
        args.roofline_short, args.roofline_long = 8, 24
    elif not torch.cuda.is_available():
        print("gpu_suite: torch sees no CUDA GPU (--smoke runs the suite on the CPU)", file=sys.stderr)
        return 2
    res: dict = {"stages": stages, "errors": {}}
    path = os.path.join(args.out, f"gpu_suite-{'-'.join(args.stages)}.json")
    for stage in stages:
        log(f"stage {stage}")
        start = time.perf_counter()
        try:
            globals()[f"stage_{stage}"](res, args)
        except Exception:
            res["errors"][stage] = traceback.format_exc()
            print(res["errors"][stage], flush=True)
        log(f"stage {stage} took {time.perf_counter() - start:.0f}s")
        with open(path, "w") as f:
            json.dump(res, f, indent=1)
    print(summary(res), flush=True)
    return 1 if res["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())

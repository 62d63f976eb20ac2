"""gpu_suite.py's `breakdown` stage and the throughput stage's profiled window (issue 35).

- `breakdown`: one large decode step of the nano-vllm model shape (Qwen3-0.6B, batch 256, contexts uniform in
  500..2000 over a KV pool of random values), built by hand on the runner: the GPU time of the decode graph's
  replay, the LM head and the draw, each kernel's GPU time (torch.profiler over the same forward run eagerly),
  and the step's floors (bytes over the measured copy bandwidth, FLOPs over a measured bf16 matmul rate). Twice:
  "before" (decode rows through the prefill kernel, the torch Gumbel draw) and "after" (the segment decode
  kernel, the fused Triton draw). Then micro-benchmarks of one layer's decode attention in each kernel variant,
  and of the draw.
- `profile_window`: a profiled stretch of an engine run at full batch (CPU and CUDA activity), to see where the
  host blocks and how long the GPU idles between steps (the async-scheduling question).

With --smoke (the CPU) the same code runs on a tiny model in Triton's interpreter: it checks the script, not
speed.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from collections.abc import Callable

import numpy as np
import torch

QWEN_KV_BYTES_PER_TOKEN = 28 * 8 * 128 * 2 * 2  # layers x KV heads x head_dim x (K, V) x bf16: 114,688


def gpu_ms(fn: Callable[[], object], iters: int, device: str) -> float:
    """Median milliseconds of `fn` (CUDA events around each call; wall clock on the CPU), after one warm-up."""
    fn()
    times = []
    for _ in range(iters):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def matmul_rate(device: str) -> float:
    """FLOP/s of a bf16 matmul on random data (8192^3 on a GPU)."""
    n = 8192 if device == "cuda" else 256
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    ms = gpu_ms(lambda: a @ b, 10, device)
    return 2 * n**3 / (ms / 1e3)


# ---------------------------------------------------------------------------------------------------- the step


class DecodeStep:
    """A decode step of `num_reqs` requests with the given context lengths, on the runner's real KV pool (filled
    with random values): attention inputs, token ids, and the sampling metadata of the throughput workload
    (temperature 0.6, a seed per request)."""

    def __init__(self, runner, contexts: np.ndarray, seed: int = 0) -> None:
        from kvserve.attention.base import AttentionInputs
        from kvserve.sampling_params import SamplingParams
        from kvserve.worker.sampling_inputs import build_sampling_metadata

        self.runner = runner
        rng = np.random.default_rng(seed)
        bs = runner.block_size
        seq_lens = contexts + 1
        blocks_needed = -(-seq_lens // bs)
        assert int(blocks_needed.sum()) <= runner.num_blocks, "KV pool too small for the breakdown batch"
        perm = rng.permutation(runner.num_blocks)[: int(blocks_needed.sum())]
        width = int(blocks_needed.max())
        table = np.zeros((len(contexts), width), dtype=np.int32)
        start = 0
        for i, n in enumerate(blocks_needed.tolist()):
            table[i, :n] = perm[start : start + n]
            start += n
        slots = table[np.arange(len(contexts)), contexts // bs].astype(np.int64) * bs + contexts % bs
        self.inputs = AttentionInputs(
            num_decodes=len(contexts),
            query_start_loc=np.arange(len(contexts) + 1),
            seq_lens=seq_lens,
            block_table=table,
            slot_mapping=slots,
            block_size=bs,
        )
        vocab = runner.vocab_size
        self.input_ids = rng.integers(3, vocab, len(contexts)).astype(np.int64)
        self.positions = contexts.astype(np.int64)
        self.kv_tokens = int(seq_lens.sum())

        class _State:  # what build_sampling_metadata reads of a request
            def __init__(self, row: int, params) -> None:
                self.row, self.sampling_params, self.num_prompt_tokens = row, params, 1
                self.eos_token_ids = frozenset()

        class _Batch:
            num_tokens = np.full(len(contexts), 100, dtype=np.int64)

        states = [_State(i, SamplingParams(temperature=0.6, seed=i, ignore_eos=True)) for i in range(len(contexts))]
        self.sampling = build_sampling_metadata(states, _Batch(), vocab, runner.generator, device=runner.device)

    def metadata(self):
        return self.runner.attn_backend.build_metadata(self.inputs)

    def forward_eager(self) -> torch.Tensor:
        r = self.runner
        ids = torch.from_numpy(self.input_ids).to(r.device)
        pos = torch.from_numpy(self.positions).to(r.device)
        return r.model(ids, pos, r.kv_caches, self.metadata())


def fill_pool_randomly(runner) -> None:
    """Random K/V everywhere (never time on zeros), layer by layer."""
    gen = torch.Generator(device=runner.device).manual_seed(0)
    for k, v in runner.kv_caches:
        k.normal_(generator=gen)
        v.normal_(generator=gen)


def set_variant(runner, after: bool) -> None:
    """'after': segment decode kernel + fused Triton draw; 'before': decode rows through the prefill kernel (its
    split-K rule) + the torch Gumbel draw."""
    runner.attn_backend.segment_decode = after
    gumbel = runner.sampler.gumbel
    runner.sampler.fused_draw = after
    gumbel._forward_impl = getattr(gumbel, f"forward_{gumbel.impl}") if after else gumbel.forward_native


def kernel_table(prof, iters: int, top: int = 25) -> list[dict]:
    rows = []
    for e in prof.key_averages():
        total_us = getattr(e, "device_time_total", 0) or getattr(e, "cuda_time_total", 0)
        if total_us > 0 and e.count:
            rows.append(
                {
                    "kernel": e.key[:100],
                    "category": categorize(e.key),
                    "us_per_step": round(total_us / iters, 1),
                    "calls_per_step": round(e.count / iters, 1),
                }
            )
    rows.sort(key=lambda r: -r["us_per_step"])
    return rows[:top]


def categorize(name: str) -> str:
    n = name.lower()
    if "decode_segments" in n or "combine_segments" in n:
        return "attention (segment decode)"
    if "paged_attention" in n or "reduce_splits" in n:
        return "attention (prefill kernel)"
    if "rotary_write_kv" in n:
        return "rotary + KV write"
    if "write_kv" in n:
        return "KV write"
    if "gumbel" in n:
        return "sampling"
    if any(s in n for s in ("nvjet", "gemm", "cutlass", "sm90", "xmma", "splitk", "cublas")):
        return "GEMM"
    if any(s in n for s in ("rms_norm", "rotary", "silu")):
        return "element-wise (Triton)"
    if "memcpy" in n or "memset" in n:
        return "copies"
    return "other torch kernels"


def profile_kernels(fn: Callable[[], object], iters: int, device: str) -> tuple[list[dict], dict[str, float]]:
    """Per-kernel GPU time of `fn` (us per call), and the sum per category."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    if device == "cuda":
        torch.cuda.synchronize()
    activities = [ProfilerActivity.CUDA] if device == "cuda" else [ProfilerActivity.CPU]
    with profile(activities=activities) as prof:
        for _ in range(iters):
            fn()
        if device == "cuda":
            torch.cuda.synchronize()
    table = kernel_table(prof, iters, top=1000)
    by_cat: dict[str, float] = {}
    for row in table:
        by_cat[row["category"]] = round(by_cat.get(row["category"], 0.0) + row["us_per_step"], 1)
    return table[:25], dict(sorted(by_cat.items(), key=lambda kv: -kv[1]))


def captured(fn: Callable[[], torch.Tensor], device: str) -> Callable[[], torch.Tensor]:
    """`fn` captured as a CUDA graph (its inputs fixed), returned as a replay that gives the output; on the CPU,
    `fn` itself."""
    if device != "cuda":
        return fn
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()

    def replay() -> torch.Tensor:
        graph.replay()
        return out

    return replay


def repeated_in_graph(fn: Callable[[], object], device: str, repeats: int = 20) -> tuple[Callable[[], None], int]:
    """`fn` called `repeats` times inside one captured CUDA graph, so that a timing of the replay divided by
    `repeats` is the GPU time per call without the host's launch overhead (which at batch 1 is larger than the
    kernels themselves). On the CPU: `fn` once."""
    if device != "cuda":
        return fn, 1
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(repeats):
            fn()
    return graph.replay, repeats


def stage_breakdown(
    res: dict,
    args,
    device: str,
    log: Callable[[str], None],
    bandwidth: float,
    shape: Callable[[str], str],
    weights_read_per_step: Callable[[torch.nn.Module], int],
) -> None:
    from kvserve import LLM
    from kvserve.attention.triton_decode import DecodeConfig
    from kvserve.benchmarks.synthetic import write_model_folder

    smoke = device == "cpu"
    folder = write_model_folder(tempfile.mkdtemp(prefix="kvserve-breakdown-"), shape("qwen3-0.6b"))
    num_reqs = 4 if smoke else args.breakdown_batch
    lo, hi = (5, 40) if smoke else (500, 2000)
    rng = np.random.default_rng(0)
    contexts = rng.integers(lo, hi + 1, num_reqs)
    kv_bytes_needed = int((contexts + 17).sum()) * (QWEN_KV_BYTES_PER_TOKEN if not smoke else 2 * 2 * 16 * 2 * 4)
    llm = LLM(
        folder,
        load_format="dummy",
        dtype="bfloat16" if not smoke else "float32",
        device=device,
        max_model_len=2048,
        max_num_seqs=256 if not smoke else 8,
        kv_cache_memory=int(kv_bytes_needed * 1.25) + (64 << 20),
        attention_backend="triton",
        kv_prefault="off",
    )
    runner = llm.engine.engine_core.executor.driver_runner
    fill_pool_randomly(runner)
    step = DecodeStep(runner, contexts)
    model = runner.model
    arch = llm.engine.config.model.arch
    iters = 3 if smoke else 20
    out: dict = {
        "model": "qwen3-0.6b shape, random bf16 weights and KV",
        "batch": num_reqs,
        "contexts": f"uniform {lo}..{hi}, mean {float(contexts.mean()):.0f}",
        "kv_tokens": step.kv_tokens,
    }
    # ---- floors
    weight_bytes = weights_read_per_step(model)
    kv_per_token = 2 * arch.num_hidden_layers * arch.num_key_value_heads * arch.head_dim * 2
    kv_bytes = step.kv_tokens * kv_per_token
    logits_bytes = num_reqs * arch.vocab_size * (2 + 2)  # bf16 logits written by the LM head, read by the draw
    params = sum(p.numel() for p in model.parameters())  # tied: the embedding is the LM head
    attn_flops = 4 * arch.num_attention_heads * arch.head_dim * step.kv_tokens * arch.num_hidden_layers
    flops = 2 * params * num_reqs + attn_flops
    rate = matmul_rate(device)
    floor_bytes_ms = (weight_bytes + kv_bytes + logits_bytes) / bandwidth * 1e3
    floor_flops_ms = flops / rate * 1e3
    out["floors"] = {
        "weight_GB": round(weight_bytes / 1e9, 3),
        "kv_GB": round(kv_bytes / 1e9, 3),
        "logits_GB": round(logits_bytes / 1e9, 3),
        "GFLOP": round(flops / 1e9, 1),
        "copy_GBps": round(bandwidth / 1e9, 1),
        "matmul_TFLOPs": round(rate / 1e12, 1),
        "bytes_ms": round(floor_bytes_ms, 3),
        "flops_ms": round(floor_flops_ms, 3),
        "floor_ms": round(max(floor_bytes_ms, floor_flops_ms), 3),
    }
    log(f"breakdown floors: {out['floors']}")

    for variant in ("before", "after"):
        set_variant(runner, variant == "after")
        row: dict = {}
        with torch.inference_mode():
            # The forward captured as a graph with this variant's kernels (metadata built once, outside).
            md = step.metadata()
            ids = torch.from_numpy(step.input_ids).to(runner.device)
            pos = torch.from_numpy(step.positions).to(runner.device)
            forward = captured(lambda md=md, ids=ids, pos=pos: model(ids, pos, runner.kv_caches, md), device)
            hidden = forward()[:num_reqs]
            row["forward_ms"] = round(gpu_ms(forward, iters, device), 3)
            logits = model.compute_logits(hidden)
            row["lm_head_ms"] = round(gpu_ms(lambda h=hidden: model.compute_logits(h), iters, device), 3)
            row["sample_ms"] = round(gpu_ms(lambda x=logits: runner.sampler(x, step.sampling), iters, device), 3)
            row["gpu_step_ms"] = round(row["forward_ms"] + row["lm_head_ms"] + row["sample_ms"], 3)
            row["of_floor"] = round(out["floors"]["floor_ms"] / row["gpu_step_ms"], 3)

            def whole():
                h = step.forward_eager()[:num_reqs]
                runner.sampler(model.compute_logits(h), step.sampling)

            try:
                row["kernels"], row["by_category_us"] = profile_kernels(whole, 3 if not smoke else 1, device)
            except Exception as e:  # a diagnosis only
                row["kernels_error"] = repr(e)
            del forward, hidden, logits
        out[variant] = row
        log(f"breakdown {variant}: " + str({k: v for k, v in row.items() if k != "kernels"}))
    set_variant(runner, True)

    # ---- one layer's decode attention, per kernel variant: at this batch, and at batch 1 (a 704-token context)
    configs = (
        [DecodeConfig(32, 16)]
        if smoke
        else [
            DecodeConfig(256, 64, 4, 2),
            DecodeConfig(256, 64, 4, 3),
            DecodeConfig(256, 32, 4, 2),
            DecodeConfig(256, 64, 8, 2),
            DecodeConfig(128, 64, 4, 2),
            DecodeConfig(128, 32, 4, 3),
            DecodeConfig(512, 64, 4, 2),
            DecodeConfig(512, 64, 4, 3),
            DecodeConfig(256, 128, 8, 2),
            # Same numerics as the default (segment 256), for the batch-1 step's latency-bound launch.
            DecodeConfig(256, 128, 4, 2),
            DecodeConfig(256, 128, 8, 3),
            DecodeConfig(256, 256, 8, 2),
            DecodeConfig(256, 64, 4, 4),
            DecodeConfig(256, 64, 2, 3),
        ]
    )
    out["attention_one_layer"] = attention_variants(runner, step, configs, iters, device, log)
    step1 = DecodeStep(runner, np.array([20 if smoke else 703]), seed=1)
    out["attention_one_layer_batch1"] = attention_variants(runner, step1, configs, iters, device, log)
    res["breakdown"] = out
    llm.shutdown()  # the caller releases the memory once this frame is gone


def attention_variants(runner, step: DecodeStep, configs, iters: int, device: str, log) -> dict:
    """One layer's attention over `step`'s decode batch: the prefill kernel (the decode path before), then the
    segment kernel in each config (segments per program by the batch-size rule), and for the default config
    each program running 1, 2 or all of a request's segments. GPU time per call from a graph of 20 calls (the
    KV write included, as in a layer)."""
    from kvserve.attention.triton_decode import DecodeConfig

    backend = runner.attn_backend
    layer_kv = runner.kv_caches[0]
    num_reqs = len(step.inputs.seq_lens)
    heads, kv_heads, dim = backend.num_heads, backend.num_kv_heads, backend.head_dim
    q = torch.randn(num_reqs, heads, dim, device=device, dtype=runner.dtype)
    kv_new = torch.randn(num_reqs, kv_heads, dim, device=device, dtype=runner.dtype)
    layer_bytes = step.kv_tokens * kv_heads * dim * 2 * runner.dtype.itemsize
    default = backend.decode_config
    variants: list[tuple[str, DecodeConfig | None, int | None]] = [("prefill kernel (before)", None, None)]
    variants += [(f"seg {c.segment}/tile {c.tile_n}/w{c.num_warps}/s{c.num_stages}", c, None) for c in configs]
    for per_program in (1, 2, 64):
        variants.append((f"default, {per_program} segments per program", default, per_program))
    rows: list[dict] = []
    for name, config, programs in variants:  # programs: segments per program (None: the rule's)
        backend.segment_decode = config is not None
        if config is not None:
            backend.decode_config = config
        try:
            md = backend.build_metadata(step.inputs)
            if programs is not None:
                md.segs_per_program = min(programs, max(md.max_segments, 1))

            def call(md=md) -> None:
                backend.forward(q, kv_new, kv_new, layer_kv, md, dim**-0.5)

            with torch.inference_mode():
                replay, repeats = repeated_in_graph(call, device)
                ms = gpu_ms(replay, iters, device) / repeats
            rows.append({"variant": name, "us": round(ms * 1e3, 1), "GBps": round(layer_bytes / (ms / 1e3) / 1e9)})
        except Exception as e:  # a failing variant must not cost the others
            rows.append({"variant": name, "error": repr(e)[:300]})
        log(f"breakdown attention batch {num_reqs}: {rows[-1]}")
    backend.segment_decode, backend.decode_config = True, default
    return {"batch": num_reqs, "bytes_MB": round(layer_bytes / 1e6, 2), "variants": rows}


# ---------------------------------------------------------------------------------------------------- engine window


def profile_window(llm, requests, temperature: float, skip: int, steps: int, device: str) -> dict:
    """Run `requests` (outputs capped so the run is short) through the engine step by step, profile `steps` steps
    after the first `skip` (full-batch decodes), and finish the run. Returns wall and GPU-busy time per step, and
    the host calls that took the most time (where the host blocks)."""
    from torch.profiler import ProfilerActivity, profile

    from kvserve.sampling_params import SamplingParams
    from kvserve.utils import next_request_id

    engine = llm.engine
    cap = skip + steps + 8
    for i, r in enumerate(requests):
        params = SamplingParams(temperature=temperature, max_tokens=min(r.output_len, cap), ignore_eos=True, seed=i)
        engine.add_request(next_request_id(), {"prompt_token_ids": r.prompt_token_ids}, params)
    for _ in range(skip):
        engine.step()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    if device == "cuda":
        torch.cuda.synchronize()
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
        if device == "cuda":
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    while engine.has_unfinished_requests():
        engine.step()
    out: dict = {"steps": steps, "wall_ms_per_step": round(wall / steps * 1e3, 3)}
    # GPU busy: the union of the device intervals (kernels, copies) inside the window.
    intervals = []
    host_rows = []
    for e in prof.events():
        dev = str(getattr(e, "device_type", ""))
        if dev.endswith("CUDA"):
            intervals.append((e.time_range.start, e.time_range.end))
    if intervals:
        intervals.sort()
        busy, cur_s, cur_e = 0.0, intervals[0][0], intervals[0][1]
        for s, e in intervals[1:]:
            if s > cur_e:
                busy += cur_e - cur_s
                cur_s, cur_e = s, e
            else:
                cur_e = max(cur_e, e)
        busy += cur_e - cur_s
        span = intervals[-1][1] - intervals[0][0]
        out["gpu_busy_ms_per_step"] = round(busy / 1e3 / steps, 3)
        out["gpu_span_ms_per_step"] = round(span / 1e3 / steps, 3)
        out["gpu_busy_fraction"] = round(busy / max(span, 1e-9), 3)
    for e in prof.key_averages():
        self_cpu = getattr(e, "self_cpu_time_total", 0)
        if self_cpu > 0:
            host_rows.append({"op": e.key[:60], "ms_per_step": round(self_cpu / 1e3 / steps, 3), "calls": e.count})
    host_rows.sort(key=lambda r: -r["ms_per_step"])
    out["host_top"] = host_rows[:14]
    return out

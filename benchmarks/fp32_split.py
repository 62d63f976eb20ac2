"""Where kvserve's time goes, by layer kind: batch 1 (16-token prompt, 128 decode steps) and issue 34's offline
workload (64 random requests, prompts 64-384, outputs 32-160), 2 threads.

    python benchmarks/fp32_split.py [float32|bfloat16]

Each is run twice: as production runs it (the fused batch-1 layer included), then through the module path with
each layer kind's entry point timed (`roofline._op_timers`, which turns the fused layer off) and, offline, the
engine's step phases. The split is of the timed run; its total is printed beside the production one.
"""

import sys

from kvserve.benchmarks.datasets import DatasetSpec, build_dataset
from kvserve.benchmarks.roofline import _op_timers, decode_throughput
from kvserve.benchmarks.throughput import run_kvserve
from kvserve.engine.arg_utils import EngineArgs
from kvserve.engine.llm import LLM

dtype = sys.argv[1] if len(sys.argv) > 1 else "float32"
llm = LLM.from_engine_args(EngineArgs(dtype=dtype, num_threads=2))
llm.engine.engine_core.executor.collective_rpc("prefault_kv_cache")
core = llm.engine.engine_core
decode_throughput(llm, 1, 16, 8, seed=-1)
p = decode_throughput(llm, 1, 16, 128, seed=0)
print(f"batch 1 production path: {p.seconds / p.decode_steps * 1e3:.2f} ms/step")
with _op_timers() as ops:
    p = decode_throughput(llm, 1, 16, 128, seed=1)
step = p.seconds / p.decode_steps
print(f"batch 1 module path (timed): {step * 1e3:.2f} ms/step")
for k, v in sorted(ops.items(), key=lambda kv: -kv[1]):
    print(f"  {k:<14}{v / p.decode_steps * 1e3:7.2f} ms/step {v / p.seconds:6.1%}")
rest = p.seconds - sum(ops.values())
print(
    f"  {'rest':<14}{rest / p.decode_steps * 1e3:7.2f} ms/step {rest / p.seconds:6.1%}"
    "  (embedding, sampling, Python, scheduler)"
)

vocab = llm.engine.config.model.arch.vocab_size
reqs = build_dataset(DatasetSpec("random", 64, 0, (64, 384), (32, 160)), vocab)
warm = build_dataset(DatasetSpec("random", 8, 1, (64, 128), (8, 16)), vocab)
run_kvserve(llm, warm, "warm")
r = run_kvserve(llm, reqs, "offline")
print(f"offline production path: {r.seconds:.1f} s, {r.output_tokens_per_s:.1f} out tok/s")
llm.reset_prefix_cache()
core.timer.reset()
core.timer.enabled = True
with _op_timers() as ops:
    r = run_kvserve(llm, reqs, "offline")
core.timer.enabled = False
print(
    f"offline module path (timed): {r.seconds:.1f} s, {r.output_tokens_per_s:.1f} out tok/s, {core.timer.steps} steps"
)
for k, v in core.timer.seconds.items():
    print(f"  phase {k:<12}{v:7.2f} s {v / r.seconds:6.1%}")
for k, v in sorted(ops.items(), key=lambda kv: -kv[1]):
    print(f"  op {k:<14}{v:7.2f} s {v / r.seconds:6.1%}")

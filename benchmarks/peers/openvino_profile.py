"""OpenVINO's batch-1 decode, per node type: the stateful IR compiled with PERF_COUNT, a 16-token prompt, then 128
greedy steps of one token (the second of two passes counts), 2 threads. Run it with the OpenVINO environment:

    .venv-openvino/bin/python benchmarks/peers/openvino_profile.py IR_DIR/openvino_model.xml f32|bf16|default

This drives the IR directly (not through openvino_genai's LLMPipeline, which hides its infer request), so the
"wall" figure includes this script's own feeding and argmax; the node times are OpenVINO's.
"""

import collections
import sys
import time

import numpy as np
import openvino as ov

path, hint = sys.argv[1], sys.argv[2]
steps = 128
c = ov.Core()
props = {"INFERENCE_NUM_THREADS": "2", "PERF_COUNT": "YES"}
if hint != "default":
    props["INFERENCE_PRECISION_HINT"] = hint
m = c.compile_model(path, "CPU", props)
r = m.create_infer_request()


def run(ids, pos):
    n = len(ids)
    r.infer(
        {
            "input_ids": np.array([ids], np.int64),
            "attention_mask": np.ones((1, pos + n), np.int64),
            "position_ids": np.arange(pos, pos + n, dtype=np.int64)[None],
            "beam_idx": np.zeros(1, np.int32),
        }
    )
    return int(r.get_tensor("logits").data[0, -1].argmax())


for _pass in range(2):
    r.reset_state()
    tok = run(list(range(1000, 1016)), 0)
    totals = collections.Counter()
    t0 = time.perf_counter()
    for s in range(steps):
        tok = run([tok], 16 + s)
        for p in r.profiling_info:
            totals[p.node_type] += p.real_time.total_seconds()
    wall = time.perf_counter() - t0
tot = sum(totals.values())
print(
    f"{path} hint={hint}: {steps} steps, {wall / steps * 1e3:.2f} ms/step wall, "
    f"{tot / steps * 1e3:.2f} ms/step in nodes"
)
for k, v in totals.most_common(12):
    print(f"  {k:<28}{v / steps * 1e3:8.3f} ms/step {v / tot:6.1%}")

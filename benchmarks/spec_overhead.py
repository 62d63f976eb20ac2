"""What speculation with the cost-aware policy adds to a step where it does not pay, phase by phase.

    PYTHONPATH=. python benchmarks/spec_overhead.py [--proposer draft|eagle|eagle-tree|ngram] [--batch 1] \\
        [--workload chat] [--output-len 128] [--pairs 2] [--head DIR] [--draft-vocab-size N] \\
        [--draft-quantization int8] [--quantization int8]

Two engines in one process, speculation off and on (greedy), run in ABBA order on the same requests; each run
prints its output tok/s and the engine's phase timer (ms per phase: schedule, prepare_inputs, forward, logits,
sample, propose, update), and at the end the proposer's own calls split into steps where every request was left
out ("asleep": the bookkeeping) and steps that drafted (probes and granted drafts), with their mean cost. The
grid's ratios (benchmarks/spec_policy.py) say whether speculation loses; this says where the time goes.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict

from benchmarks.spec_policy import PROPOSERS
from kvserve.benchmarks.datasets import DatasetSpec, build_dataset
from kvserve.benchmarks.throughput import run_kvserve
from kvserve.engine.arg_utils import EngineArgs
from kvserve.engine.llm import LLM
from kvserve.spec_decode.model_proposer import ModelProposer


def time_proposer_calls() -> dict[str, list[float]]:
    """Wrap ModelProposer.propose to time each call, keyed by whether any request drafted (n-gram: none)."""
    calls: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    propose = ModelProposer.propose

    def timed(self, step):
        start = time.perf_counter()
        out = propose(self, step)
        key = "asleep" if step.awake is not None and not step.awake.any() else "drafting"
        calls[key][0] += 1
        calls[key][1] += time.perf_counter() - start
        return out

    ModelProposer.propose = timed
    return calls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--proposer", choices=list(PROPOSERS), default="draft")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--workload", choices=["chat", "random"], default="chat")
    ap.add_argument("--num-requests", type=int, default=None, help="default: max(batch, 3) x 2")
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--pairs", type=int, default=2, help="ABBA rounds (each: off, on, on, off)")
    ap.add_argument("--head", default=None, help="the EAGLE head's folder")
    ap.add_argument("--draft-vocab-size", type=int, default=0)
    ap.add_argument("--draft-quantization", default=None)
    ap.add_argument("--quantization", default=None, help="the target's weights (int8), both engines")
    ns = ap.parse_args()
    config = dict(PROPOSERS[ns.proposer])
    if ns.proposer.startswith("eagle"):
        config.update({"model": ns.head} if ns.head else {})
        config.update({"draft_vocab_size": ns.draft_vocab_size} if ns.draft_vocab_size else {})
        config.update({"quantization": ns.draft_quantization} if ns.draft_quantization else {})
    calls = time_proposer_calls()
    base = {"max_num_seqs": ns.batch, "quantization": ns.quantization}
    engines = {
        "off": LLM.from_engine_args(EngineArgs(**base)),
        "on": LLM.from_engine_args(EngineArgs(**base, speculative_config=config)),
    }
    off = engines["off"]
    tokenizer = off.get_tokenizer() if ns.workload == "chat" else None
    vocab = off.engine.config.model.arch.vocab_size
    n = ns.num_requests or max(ns.batch, 3) * 2
    requests = build_dataset(
        DatasetSpec(ns.workload, n, 0, (64, 128), (ns.output_len, ns.output_len)), vocab, tokenizer
    )
    warm = build_dataset(DatasetSpec(ns.workload, 3, 1, (64, 128), (16, 16)), vocab, tokenizer)
    for llm in engines.values():
        run_kvserve(llm, warm, "warm-up", temperature=0)
    calls.clear()
    rates: dict[str, list[float]] = {"off": [], "on": []}
    for name in ["off", "on", "on", "off"] * ns.pairs:
        core = engines[name].engine.engine_core
        core.timer.reset()
        core.timer.enabled = True
        result = run_kvserve(engines[name], requests, name, temperature=0)
        core.timer.enabled = False
        rates[name].append(result.output_tokens_per_s)
        phases = {k: round(v * 1e3, 1) for k, v in sorted(core.timer.seconds.items())}
        print(f"{name:3} {result.output_tokens_per_s:7.1f} tok/s  phases (ms): {phases}", flush=True)
    for key, (count, seconds) in sorted(calls.items()):
        print(f"proposer calls {key}: {count}, {seconds * 1e3:.1f} ms, {seconds / count * 1e6:.1f} us each")
    print(f"on / off (medians): {statistics.median(rates['on']) / statistics.median(rates['off']):.3f}x")


if __name__ == "__main__":
    main()

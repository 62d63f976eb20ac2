"""cProfile of one batch-64 offline run with speculation (the cost-aware policy on) and one without: where the
host time of a policy that verifies (almost) nothing goes. Random-token prompts (64-128 tokens), 48-64 greedy tokens
each, at most 64 requests at a time, prefix caching off; a short warm-up first. Prints tok/s and the top functions;
keeps each profile for `pstats` in /tmp/spec-host-profile-MODE.prof.

    PYTHONPATH=. .venv/bin/python benchmarks/spec_host_profile.py off | tree | chain [num_requests]
"""

from __future__ import annotations

import cProfile
import io
import pstats
import random
import sys
import time

from kvserve import LLM, SamplingParams

SPEC = {
    "off": None,
    "tree": {"method": "eagle", "tree_depth": 4, "tree_topk": 4, "tree_num_nodes": 12},
    "chain": {"method": "eagle", "num_speculative_tokens": 4},
}


def requests(n: int, seed: int) -> tuple[list[dict], list[SamplingParams]]:
    rng = random.Random(seed)
    prompts = [
        {"prompt_token_ids": [rng.randrange(100, 49152) for _ in range(rng.randrange(64, 129))]} for _ in range(n)
    ]
    params = [SamplingParams(temperature=0, max_tokens=rng.randrange(48, 65), ignore_eos=True) for _ in range(n)]
    return prompts, params


def main() -> None:
    mode = sys.argv[1]
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 64
    llm = LLM(speculative_config=SPEC[mode], max_num_seqs=n, enable_prefix_caching=False)
    prompts, params = requests(8, 1)
    llm.generate(prompts, params, use_tqdm=False)
    prompts, params = requests(n, 2)
    profile = cProfile.Profile()
    started = time.perf_counter()
    profile.enable()
    outs = llm.generate(prompts, params, use_tqdm=False)
    profile.disable()
    seconds = time.perf_counter() - started
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    print(f"{mode}: {tokens} tokens in {seconds:.2f} s = {tokens / seconds:.1f} tok/s")
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(25)
    print(text.getvalue())
    profile.dump_stats(f"/tmp/spec-host-profile-{mode}.prof")


if __name__ == "__main__":
    main()

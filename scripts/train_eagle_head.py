"""Fit an EAGLE head for the embedded default model (SmolLM2-135M-Instruct) on text it generates itself.

    PYTHONPATH=. python scripts/train_eagle_head.py [--num-prompts 96] [--train-seconds 180] [--out DIR]

1. kvserve generates greedy replies to local prompts: "repeat this code" over kvserve's source files (other
   snippets than the benchmark's, which uses seed 0) and "explain / summarise / continue" over docs/*.md;
2. kvserve gives the target's final hidden states for every prompt + reply (one prefill each);
3. kvserve.spec_decode.eagle_train fits the head for --train-seconds of CPU time and writes it, in the published
   EAGLE layout, to the folder `speculative_config={"method": "eagle"}` looks in by default
   (KVSERVE_CACHE_DIR or ~/.cache/kvserve, then eagle/smollm2-135m-instruct). About 17 MB, so not in git.
"""

from __future__ import annotations

import argparse
import json
import logging
import pathlib
import random
import time

from kvserve import LLM, SamplingParams
from kvserve.benchmarks.datasets import DatasetSpec, build_dataset
from kvserve.loader.default_model import DEFAULT_MODEL
from kvserve.spec_decode.eagle import default_head_dir
from kvserve.spec_decode.eagle_train import (
    embedding_and_lm_head,
    hf_llama_config,
    save_head,
    target_features,
    train_head,
)

ROOT = pathlib.Path(__file__).resolve().parent.parent
_DOC_INSTRUCTIONS = (
    "Summarize the following text in a few sentences:",
    "Explain this to a new engineer:",
    "Continue this text:",
    "What are the key points here?",
)


def doc_prompts(tokenizer, num: int, rng: random.Random) -> list[list[int]]:
    texts = [p.read_text() for p in sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"] if p.exists()]
    out = []
    for _ in range(num):
        ids = tokenizer.encode(rng.choice(texts), add_special_tokens=False)
        start = rng.randrange(max(1, len(ids) - 200))
        snippet = tokenizer.decode(ids[start : start + rng.randint(60, 200)])
        messages = [{"role": "user", "content": f"{rng.choice(_DOC_INSTRUCTIONS)}\n\n{snippet}"}]
        prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        out.append(tokenizer.encode(prompt, add_special_tokens=False))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-prompts", type=int, default=96, help="half copy prompts, half prompts about the docs")
    ap.add_argument("--max-tokens", type=int, default=192, help="tokens generated per prompt")
    ap.add_argument("--train-seconds", type=float, default=180.0)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--out", default=None, help=f"output folder (default: {default_head_dir(DEFAULT_MODEL)})")
    ns = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    out = ns.out or default_head_dir(DEFAULT_MODEL)
    rng = random.Random(ns.seed)
    t0 = time.perf_counter()

    # No prefix caching: the feature pass must compute every position of every sequence.
    llm = LLM(DEFAULT_MODEL, max_model_len=1024, enable_prefix_caching=False)
    tok = llm.get_tokenizer()
    num_copy = ns.num_prompts // 2
    copy = build_dataset(
        DatasetSpec("copy", num_requests=num_copy, seed=ns.seed, input_len=(100, 300), output_len=(ns.max_tokens,) * 2),
        tok.vocab_size if hasattr(tok, "vocab_size") else 49152,
        tok,
    )
    prompts = [r.prompt_token_ids for r in copy] + doc_prompts(tok, ns.num_prompts - num_copy, rng)
    params = SamplingParams(temperature=0.0, max_tokens=ns.max_tokens)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    sequences = [p + o.outputs[0].token_ids for p, o in zip(prompts, outputs, strict=True)]
    t_gen = time.perf_counter() - t0
    feats = target_features(llm, sequences)
    t_feat = time.perf_counter() - t0 - t_gen
    model_config = llm.engine.engine_core.config.model
    del llm

    config = hf_llama_config(model_config.arch)
    embed, lm_head = embedding_and_lm_head(model_config)
    head, result = train_head(config, embed, lm_head, sequences, feats, ns.train_seconds, seed=ns.seed)
    save_head(head, config, out, result)
    summary = {
        **result.__dict__,
        "generate_seconds": round(t_gen, 1),
        "features_seconds": round(t_feat, 1),
        "out": out,
    }
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()

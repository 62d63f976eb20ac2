"""Where an EAGLE head's acceptance goes: the engine's per-position acceptance against the head's teacher-forced
top-1 on the same text, and the second draft fed the head's own feature vs the target's (issue 31's diagnosis).

    PYTHONPATH=. python scripts/eagle_acceptance_gap.py --head DIR [--num-prompts 6] [--max-tokens 96]

1. kvserve with EAGLE (K = 4, fixed, full vocabulary, greedy, batch 1) on held-out library questions (as
   scripts/train_eagle_head.py builds them) and on the benchmark's `chat` prompts (seed 0): the accepted drafts per
   position over the verified drafts.
2. The same prompt + reply sequences through eagle_train.EagleReference with the checkpoint and the target's
   features from a kvserve prefill: top-1 agreement on the reply's rows (what the engine's first draft does).
3. On the chat sequences, for each reply position whose first draft is right: the second draft's agreement when
   its feature is the head's own prediction (what drafting does) vs the target's true feature (the ceiling).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import random
import sys

import torch
from safetensors.torch import load_file

from kvserve import LLM, SamplingParams
from kvserve.benchmarks.datasets import DatasetSpec, build_dataset
from kvserve.loader.default_model import DEFAULT_MODEL
from kvserve.spec_decode.eagle_train import EagleReference, embedding_and_lm_head, hf_llama_config, target_features

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from train_eagle_head import stdlib_prompts  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--head", required=True)
    ap.add_argument("--num-prompts", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=96)
    ns = ap.parse_args()
    head_dir = os.path.expanduser(ns.head)
    spec = {"method": "eagle", "model": head_dir, "num_speculative_tokens": 4, "adaptive": False}
    llm = LLM(DEFAULT_MODEL, max_model_len=1024, speculative_config=spec, max_num_seqs=1)
    tok = llm.get_tokenizer()
    chat = DatasetSpec("chat", num_requests=ns.num_prompts, seed=0, input_len=(64, 128), output_len=(96, 96))
    sets = {
        "library (held out)": stdlib_prompts(tok, ns.num_prompts, random.Random(99), held_out=True),
        "chat": [r.prompt_token_ids for r in build_dataset(chat, 49152, tok)],
    }
    params = SamplingParams(temperature=0.0, max_tokens=ns.max_tokens)
    seqs = {}
    for name, prompts in sets.items():
        before = llm.stats()["spec_decoding"]
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        after = llm.stats()["spec_decoding"]
        drafts = after["num_drafts"] - before["num_drafts"]
        old = before["num_accepted_tokens_per_pos"] + [0] * len(after["num_accepted_tokens_per_pos"])
        per_pos = [(a - b) / drafts for a, b in zip(after["num_accepted_tokens_per_pos"], old, strict=False)]
        print(f"{name}: engine, {drafts} drafts: accepted per position {[round(p, 3) for p in per_pos]}")
        seqs[name] = [(p, p + list(o.outputs[0].token_ids)) for p, o in zip(prompts, outs, strict=True)]
    del llm

    llm = LLM(DEFAULT_MODEL, max_model_len=1024, enable_prefix_caching=False)
    mc = llm.engine.engine_core.config.model
    embed_w, lm_w = embedding_and_lm_head(mc)
    embed = torch.nn.Embedding.from_pretrained(embed_w)
    head = EagleReference(hf_llama_config(mc.arch))
    head.load_state_dict(load_file(os.path.join(head_dir, "model.safetensors")), strict=False)
    head.eval()
    for name, pairs in seqs.items():
        feats = target_features(llm, [s for _, s in pairs])
        hit = total = first_ok = own = true = 0
        with torch.no_grad():
            for (prompt, seq), f in zip(pairs, feats, strict=True):
                e = embed(torch.tensor(seq[1:]))[None]
                want = (f[1:] @ lm_w.T).argmax(-1)  # want[i]: the target's token i + 2
                rows = (head(e, f[:-1][None])[0] @ lm_w.T).argmax(-1) == want
                hit += int(rows[len(prompt) - 1 :].sum())
                total += len(rows) - len(prompt) + 1
                if name != "chat":
                    continue
                for i in range(len(prompt) - 1, len(seq) - 3):
                    if not rows[i]:
                        continue
                    first_ok += 1
                    pred = head(e[:, : i + 1], f[: i + 1][None])[0, -1]
                    own_f = torch.cat([f[: i + 1], pred[None]])[None]
                    own += int((head(e[:, : i + 2], own_f)[0, -1] @ lm_w.T).argmax() == want[i + 1])
                    true += int((head(e[:, : i + 2], f[: i + 2][None])[0, -1] @ lm_w.T).argmax() == want[i + 1])
        print(f"{name}: teacher-forced top-1 on the reply rows {hit / total:.3f} ({total})")
        if first_ok:
            print(
                f"{name}: second draft after a right first one ({first_ok}): own feature {own / first_ok:.3f}, "
                f"target's feature {true / first_ok:.3f}"
            )


if __name__ == "__main__":
    main()

"""Count token frequencies over local text for a frequency-ranked draft vocabulary (kvserve.spec_decode.draft_vocab).

    PYTHONPATH=. python scripts/draft_vocab_counts.py [--model smollm2-135m-instruct] [--chat-replies N] [--out FOLDER]

Text: the training part of the Python standard library (kvserve.spec_decode.local_text: docstrings and source of
every module not held out). The tokenizer's special tokens (EOS, the chat template's markers) never occur in that
text but end every reply, so they are ranked first. Writes FOLDER/token_counts.npy ([vocab] int64); FOLDER is
the EAGLE head's folder by default (scripts/train_eagle_head.py writes the same file beside the head it fits).
--chat-replies N also counts the model's own greedy replies to N chat questions (scripts/train_eagle_head.py's
self-distillation questions, not the benchmark's), weighted as much as the library: what speculation drafts on chat.
"""

from __future__ import annotations

import argparse
import json
import random

from kvserve.loader.default_model import DEFAULT_MODEL, resolve_model_path
from kvserve.loader.tokenizer import load_tokenizer
from kvserve.spec_decode.draft_vocab import save_counts
from kvserve.spec_decode.eagle import default_head_dir
from kvserve.spec_decode.local_text import local_token_counts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=DEFAULT_MODEL, help="the model whose tokenizer counts (path or name)")
    ap.add_argument("--vocab-size", type=int, default=None, help="default: the tokenizer's length")
    ap.add_argument("--chat-replies", type=int, default=0, help="also count the model's replies to N chat questions")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--out", default=None, help=f"output folder (default: {default_head_dir(DEFAULT_MODEL)})")
    ns = ap.parse_args()
    tok = load_tokenizer(resolve_model_path(ns.model))
    vocab_size = ns.vocab_size or len(tok)
    replies = None
    if ns.chat_replies:
        from train_eagle_head import self_chat_prompts

        from kvserve import LLM, SamplingParams

        llm = LLM(ns.model)
        prompts = self_chat_prompts(tok, ns.chat_replies, random.Random(ns.seed))
        outputs = llm.generate(
            [{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0.0, max_tokens=192)
        )
        replies = [list(o.outputs[0].token_ids) for o in outputs]
    counts, coverage = local_token_counts(tok, vocab_size, extra=replies)
    path = save_counts(ns.out or default_head_dir(ns.model), counts)
    print(json.dumps({"out": path, "coverage_of_top_n": coverage}, indent=1))


if __name__ == "__main__":
    main()

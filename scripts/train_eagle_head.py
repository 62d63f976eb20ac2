"""Fit an EAGLE head for the embedded default model (SmolLM2-135M-Instruct) on text it generates itself.

    PYTHONPATH=. python scripts/train_eagle_head.py [--num-prompts 96] [--stdlib-prompts 0] [--stdlib-windows 0]
        [--chat-prompts 0] [--held-out-chat 0] [--train-seconds 180] [--out DIR]

1. kvserve generates greedy replies to local prompts: "repeat this code" over kvserve's source files (other
   snippets than the benchmark's, which uses seed 0) and "explain / summarise / continue" over docs/*.md, and
   (--stdlib-prompts) the same questions over docstrings and code of the Python standard library's training part
   (kvserve.spec_decode.local_text); --stdlib-windows adds windows of that library text as they are (no reply);
   --chat-prompts adds natural chat questions (self-distillation on the chat workload's kind of text, with other
   question templates and topics than the benchmark's `chat` dataset, so that it stays held out);
2. kvserve gives the target's final hidden states for every prompt + reply (one prefill each);
3. kvserve.spec_decode.eagle_train fits the head for --train-seconds of CPU time and writes it, in the published
   EAGLE layout, to the folder `speculative_config={"method": "eagle"}` looks in by default
   (KVSERVE_CACHE_DIR or ~/.cache/kvserve, then eagle/smollm2-135m-instruct). About 17 MB, so not in git.
   Beside it: token_counts.npy, the token frequencies of the library's training part and of the training
   sequences (weighted equally), for `"draft_vocab_size": N` (kvserve.spec_decode.draft_vocab).
4. The head's top-1 agreement with the target is scored on held-out text: with --held-out-prompts, replies to
   questions over the library's held-out files (whole sequences, prompt and reply); with --held-out-chat, the
   benchmark's own `chat` prompts (seed 0) and their replies, also scored on the reply's tokens alone
   (`reply_top1_accuracy`: what speculation drafts); else a tenth of the sequences.
   For each --draft-vocab-sizes N it is scored again with the head's argmax over the N most frequent tokens.
   --train-vocab N trains the loss over the N most frequent tokens only (the draft vocabulary the engine then
   drafts over: the head's config.json names it as `draft_vocab_size`); the LM head, most of an update's work,
   shrinks by the vocabulary / N.
"""

from __future__ import annotations

import argparse
import json
import logging
import pathlib
import random
import time

import torch

from kvserve import LLM, SamplingParams
from kvserve.benchmarks.datasets import DatasetSpec, build_dataset
from kvserve.loader.default_model import DEFAULT_MODEL
from kvserve.spec_decode.draft_vocab import draft_vocab_ids, save_counts
from kvserve.spec_decode.eagle import default_head_dir
from kvserve.spec_decode.eagle_train import (
    embedding_and_lm_head,
    hf_llama_config,
    save_head,
    target_features,
    train_head,
)
from kvserve.spec_decode.local_text import docstrings, local_token_counts, source, stdlib_files

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


def stdlib_prompts(tokenizer, num: int, rng: random.Random, held_out: bool) -> list[list[int]]:
    """Chat questions over snippets of the standard library (docstrings and code) of one part."""
    files = stdlib_files(held_out)
    out = []
    while len(out) < num:
        path = rng.choice(files)
        texts = docstrings(path) if rng.random() < 0.5 else [source(path)]
        texts = [t for t in texts if len(t) > 200]
        if not texts:
            continue
        ids = tokenizer.encode(rng.choice(texts), add_special_tokens=False)
        start = rng.randrange(max(1, len(ids) - 200))
        snippet = tokenizer.decode(ids[start : start + rng.randint(60, 200)])
        messages = [{"role": "user", "content": f"{rng.choice(_DOC_INSTRUCTIONS)}\n\n{snippet}"}]
        prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        out.append(tokenizer.encode(prompt, add_special_tokens=False))
    return out


# Natural chat questions for self-distillation: templates and topics disjoint from the benchmark's `chat` dataset
# (kvserve.benchmarks.datasets._CHAT_TASKS / _CHAT_TOPICS), which scores the head held out.
_SELF_CHAT_TASKS = (
    "Can you explain what {} is and why it matters?",
    "Write a short poem about {}.",
    "List five interesting facts about {}.",
    "I am new to {}. Where should I start?",
    "Compare {} with something similar and explain the differences.",
    "Summarize the most important ideas about {} for a busy reader.",
    "What are common mistakes people make with {}?",
    "Write a short blog post introduction about {}.",
    "Tell me a fun story for kids about {}.",
    "What would the world look like without {}?",
    "Give a step-by-step guide related to {}.",
    "Why do people find {} interesting?",
    "Write a haiku about {}.",
    "Explain {} in simple terms.",
    "What is the most surprising thing about {}?",
    "Plan a weekend activity around {}.",
    "Write a short dialogue between two friends about {}.",
    "What are the pros and cons of {}?",
    "How has {} changed over the last hundred years?",
    "Describe {} to someone who has never seen it.",
    "Write a product description inspired by {}.",
    "What skills do you need for {}?",
    "Give me a quiz with three questions about {}.",
    "Write a motivational message about {}.",
)
_SELF_CHAT_TOPICS = (
    "rainforests",
    "the moon landing",
    "electric cars",
    "making pizza at home",
    "saving money",
    "the human heart",
    "a rainy day",
    "dinosaurs",
    "climate change",
    "a job interview",
    "time management",
    "the ocean tides",
    "jazz music",
    "ancient Rome",
    "a hiking trip",
    "healthy sleep",
    "the internet",
    "a birthday party",
    "wind turbines",
    "learning to swim",
    "the solar system",
    "a public library",
    "earthquakes",
    "playing guitar",
    "friendship",
    "a train journey",
    "honey",
    "mountain climbing",
    "the immune system",
    "writing a resume",
    "a pet dog",
    "renewable energy",
    "the Olympic games",
    "coffee",
    "a snowstorm",
    "painting with watercolors",
    "electricity",
    "a farmers market",
    "robots",
    "meditation",
    "the Great Wall of China",
    "football",
    "chocolate",
    "a city park",
    "airplanes",
    "composting",
    "the history of money",
    "a camping trip",
    "bread and butter",
    "the Amazon river",
    "black holes",
    "knitting",
    "a marathon of movies",
    "space exploration",
    "a school science fair",
    "owls",
    "the French revolution",
    "video games",
    "tea ceremonies",
    "a lighthouse",
    "bird watching",
    "cloud computing",
    "the desert",
    "a wedding",
    "pottery",
    "tornadoes",
    "a food truck",
    "origami",
    "penguins",
    "the Renaissance",
    "smartphones",
    "a night sky full of stars",
    "yoga",
    "a thunderstorm",
    "the first day of school",
    "whales",
    "online shopping",
    "a mountain village",
    "cooking pasta",
    "bridges",
    "the human brain",
    "a science museum",
    "gardening in winter",
    "the history of writing",
    "a lost cat",
    "basketball",
    "rain boots",
    "artificial intelligence",
    "a treasure map",
    "skiing",
    "the Arctic",
    "vaccines",
    "a busy airport",
    "ice cream",
    "photography",
    "a rocket launch",
    "the post office",
    "sunflowers",
    "a thrift store",
    "dragons",
    "a bakery",
    "traffic jams",
    "the Sahara",
    "a violin",
    "board games",
    "the deep sea",
    "a neighborhood cleanup",
    "butterflies",
    "spreadsheets",
    "a road trip",
    "electric guitars",
    "the Great Barrier Reef",
    "podcasts",
    "a rainy afternoon indoors",
    "the Eiffel Tower",
    "first aid",
    "a summer festival",
    "clocks",
)


def self_chat_prompts(tokenizer, num: int, rng: random.Random) -> list[list[int]]:
    """Natural chat questions (see _SELF_CHAT_TASKS) in the model's chat template."""
    out = []
    for _ in range(num):
        question = rng.choice(_SELF_CHAT_TASKS).format(rng.choice(_SELF_CHAT_TOPICS))
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True
        )
        out.append(tokenizer.encode(prompt, add_special_tokens=False))
    return out


def stdlib_windows(tokenizer, num: int, length: int, rng: random.Random) -> list[list[int]]:
    """Windows of `length` tokens of the library's training part, as they are (docstrings and code)."""
    files = stdlib_files(held_out=False)
    out = []
    while len(out) < num:
        path = rng.choice(files)
        ids = tokenizer.encode(source(path), add_special_tokens=False)
        if len(ids) < length:
            continue
        start = rng.randrange(len(ids) - length + 1)
        out.append(ids[start : start + length])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-prompts", type=int, default=96, help="half copy prompts, half prompts about the docs")
    ap.add_argument("--max-tokens", type=int, default=192, help="tokens generated per prompt")
    ap.add_argument("--stdlib-prompts", type=int, default=0, help="questions over the standard library's text")
    ap.add_argument("--stdlib-windows", type=int, default=0, help="windows of the standard library's text")
    ap.add_argument("--window-len", type=int, default=384)
    ap.add_argument("--held-out-prompts", type=int, default=0, help="questions over held-out library files")
    ap.add_argument("--chat-prompts", type=int, default=0, help="natural chat questions (self-distillation)")
    ap.add_argument("--held-out-chat", type=int, default=0, help="the benchmark's chat prompts, scored held out")
    ap.add_argument("--draft-vocab-sizes", type=int, nargs="*", default=[8192, 16384, 32768])
    ap.add_argument("--chat-samples", type=int, default=0, help="more chat questions, replies sampled (not greedy)")
    ap.add_argument("--chat-temperature", type=float, default=0.8, help="temperature of --chat-samples' replies")
    ap.add_argument(
        "--unroll", type=int, nargs="?", const=1, default=0, help="train drafts 2..N+1 on the head's own features"
    )
    ap.add_argument("--bf16", action="store_true", help="train under bf16 autocast (CPUs with native bf16)")
    ap.add_argument(
        "--train-vocab",
        type=int,
        default=0,
        help="train the head's loss over this many most frequent tokens only (a draft vocabulary size; 0: all)",
    )
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
    prompts += stdlib_prompts(tok, ns.stdlib_prompts, rng, held_out=False)
    prompts += self_chat_prompts(tok, ns.chat_prompts, rng)
    held_out_prompts = stdlib_prompts(tok, ns.held_out_prompts, rng, held_out=True)
    chat = DatasetSpec("chat", num_requests=ns.held_out_chat, seed=0, output_len=(ns.max_tokens,) * 2)
    held_out_prompts += [r.prompt_token_ids for r in build_dataset(chat, 49152, tok)] if ns.held_out_chat else []
    params = SamplingParams(temperature=0.0, max_tokens=ns.max_tokens)
    # Sampled replies to more chat questions: the head learns from the target's distributions at every position,
    # whatever chose the tokens, and sampling widens the contexts beyond the few thousand distinct greedy replies.
    sampled_prompts = self_chat_prompts(tok, ns.chat_samples, rng)
    sampled_params = [
        SamplingParams(temperature=ns.chat_temperature, max_tokens=ns.max_tokens, seed=ns.seed + k)
        for k in range(len(sampled_prompts))
    ]
    outputs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts + held_out_prompts + sampled_prompts],
        [params] * len(prompts + held_out_prompts) + sampled_params,
    )
    all_prompts = prompts + held_out_prompts + sampled_prompts
    generated = [p + o.outputs[0].token_ids for p, o in zip(all_prompts, outputs, strict=True)]
    n_train, n_held = len(prompts), len(held_out_prompts)
    held_out = generated[n_train : n_train + n_held]
    sequences = generated[:n_train] + generated[n_train + n_held :]  # greedy, then sampled replies
    sequences += stdlib_windows(tok, ns.stdlib_windows, ns.window_len, rng)
    t_gen = time.perf_counter() - t0
    feats = target_features(llm, sequences + held_out)
    t_feat = time.perf_counter() - t0 - t_gen
    model_config = llm.engine.engine_core.config.model
    del llm

    vocab_size = model_config.arch.vocab_size
    counts, coverage = local_token_counts(tok, vocab_size, extra=sequences)
    save_counts(out, counts)
    draft_vocabs = {n: torch.from_numpy(draft_vocab_ids(counts, n)) for n in ns.draft_vocab_sizes if n < vocab_size}
    config = hf_llama_config(model_config.arch)
    embed, lm_head = embedding_and_lm_head(model_config)
    head, result = train_head(
        config,
        embed,
        lm_head,
        sequences,
        feats[: len(sequences)],
        ns.train_seconds,
        seed=ns.seed,
        held_out=(held_out, feats[len(sequences) :]) if held_out else None,
        draft_vocabs=draft_vocabs,
        held_out_reply_starts=[len(p) for p in held_out_prompts] if held_out else None,
        unroll=ns.unroll,
        autocast_bf16=ns.bf16,
        train_vocab=torch.from_numpy(draft_vocab_ids(counts, ns.train_vocab)) if ns.train_vocab else None,
    )
    save_head(head, config, out, result)
    summary = {
        **result.__dict__,
        "library_coverage_of_top_n": coverage,
        "generate_seconds": round(t_gen, 1),
        "features_seconds": round(t_feat, 1),
        "out": out,
    }
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()

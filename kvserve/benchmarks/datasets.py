"""Benchmark workloads, generated locally from a seed (no downloads).

- random:        independent prompts of random tokens (vLLM's "random"), ignore_eos.
- shared-prefix: a few long system prompts shared by many requests, each with a unique suffix (the chatbot case).
- multi-turn:    conversations whose every turn resends the whole history (prefix reuse across turns).
- long-prompt:   a few very long prompts arriving among many short requests that decode for long (chunked prefill).
- copy:          "repeat / edit this code" chat prompts over snippets of kvserve's own source files (local text),
                 the copy-heavy case that speculative decoding with prompt lookup speeds up; needs a tokenizer.
- chat:          short natural chat questions (explain, describe, advise, write), nothing to copy: the case where
                 speculation must not lose; input_len is ignored (the prompts are what they are); needs a tokenizer.

Prompts are token ids (offline) or the text they decode to (serving, so any OpenAI endpoint can take them).
Random tokens come from the middle of the vocabulary, away from special tokens.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any


@dataclass
class BenchRequest:
    prompt_token_ids: list[int]
    output_len: int
    tag: str = "default"  # workload part, for per-part latency statistics (e.g. "short" vs "long")
    prompt_text: str | None = None

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)


@dataclass
class DatasetSpec:
    name: str
    num_requests: int = 128
    seed: int = 0
    input_len: tuple[int, int] = (64, 512)
    output_len: tuple[int, int] = (64, 256)
    options: dict[str, Any] = field(default_factory=dict)


DATASETS = ("random", "shared-prefix", "multi-turn", "long-prompt", "copy", "chat")


def build_dataset(spec: DatasetSpec, vocab_size: int, tokenizer=None) -> list[BenchRequest]:
    """`tokenizer` (optional) adds prompt texts for serving benchmarks."""
    rng = random.Random(spec.seed)
    if spec.name in ("copy", "chat"):
        if tokenizer is None:
            raise ValueError(f"the {spec.name} dataset needs a tokenizer")
        return (_copy if spec.name == "copy" else _chat)(spec, rng, tokenizer)
    builders = {
        "random": _random,
        "shared-prefix": _shared_prefix,
        "multi-turn": _multi_turn,
        "long-prompt": _long_prompt,
    }
    if spec.name not in builders:
        raise ValueError(f"unknown dataset {spec.name!r}; choose from {', '.join(DATASETS)}")
    requests = builders[spec.name](spec, rng, _TokenSource(rng, vocab_size))
    if tokenizer is not None:
        for r in requests:
            r.prompt_text = tokenizer.decode(r.prompt_token_ids)
    return requests


class _TokenSource:
    def __init__(self, rng: random.Random, vocab_size: int) -> None:
        self.rng = rng
        margin = min(1000, vocab_size // 10)
        self.lo, self.hi = margin, vocab_size - margin

    def tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(self.lo, self.hi) for _ in range(n)]


def _random(spec: DatasetSpec, rng: random.Random, src: _TokenSource) -> list[BenchRequest]:
    return [
        BenchRequest(src.tokens(rng.randint(*spec.input_len)), rng.randint(*spec.output_len))
        for _ in range(spec.num_requests)
    ]


def _shared_prefix(spec: DatasetSpec, rng: random.Random, src: _TokenSource) -> list[BenchRequest]:
    """options: num_prefixes (4), prefix_len (512); input_len is the unique suffix length range."""
    num_prefixes = int(spec.options.get("num_prefixes", 4))
    prefix_len = int(spec.options.get("prefix_len", 512))
    prefixes = [src.tokens(prefix_len) for _ in range(num_prefixes)]
    return [
        BenchRequest(
            prefixes[rng.randrange(num_prefixes)] + src.tokens(rng.randint(*spec.input_len)),
            rng.randint(*spec.output_len),
        )
        for _ in range(spec.num_requests)
    ]


def _multi_turn(spec: DatasetSpec, rng: random.Random, src: _TokenSource) -> list[BenchRequest]:
    """options: turns (4). Each conversation's turn k resends turns 0..k-1 (user + assistant) and a new user
    message; input_len is the user message length, output_len the reply length. Requests come turn by turn,
    interleaving conversations, as concurrent chat users would."""
    turns = int(spec.options.get("turns", 4))
    num_conversations = max(1, spec.num_requests // turns)
    histories: list[list[int]] = [[] for _ in range(num_conversations)]
    requests = []
    for _ in range(turns):
        for c in range(num_conversations):
            user = src.tokens(rng.randint(*spec.input_len))
            reply_len = rng.randint(*spec.output_len)
            turn = len(requests) // num_conversations
            requests.append(BenchRequest(histories[c] + user, reply_len, tag=f"turn{turn}"))
            # The next turn resends this exchange; the reply is synthetic (the same length a model would write).
            histories[c] = histories[c] + user + src.tokens(reply_len)
    return requests[: spec.num_requests]


def _long_prompt(spec: DatasetSpec, rng: random.Random, src: _TokenSource) -> list[BenchRequest]:
    """options: num_long (4), long_len ((2048, 3072)), long_output (16). The short requests (input_len,
    output_len) come first and are still decoding when the long prompts arrive among them."""
    num_long = int(spec.options.get("num_long", 4))
    long_len = spec.options.get("long_len", (2048, 3072))
    long_output = int(spec.options.get("long_output", 16))
    shorts = [
        BenchRequest(src.tokens(rng.randint(*spec.input_len)), rng.randint(*spec.output_len), tag="short")
        for _ in range(max(0, spec.num_requests - num_long))
    ]
    longs = [BenchRequest(src.tokens(rng.randint(*long_len)), long_output, tag="long") for _ in range(num_long)]
    # Longs are spread over the second half of the arrival order.
    out = list(shorts)
    for i, req in enumerate(longs):
        out.insert(len(shorts) // 2 + i * max(1, len(shorts) // (2 * max(1, num_long))), req)
    return out


_COPY_INSTRUCTIONS = (
    "Repeat this code exactly, without any comment:",
    "Rewrite this code with the same content, changing nothing:",
    "Copy the following text verbatim:",
)


def _copy(spec: DatasetSpec, rng: random.Random, tokenizer) -> list[BenchRequest]:
    """A snippet of input_len tokens (about) from a source file of this package, wrapped in a chat prompt asking
    to repeat it; output_len is capped by the snippet's own length (plus a few tokens of reply framing)."""
    import pathlib

    root = pathlib.Path(__file__).resolve().parent.parent
    texts = [p.read_text() for p in sorted(root.rglob("*.py")) if p.stat().st_size > 2000]
    requests = []
    for _ in range(spec.num_requests):
        text = texts[rng.randrange(len(texts))]
        ids = tokenizer.encode(text, add_special_tokens=False)
        want = rng.randint(*spec.input_len)
        start = rng.randrange(max(1, len(ids) - want))
        snippet = tokenizer.decode(ids[start : start + want])
        messages = [{"role": "user", "content": f"{rng.choice(_COPY_INSTRUCTIONS)}\n\n{snippet}"}]
        prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
        output_len = min(rng.randint(*spec.output_len), len(ids[start : start + want]) + 8)
        requests.append(BenchRequest(prompt_ids, output_len, tag="copy", prompt_text=prompt))
    return requests


_CHAT_TASKS = (
    "Explain to a beginner how {} works.",
    "What are the main advantages and drawbacks of {}?",
    "Write a short story that involves {}.",
    "Give me three practical tips about {}.",
    "Describe the history of {} in a few paragraphs.",
    "How would you teach a child about {}?",
    "Write a friendly email inviting a colleague to a talk about {}.",
    "What questions should I ask before I start learning about {}?",
)
_CHAT_TOPICS = (
    "a bicycle",
    "photosynthesis",
    "the stock market",
    "baking bread",
    "solar panels",
    "a vegetable garden",
    "public transport in a big city",
    "learning a second language",
    "the water cycle",
    "a small coffee shop",
    "volcanoes",
    "running a marathon",
    "the printing press",
    "recycling plastic",
    "a chess opening",
    "keeping bees",
)


def _chat(spec: DatasetSpec, rng: random.Random, tokenizer) -> list[BenchRequest]:
    """A question from a task template and a topic, in the model's chat template."""
    requests = []
    for _ in range(spec.num_requests):
        question = rng.choice(_CHAT_TASKS).format(rng.choice(_CHAT_TOPICS))
        messages = [{"role": "user", "content": question}]
        prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
        requests.append(BenchRequest(prompt_ids, rng.randint(*spec.output_len), tag="chat", prompt_text=prompt))
    return requests

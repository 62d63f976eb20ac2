"""Load the HF tokenizer of a model folder or GGUF file.

transformers builds a fast tokenizer from GGUF metadata (vocab, merges, chat template), which takes ~7 s for
SmolLM2; the result is saved next to the cache so later loads take well under a second.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
from typing import Any

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from kvserve.loader.default_model import cache_dir

logger = logging.getLogger(__name__)


def load_tokenizer(path: str) -> PreTrainedTokenizerBase:
    """The tokenizer of `path`, parsed once per process while its files are unchanged: engines of one model in
    one process share the object (as vLLM's cached tokenizers are shared; kvserve never changes it). Parsing
    SmolLM2's tokenizer.json takes ~0.2 s, most of the start-up of an engine on a tiny model."""
    if not os.path.exists(path):  # a hub id: transformers resolves (and caches) it
        return AutoTokenizer.from_pretrained(path)
    return _load_cached(os.path.abspath(path), _files_signature(path))


def _files_signature(path: str) -> tuple:
    """What changes when the tokenizer's files do: the file's, or every file's of the folder, size and mtime."""
    if os.path.isdir(path):
        stats = [(e.name, e.stat()) for e in os.scandir(path) if e.is_file()]
        return tuple(sorted((name, st.st_size, st.st_mtime_ns) for name, st in stats))
    st = os.stat(path)
    return ((os.path.basename(path), st.st_size, st.st_mtime_ns),)


@functools.lru_cache(maxsize=8)
def _load_cached(path: str, signature: tuple) -> PreTrainedTokenizerBase:
    del signature  # part of the cache key only
    if not path.endswith(".gguf"):
        return AutoTokenizer.from_pretrained(path)
    st = os.stat(path)
    key = hashlib.sha256(f"{os.path.abspath(path)}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]
    saved = os.path.join(cache_dir(), "tokenizers", key)
    if os.path.exists(os.path.join(saved, "tokenizer_config.json")):
        return AutoTokenizer.from_pretrained(saved)
    logger.info("converting the GGUF tokenizer of %s (cached in %s)", path, saved)
    tokenizer = AutoTokenizer.from_pretrained(os.path.dirname(os.path.abspath(path)), gguf_file=os.path.basename(path))
    tmp = f"{saved}.partial-{os.getpid()}"
    tokenizer.save_pretrained(tmp)
    os.makedirs(os.path.dirname(saved), exist_ok=True)
    try:
        os.replace(tmp, saved)
    except OSError:  # another process won the race; its copy is as good as ours
        pass
    return tokenizer


def render_chat_prompt(
    tokenizer: PreTrainedTokenizerBase,
    conversation: list[dict[str, Any]],
    add_generation_prompt: bool = True,
    chat_template_kwargs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The model's chat template applied to one conversation, as a prompt with both text and token ids.

    Raises ValueError when the template fails or yields no text: the conversation (or the kwargs) is at fault.
    """
    try:
        text = tokenizer.apply_chat_template(
            conversation, tokenize=False, add_generation_prompt=add_generation_prompt, **(chat_template_kwargs or {})
        )
    except Exception as e:
        raise ValueError(f"cannot apply the chat template: {e}") from e
    if not isinstance(text, str):
        raise ValueError("the chat template did not produce text")
    # The template writes every special token itself; the tokenizer must not add a BOS of its own.
    return {"prompt": text, "prompt_token_ids": tokenizer(text, add_special_tokens=False).input_ids}

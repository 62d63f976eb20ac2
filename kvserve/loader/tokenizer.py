"""Load the HF tokenizer of a model folder or GGUF file.

transformers builds a fast tokenizer from GGUF metadata (vocab, merges, chat template), which takes ~7 s for
SmolLM2; the result is saved next to the cache so later loads take well under a second.
"""

from __future__ import annotations

import hashlib
import logging
import os

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from kvserve.loader.default_model import cache_dir

logger = logging.getLogger(__name__)


def load_tokenizer(path: str) -> PreTrainedTokenizerBase:
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

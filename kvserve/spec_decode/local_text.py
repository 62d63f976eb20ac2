"""Local text for fitting draft heads and draft vocabularies: the Python standard library's modules (their
docstrings, English prose, and their source code), which ship with every Python.

Files are split into a training part and a held-out part by a hash of their path relative to the library root,
so the split is the same on every run and machine with the same Python version; nothing held out is used to fit
a head or to count tokens.
"""

from __future__ import annotations

import ast
import os
import sysconfig
import zlib

import numpy as np

from kvserve.spec_decode.draft_vocab import count_tokens, mix_counts

# Test suites and bundled tools: large, repetitive, not the library's own prose and code.
_SKIPPED_DIRS = {"test", "tests", "idle_test", "site-packages", "__pycache__", "lib2to3", "turtledemo", "ensurepip"}


def stdlib_files(held_out: bool, held_out_percent: int = 10, max_bytes: int = 200_000) -> list[str]:
    """The library's .py files of one part (held out or training), sorted; files over `max_bytes` skipped."""
    root = sysconfig.get_paths()["stdlib"]
    out = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in _SKIPPED_DIRS and not d.startswith("."))
        for name in sorted(files):
            if not name.endswith(".py"):
                continue
            path = os.path.join(folder, name)
            rel = os.path.relpath(path, root)
            if os.path.getsize(path) > max_bytes:
                continue
            if (zlib.crc32(rel.encode()) % 100 < held_out_percent) == held_out:
                out.append(path)
    return out


def docstrings(path: str, min_chars: int = 200) -> list[str]:
    """The module, class and function docstrings of at least `min_chars` of one file, in file order."""
    try:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read())
    except (SyntaxError, UnicodeDecodeError, OSError, ValueError):
        return []
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            doc = ast.get_docstring(node)
            if doc and len(doc) >= min_chars:
                out.append(doc)
    return out


def source(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except (UnicodeDecodeError, OSError):
        return ""


def local_token_counts(
    tokenizer, vocab_size: int, extra: list[list[int]] | None = None
) -> tuple[np.ndarray, dict[int, float]]:
    """Token counts over the library's training part (docstrings and sources), for a draft vocabulary: (counts
    [vocab_size] with the tokenizer's special tokens ranked first, the share of the counted tokens the N most
    frequent cover for a few N). Special tokens (EOS, the chat template's markers) never occur in the text but end
    every reply. `extra`: token ids of other text, above all what the model itself writes (its replies to chat
    questions), weighted as much as the library whatever their sizes: library-ranked counts alone left the
    target's argmax outside 16,384 tokens on 7% of chat reply positions."""
    texts = []
    for path in stdlib_files(held_out=False):
        texts.extend(docstrings(path))
        texts.append(source(path))
    counts = count_tokens([tokenizer.encode(t, add_special_tokens=False) for t in texts if t], vocab_size)
    if extra:
        counts = mix_counts(counts, count_tokens(extra, vocab_size))
    top = np.sort(counts)[::-1]
    coverage = {n: round(float(top[:n].sum() / counts.sum()), 4) for n in (4096, 8192, 16384, 32768)}
    special = [i for i in tokenizer.all_special_ids if i < vocab_size]
    counts[special] = counts.max() + 1
    return counts, coverage

"""A model's weights identity, the same on every machine that holds the same files, wherever they lie.

KV blocks shared between instances (a global pool, disk tiers, prefill/decode transfers) are keyed by the
prompt's chained block hashes plus a fingerprint of what computed them; the fingerprint must not depend on the
model's path (instances on several hosts keep it in different places) but must tell different weights apart. It
is xxh3-128 over each weight file's name, size and its first and last MiB: cheap to compute at start-up, and two
checkpoints that agree on all of that are, in practice, the same checkpoint. Random weights (`load_format="dummy"`)
are named by their seed.
"""

from __future__ import annotations

import os

import xxhash

_EDGE = 1 << 20
_WEIGHT_SUFFIXES = (".gguf", ".safetensors", ".bin", ".pt")


def _files(path: str) -> list[str]:
    if os.path.isfile(path):
        return [path]
    names = sorted(n for n in os.listdir(path) if n.endswith(_WEIGHT_SUFFIXES) or n == "config.json")
    return [os.path.join(path, n) for n in names]


def weights_fingerprint(path: str, load_format: str = "auto", seed: int = 0) -> str:
    if load_format == "dummy":
        return f"dummy-seed{seed}"
    h = xxhash.xxh3_128()
    for file in _files(path):
        size = os.path.getsize(file)
        h.update(f"{os.path.basename(file)}:{size}:".encode())
        with open(file, "rb") as f:
            h.update(f.read(_EDGE))
            if size > 2 * _EDGE:
                f.seek(size - _EDGE)
                h.update(f.read(_EDGE))
    return h.hexdigest()

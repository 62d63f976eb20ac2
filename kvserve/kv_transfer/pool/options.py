"""The pool connector's options: the `kv_transfer_config` keys besides `kv_connector`.

{"kv_connector": "pool", "store": "mooncake", "master": "10.0.0.5:50051"}
{"kv_connector": "pool", "store": "valkey", "url": "redis://10.0.0.5:6379/0"}
"""

from __future__ import annotations

import socket
from dataclasses import dataclass

import xxhash

from kvserve.config import KVTransferConfig
from kvserve.kv_cache_spec import KVCacheSpec
from kvserve.utils import parse_bytes

_KEYS = (
    "store",
    "master",
    "local_hostname",
    "metadata_server",
    "url",
    "lend_bytes",
    "staging_bytes",
    "lookup_timeout_s",
    "ttl_s",
)


@dataclass(frozen=True)
class PoolOptions:
    store: str  # "mooncake" | "valkey"
    master: str | None  # mooncake: the master's host:port
    local_hostname: str | None  # mooncake: this client's address (None: the one that routes to the master)
    metadata_server: str  # mooncake: "P2PHANDSHAKE" (no metadata server) or an http:// metadata server
    url: str | None  # valkey: redis://host:port/db
    lend_bytes: int  # mooncake: memory this instance lends to the pool (0: storage nodes hold the blocks)
    staging_bytes: int  # per worker: the registered buffer blocks pass through on their way in and out
    lookup_timeout_s: float  # a lookup not answered by then is a miss (the store is slow or down)
    ttl_s: int | None  # valkey: seconds a stored block lives (None: until the server evicts it)

    @classmethod
    def from_config(cls, config: KVTransferConfig) -> PoolOptions:
        opts = config.options
        unknown = sorted(set(opts) - set(_KEYS))
        if unknown:
            raise ValueError(f"kv_transfer_config: unknown pool option(s) {', '.join(unknown)}; use {_KEYS}")
        store = opts.get("store", "mooncake")
        if store not in ("mooncake", "valkey"):
            raise ValueError(f"kv_transfer_config: pool store must be mooncake or valkey, got {store!r}")
        if store == "mooncake" and not opts.get("master"):
            raise ValueError("kv_transfer_config: the mooncake pool needs 'master' (host:port of mooncake_master)")
        if store == "valkey" and not opts.get("url"):
            raise ValueError("kv_transfer_config: the valkey pool needs 'url' (redis://host:port/db)")
        try:
            lend = parse_bytes(opts.get("lend_bytes", 0))
            # Room for every block a 2048-token step fills, several times over (pages are touched only when used).
            staging = parse_bytes(opts.get("staging_bytes", "256MiB"))
        except ValueError as e:
            raise ValueError(f"kv_transfer_config: bad byte size ({e})") from None
        timeout = float(opts.get("lookup_timeout_s", 2.0))
        ttl = opts.get("ttl_s")
        return cls(
            store,
            opts.get("master"),
            opts.get("local_hostname"),
            opts.get("metadata_server", "P2PHANDSHAKE"),
            opts.get("url"),
            lend,
            staging,
            timeout,
            int(ttl) if ttl is not None else None,
        )

    def hostname(self) -> str:
        """This host's address on the route to the master (what Mooncake advertises to its peers)."""
        if self.local_hostname:
            return self.local_hostname
        host, _, port = (self.master or "127.0.0.1:0").rpartition(":")
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            try:
                s.connect((host, int(port or 9)))
                return s.getsockname()[0]
            except OSError:
                return "127.0.0.1"


class KeyScheme:
    """Store keys: `kvserve/<layout fingerprint>/<block hash>/<rank>of<tp>`. The fingerprint names the weights,
    dtype, quantization, KV layout, block size and TP size (KVCacheSpec.layout_id), so instances share a block only
    where its bytes mean the same; each tensor-parallel rank stores its own slice of the block."""

    def __init__(self, spec: KVCacheSpec) -> None:
        self.prefix = f"kvserve/{xxhash.xxh3_64_hexdigest(spec.layout_id.encode())}/"
        self.tp_size = spec.tp_size

    def key(self, block_hash_hex: str, rank: int) -> str:
        return f"{self.prefix}{block_hash_hex}/{rank}of{self.tp_size}"


def open_store(options: PoolOptions):
    from kvserve.kv_transfer.pool.store import MooncakeBlockStore, ValkeyBlockStore

    if options.store == "valkey":
        assert options.url is not None
        return ValkeyBlockStore(options.url, ttl_s=options.ttl_s)
    assert options.master is not None
    return MooncakeBlockStore(options.master, options.hostname(), options.metadata_server, options.lend_bytes)

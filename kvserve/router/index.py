"""The global prefix index in Valkey/Redis: which instance (and which of its tiers) holds which block, and which
blocks the shared pool holds (llm-d's layout of the same idea).

Keys (`kvidx:` prefix; the hash is the prefix cache's chained block hash, in hex):
- `kvidx:b:<hash>`: a set of "<instance>|<medium>" (medium "device", "cpu", "disk": the instance's own pool and
  tiers);
- `kvidx:p:<hash>`: present while the shared pool is believed to hold the block (written when an instance reports
  it stored; expires after `pool_ttl_s`, since the pool evicts without telling anyone);
- `kvidx:i:<instance>|<medium>`: the reverse set, so an instance's entries can be dropped at once (it restarted,
  missed events, or left the rotation).
Everything here is a hint: a wrong entry costs a slower route, never a wrong output (the instance that gets the
request looks its blocks up itself).

The writer (`IndexWriter`, synchronous, the indexer thread's) applies event batches; the reader (`IndexReader`,
asyncio, the router's event loop) answers lookups with one pipelined round trip, within `timeout_s`: when the index
does not answer, the router routes by load.
"""

from __future__ import annotations

import logging

from kvserve.core.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

logger = logging.getLogger(__name__)

POOL = "pool"
LOCAL_MEDIA = ("device", "cpu", "disk")


def _b(h: str) -> str:
    return f"kvidx:b:{h}"


def _p(h: str) -> str:
    return f"kvidx:p:{h}"


def _i(instance: str, medium: str) -> str:
    return f"kvidx:i:{instance}|{medium}"


class IndexWriter:
    def __init__(self, url: str, pool_ttl_s: int = 3600, timeout_s: float = 2.0) -> None:
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        self.client = redis.Redis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s, retry=Retry(NoBackoff(), 1)
        )
        self.pool_ttl_s = pool_ttl_s
        self.errors = (redis.RedisError, OSError)

    def apply(self, instance: str, batch: KVEventBatch) -> None:
        """Raises one of `self.errors` when the index is unreachable (the caller then resyncs later)."""
        pipe = self.client.pipeline(transaction=False)
        for event in batch.events:
            medium = event.medium or "device"
            if isinstance(event, BlockStored):
                for raw in event.block_hashes:
                    h = raw.hex()
                    if medium == POOL:
                        pipe.set(_p(h), 1, ex=self.pool_ttl_s)
                    else:
                        pipe.sadd(_b(h), f"{instance}|{medium}")
                        pipe.sadd(_i(instance, medium), h)
            elif isinstance(event, BlockRemoved):
                for raw in event.block_hashes:
                    h = raw.hex()
                    if medium == POOL:
                        pipe.delete(_p(h))
                    else:
                        pipe.srem(_b(h), f"{instance}|{medium}")
                        pipe.srem(_i(instance, medium), h)
            elif isinstance(event, AllBlocksCleared):
                pipe.execute()
                self.clear(instance, [medium])
                pipe = self.client.pipeline(transaction=False)
        pipe.execute()

    def clear(self, instance: str, media: list[str] | tuple[str, ...] = LOCAL_MEDIA) -> None:
        """Drop every entry of `instance` in `media`."""
        for medium in media:
            if medium == POOL:
                continue
            key = _i(instance, medium)
            hashes = self.client.smembers(key)
            pipe = self.client.pipeline(transaction=False)
            member = f"{instance}|{medium}"
            for raw in hashes:
                pipe.srem(_b(raw.decode() if isinstance(raw, bytes) else raw), member)
            pipe.delete(key)
            pipe.execute()

    def close(self) -> None:
        self.client.close()


class IndexReader:
    def __init__(self, url: str, timeout_s: float = 0.25) -> None:
        import redis.asyncio as aredis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        self.client = aredis.Redis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s, retry=Retry(NoBackoff(), 0)
        )
        self.failures = 0

    async def lookup(self, block_hashes: list[bytes]) -> tuple[dict[str, int] | None, int]:
        """(instance -> how many leading blocks it holds locally, how many leading blocks the pool holds); (None,
        0) when the index does not answer."""
        if not block_hashes:
            return {}, 0
        hexes = [h.hex() for h in block_hashes]
        try:
            pipe = self.client.pipeline(transaction=False)
            for h in hexes:
                pipe.smembers(_b(h))
            for h in hexes:
                pipe.exists(_p(h))
            results = await pipe.execute()
        except Exception as e:  # noqa: BLE001 - any index failure means "route by load"
            self.failures += 1
            if self.failures == 1 or self.failures % 100 == 0:
                logger.warning("prefix index unreachable (%s): routing by load", e)
            return None, 0
        self.failures = 0
        n = len(hexes)
        holders, pool = results[:n], results[n:]
        local: dict[str, int] = {}
        alive: set[str] | None = None
        for i, members in enumerate(holders):
            here = {(m.decode() if isinstance(m, bytes) else m).split("|", 1)[0] for m in members}
            alive = here if alive is None else alive & here
            if not alive:
                break
            for inst in alive:
                local[inst] = i + 1
        pool_hits = 0
        while pool_hits < n and pool[pool_hits]:
            pool_hits += 1
        return local, pool_hits

    async def close(self) -> None:
        await self.client.aclose()

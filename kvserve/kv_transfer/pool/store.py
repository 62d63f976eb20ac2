"""The shared pool's store, behind one small interface so it can be swapped.

`BlockStore`: whole-object puts and gets of stored blocks (kv_transfer/common/block_format.py) by key, and an
existence check, each a batch. Every call is bounded in time and never raises for a store that is down or slow:
it answers "missing" / "not stored", and the pool connector treats that as a miss (the prompt is recomputed).
Objects may vanish at any time (eviction, a restarted store): a hit is a hint, and a get that fails is a miss.

- `MooncakeBlockStore`: Mooncake Store (`mooncake_master` plus memory lent by `mooncake_client` storage nodes or by
  the engines), TCP transport, P2PHANDSHAKE (no metadata server). Gets and puts go straight from and into a
  registered staging buffer (`batch_get_into`, `batch_put_from`). Objects are immutable: a put of an existing key
  keeps the old value, which is the same block.
- `ValkeyBlockStore`: a Valkey/Redis server holding the bytes (LMCache's remote backend does the same), for hosts
  without Mooncake; eviction is the server's (`maxmemory` with an LRU policy).
"""

from __future__ import annotations

import ctypes
import logging
from abc import ABC, abstractmethod

from kvserve.kv_transfer.common import mooncake

logger = logging.getLogger(__name__)


class BlockStore(ABC):
    @abstractmethod
    def exists(self, keys: list[str]) -> list[bool]:
        """Which keys the store holds now (False for any key it cannot answer for)."""

    @abstractmethod
    def put_from(self, keys: list[str], addresses: list[int], sizes: list[int]) -> list[bool]:
        """Store each key's bytes from memory at addresses[i] (inside the registered buffer); True where stored."""

    @abstractmethod
    def get_into(self, keys: list[str], addresses: list[int], sizes: list[int]) -> list[bool]:
        """Read each key's object, exactly sizes[i] bytes, into addresses[i]; True where it arrived whole."""

    def register_buffer(self, address: int, size: int) -> None:  # noqa: B027 - optional hook
        """The staging memory every put_from / get_into address lies in."""

    def close(self) -> None:  # noqa: B027 - optional hook
        pass


class MooncakeBlockStore(BlockStore):
    def __init__(
        self,
        master: str,
        local_hostname: str = "127.0.0.1",
        metadata_server: str = "P2PHANDSHAKE",
        lend_bytes: int = 0,
        local_buffer_bytes: int = 16 << 20,
    ) -> None:
        """`lend_bytes`: memory this process lends to the pool (0: a pure client; storage nodes or other engines
        hold the objects)."""
        store_mod = mooncake.load("mooncake.store")
        self.store = store_mod.MooncakeDistributedStore()
        rc = self.store.setup(local_hostname, metadata_server, lend_bytes, local_buffer_bytes, "tcp", "", master)
        if rc != 0:
            raise ConnectionError(f"Mooncake store setup with master {master} failed (code {rc})")
        self._registered: list[int] = []

    def register_buffer(self, address: int, size: int) -> None:
        rc = self.store.register_buffer(address, size)
        if rc != 0:
            raise ConnectionError(f"Mooncake register_buffer failed (code {rc})")
        self._registered.append(address)

    def exists(self, keys: list[str]) -> list[bool]:
        if not keys:
            return []
        # 1 held, 0 missing, negative: the store could not answer (a miss all the same).
        return [code == 1 for code in self.store.batch_is_exist(keys)]

    def put_from(self, keys: list[str], addresses: list[int], sizes: list[int]) -> list[bool]:
        if not keys:
            return []
        return [code == 0 for code in self.store.batch_put_from(keys, addresses, sizes)]

    def get_into(self, keys: list[str], addresses: list[int], sizes: list[int]) -> list[bool]:
        if not keys:
            return []
        # Bytes read, or a negative code (-704 missing, -800 transfer failed, -900 the master is gone).
        return [got == size for got, size in zip(self.store.batch_get_into(keys, addresses, sizes), sizes, strict=True)]

    def close(self) -> None:
        for address in self._registered:
            self.store.unregister_buffer(address)
        self._registered = []
        self.store.close()


class ValkeyBlockStore(BlockStore):
    def __init__(self, url: str, timeout_s: float = 2.0, ttl_s: int | None = None) -> None:
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        # One quick retry: redis-py's default ten make a hung server a half-minute stall.
        self.client = redis.Redis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s, retry=Retry(NoBackoff(), 1)
        )
        self.ttl_s = ttl_s
        self._errors = (redis.RedisError, OSError)

    def exists(self, keys: list[str]) -> list[bool]:
        if not keys:
            return []
        try:
            pipe = self.client.pipeline(transaction=False)
            for key in keys:
                pipe.exists(key)
            return [bool(n) for n in pipe.execute()]
        except self._errors as e:
            logger.warning("KV pool (valkey) lookup failed: %s", e)
            return [False] * len(keys)

    def put_from(self, keys: list[str], addresses: list[int], sizes: list[int]) -> list[bool]:
        if not keys:
            return []
        try:
            pipe = self.client.pipeline(transaction=False)
            for key, address, size in zip(keys, addresses, sizes, strict=True):
                pipe.set(key, ctypes.string_at(address, size), ex=self.ttl_s, nx=True)
            pipe.execute()
            return [True] * len(keys)
        except self._errors as e:
            logger.warning("KV pool (valkey) put failed: %s", e)
            return [False] * len(keys)

    def get_into(self, keys: list[str], addresses: list[int], sizes: list[int]) -> list[bool]:
        if not keys:
            return []
        try:
            values = self.client.mget(keys)
        except self._errors as e:
            logger.warning("KV pool (valkey) get failed: %s", e)
            return [False] * len(keys)
        out = []
        for value, address, size in zip(values, addresses, sizes, strict=True):
            if value is None or len(value) != size:
                out.append(False)
                continue
            ctypes.memmove(address, value, size)
            out.append(True)
        return out

    def close(self) -> None:
        self.client.close()

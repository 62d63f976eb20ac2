"""KV blocks, their O(1) LRU free queue, and the prefix cache's hash -> block map.

Every block is in exactly one of three states:
  * in use        ref_cnt > 0, not in the free queue;
  * cached free   ref_cnt == 0, in the free queue, still reachable through `cached` (a future hit may revive it);
  * plain free    ref_cnt == 0, in the free queue, no hash.
Allocation pops from the front of the free queue; a popped block that still carries a hash is evicted from the
cache first. Freed blocks go to the back, so the front is always the least recently used.

Chain eviction (beyond vLLM): a cached block is only reachable if its whole chain of ancestors is cached, since
lookups stop at the first miss. When a block is evicted, its cached descendants become unreachable orphans, so
the free ones among them move to the *front* of the queue and are reclaimed before blocks that can still hit.
A descendant that is in use when its ancestor goes is sent to the front when it is freed.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from kvserve.core.hashing import BlockHash
from kvserve.core.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent

_MAX_QUEUED_EVENTS = 100_000


class KVBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash", "parent_hash", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        # Set only while the block is in the cache map.
        self.block_hash: BlockHash | None = None
        self.parent_hash: BlockHash | None = None
        # Intrusive links of the free queue; both None while the block is not in it.
        self.prev_free: KVBlock | None = None
        self.next_free: KVBlock | None = None

    def __repr__(self) -> str:
        cached = "" if self.block_hash is None else ", cached"
        return f"KVBlock({self.block_id}, ref={self.ref_cnt}{cached})"


class FreeBlockQueue:
    """Doubly linked list threaded through the blocks themselves: every operation is O(1) and allocates nothing."""

    def __init__(self, blocks: Iterable[KVBlock]) -> None:
        self._head = KVBlock(-1)  # sentinels
        self._tail = KVBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self.num_free_blocks

    def popleft(self) -> KVBlock:
        block = self._head.next_free
        if block is self._tail or block is None:
            raise ValueError("no free blocks")
        self.remove(block)
        return block

    def remove(self, block: KVBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        assert prev is not None and nxt is not None, f"{block} is not in the free queue"
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def append(self, block: KVBlock) -> None:
        self._insert_after(self._tail.prev_free, block)  # type: ignore[arg-type]

    def appendleft(self, block: KVBlock) -> None:
        self._insert_after(self._head, block)

    def _insert_after(self, anchor: KVBlock, block: KVBlock) -> None:
        assert block.prev_free is None and block.next_free is None, f"{block} is already in the free queue"
        nxt = anchor.next_free
        assert nxt is not None
        anchor.next_free = block
        block.prev_free = anchor
        block.next_free = nxt
        nxt.prev_free = block
        self.num_free_blocks += 1

    def block_ids(self) -> list[int]:
        """Front-to-back ids (for tests and debugging; O(n))."""
        ids = []
        block = self._head.next_free
        while block is not self._tail and block is not None:
            ids.append(block.block_id)
            block = block.next_free
        return ids


@dataclass
class PrefixCacheStats:
    """Cumulative counters. Queries and hits are counted once per admitted request (vLLM's definition)."""

    num_lookups: int = 0  # requests looked up
    num_query_tokens: int = 0  # tokens those requests asked for
    num_hit_tokens: int = 0
    num_hit_blocks: int = 0
    num_evictions: int = 0  # cached blocks whose hash was dropped to reuse the block

    @property
    def hit_rate(self) -> float:
        return self.num_hit_tokens / self.num_query_tokens if self.num_query_tokens else 0.0


class BlockPool:
    """`enable_kv_events`: queue a KVCacheEvent for every hash the cache gains or loses (`take_events`); the
    events name `block_size` tokens per block."""

    def __init__(
        self, num_blocks: int, enable_caching: bool = True, enable_kv_events: bool = False, block_size: int = 0
    ) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[BlockHash, KVBlock] = {}
        # parent hash -> hashes of cached blocks whose parent it is (the parent itself may be gone).
        self._children: dict[BlockHash, set[BlockHash]] = {}
        self.stats = PrefixCacheStats()
        self._events: list[KVCacheEvent] | None = [] if enable_kv_events else None
        self.block_size = block_size

    def _queue(self, event: KVCacheEvent) -> None:
        """Bounded: an engine whose events nobody drains (an offline LLM with events on) keeps the newest."""
        assert self._events is not None
        if len(self._events) >= _MAX_QUEUED_EVENTS:
            del self._events[: _MAX_QUEUED_EVENTS // 2]
        self._events.append(event)

    def take_events(self) -> list[KVCacheEvent]:
        """The events queued since the last call, oldest first."""
        if not self._events:
            return []
        events, self._events = self._events, []
        return events

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation could take now: plain free plus cached free (evictable)."""
        return self.free_queue.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests (cached free blocks count as free)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def get_cached_block(self, block_hash: BlockHash) -> KVBlock | None:
        return self.cached.get(block_hash)

    def get_new_blocks(self, num_blocks: int) -> list[KVBlock]:
        """Take `num_blocks` blocks from the LRU end, evicting their cache entries; each gets ref_cnt 1."""
        if num_blocks > self.num_free_blocks:
            raise ValueError(f"cannot allocate {num_blocks} blocks, only {self.num_free_blocks} free")
        new_blocks = []
        for _ in range(num_blocks):
            block = self.free_queue.popleft()
            if block.block_hash is not None:
                self._evict(block)
            block.ref_cnt = 1
            new_blocks.append(block)
        return new_blocks

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference on prefix-cache hits; a hit on a free cached block pulls it out of the queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def cache_full_blocks(
        self,
        blocks: list[KVBlock],
        block_hashes: list[BlockHash],
        num_cached: int,
        num_full: int,
        token_ids: list[int] | None = None,
    ) -> None:
        """Register blocks[num_cached:num_full] under block_hashes[i]. `token_ids`: the request's tokens (at least
        num_full blocks of them), for the BlockStored event.

        A hash that already maps to another block (the same prefix computed twice concurrently) keeps its first
        block; the duplicate stays uncached and returns to the plain free list when released.
        """
        if not self.enable_caching:
            return
        stored: list[int] = []  # indices newly registered, for the event
        for i in range(num_cached, num_full):
            block = blocks[i]
            if block.block_hash is not None:  # a prefix hit: already cached
                continue
            block_hash = block_hashes[i]
            if block_hash in self.cached:
                continue
            parent = block_hashes[i - 1] if i > 0 else None
            block.block_hash = block_hash
            block.parent_hash = parent
            self.cached[block_hash] = block
            if parent is not None:
                self._children.setdefault(parent, set()).add(block_hash)
            stored.append(i)
        if self._events is not None and stored:
            self._queue_stored(block_hashes, stored, token_ids)

    def _queue_stored(self, block_hashes: list[BlockHash], stored: list[int], token_ids: list[int] | None) -> None:
        """One BlockStored per run of consecutive newly cached blocks (a chain with one parent)."""
        assert self._events is not None
        block_size = self.block_size
        run: list[int] = []
        for i in [*stored, -1]:
            if run and (i != run[-1] + 1):
                first, last = run[0], run[-1] + 1
                tokens = token_ids[first * block_size : last * block_size] if token_ids is not None else []
                self._queue(
                    BlockStored(
                        block_hashes=[block_hashes[j] for j in run],
                        parent_block_hash=block_hashes[first - 1] if first > 0 else None,
                        token_ids=list(tokens),
                        block_size=block_size,
                    )
                )
                run = []
            if i >= 0:
                run.append(i)

    def free_blocks(self, ordered_blocks: Iterable[KVBlock]) -> None:
        """Drop one reference from each block; blocks reaching 0 join the queue in the given order
        (callers pass a request's blocks tail-first, so a chain's tail is evicted before its head)."""
        for block in ordered_blocks:
            block.ref_cnt -= 1
            assert block.ref_cnt >= 0, f"{block} freed more often than referenced"
            if block.ref_cnt == 0:
                if self._is_orphan(block):
                    self.free_queue.appendleft(block)
                else:
                    self.free_queue.append(block)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash. Refused (False) while any block is in use, as in vLLM."""
        if self.num_free_blocks != self.num_blocks:
            return False
        for block in self.cached.values():
            block.block_hash = block.parent_hash = None
        self.cached.clear()
        self._children.clear()
        if self._events is not None:
            self._queue(AllBlocksCleared())
        return True

    def _is_orphan(self, block: KVBlock) -> bool:
        return block.parent_hash is not None and block.parent_hash not in self.cached

    def _evict(self, block: KVBlock) -> None:
        block_hash = block.block_hash
        assert block_hash is not None
        del self.cached[block_hash]
        if block.parent_hash is not None:
            siblings = self._children.get(block.parent_hash)
            if siblings is not None:
                siblings.discard(block_hash)
                if not siblings:
                    del self._children[block.parent_hash]
        block.block_hash = block.parent_hash = None
        self.stats.num_evictions += 1
        if self._events is not None:
            self._queue(BlockRemoved([block_hash]))
        self._demote_descendants(block_hash)

    def _demote_descendants(self, root_hash: BlockHash) -> None:
        """Move every free cached descendant of `root_hash` to the front of the queue."""
        stack = list(self._children.get(root_hash, ()))
        while stack:
            child_hash = stack.pop()
            child = self.cached[child_hash]
            if child.ref_cnt == 0:
                self.free_queue.remove(child)
                self.free_queue.appendleft(child)
            stack.extend(self._children.get(child_hash, ()))

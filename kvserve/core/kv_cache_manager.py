"""Per-request block tables on top of the block pool: prefix lookup, slot allocation, release."""

from __future__ import annotations

from kvserve.core.block_pool import BlockPool, KVBlock, PrefixCacheStats
from kvserve.request import Request
from kvserve.utils import cdiv

# Holds the place of a released block in a request's table (sliding window). Its id is never sent to a worker: a
# table goes out whole only to a new request (before anything is released); running ones get appended ids.
SKIPPED_BLOCK = KVBlock(-1)


class KVCacheManager:
    """Owns which blocks each request holds.

    Contract: the scheduler calls `get_computed_blocks` only for a request with no blocks yet (new or preempted),
    then `allocate_slots` with what it returned; `free` releases everything the request holds. Blocks are
    registered in the prefix cache as soon as the tokens that fill them are scheduled: within a step the model
    writes every token's KV before any attention reads it, so a request admitted later in the same step may
    already hit them.

    Sliding window (`sliding_window`: every layer has a window, the longest is this many keys): a query at
    position p reads keys from p - sliding_window + 1 on, so when `allocate_slots` schedules a request's tokens
    from position num_computed_tokens on, the blocks wholly before num_computed_tokens - sliding_window + 1 are
    never read again. They are released there (into the free queue, still cached: their KV stays valid for a
    prefix hit) and their places in the request's table hold `SKIPPED_BLOCK`, so positions keep their index. A
    request then holds at most cdiv(sliding_window - 1, block_size) + 1 blocks behind its next query. The caller
    must not let num_computed_tokens move back (speculative rollback) nor copy a table out (swap, connectors):
    engine/combinations.py refuses those with a window.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        enable_kv_events: bool = False,
        sliding_window: int | None = None,
    ) -> None:
        self.block_size = block_size
        self.sliding_window = sliding_window
        # Per request: how many leading table entries are SKIPPED_BLOCK.
        self._num_skipped: dict[str, int] = {}
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching, enable_kv_events, block_size)
        self.req_to_blocks: dict[str, list[KVBlock]] = {}
        # How many leading blocks of each request are registered in the cache (or were hits).
        self._num_cached_blocks: dict[str, int] = {}

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    @property
    def stats(self) -> PrefixCacheStats:
        return self.pool.stats

    def get_computed_blocks(self, request: Request) -> tuple[list[KVBlock], int]:
        """Longest run of cached full blocks at the start of the request; returns (blocks, num_tokens).

        At least one token is always left to compute, since the model must run on the last token to produce
        logits. Does not take references: pass the blocks to `allocate_slots`.
        """
        if not self.enable_caching:
            return [], 0
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        blocks: list[KVBlock] = []
        for block_hash in request.block_hashes[:max_hit_blocks]:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            blocks.append(block)
        return blocks, len(blocks) * self.block_size

    def record_lookup(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        """Count one admitted request's lookup (called once admission succeeds, so retries don't double count)."""
        stats = self.pool.stats
        stats.num_lookups += 1
        stats.num_query_tokens += num_query_tokens
        stats.num_hit_tokens += num_hit_tokens
        stats.num_hit_blocks += num_hit_tokens // self.block_size

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: list[KVBlock] | None = None,
        num_lookahead_tokens: int = 0,
        delay_caching: bool = False,
    ) -> list[int] | None:
        """Make room for `num_new_tokens` more tokens after the request's computed ones, plus
        `num_lookahead_tokens` slots past them that a draft model writes before the target computes them (vLLM's
        name); those never count as computed or get hashed.

        Returns the ids of blocks appended to the request's table (hits first, then fresh blocks), or None
        when the pool cannot supply them, in which case nothing changed. `delay_caching`: the new blocks' tokens
        may arrive by a KV connector load, so they join the prefix cache only once the load is reported done
        (`cache_blocks`, or the request's next allocation).
        """
        blocks = self.req_to_blocks.get(request.request_id)
        if blocks is not None and not new_computed_blocks and self.sliding_window is None:
            # A running request whose table already holds the new slots (a decode: 15 steps of 16 with blocks of
            # 16): nothing to take from the pool. Kept lean: it runs for every running request every step.
            num_total = request.num_computed_tokens + num_new_tokens
            if num_total + num_lookahead_tokens <= len(blocks) * self.block_size:
                if not delay_caching:
                    self.cache_blocks(request, num_total)
                return []
        new_computed_blocks = new_computed_blocks or []
        self._release_skipped(request)
        blocks = self.req_to_blocks.get(request.request_id, [])
        num_computed = request.num_computed_tokens + len(new_computed_blocks) * self.block_size
        num_total = num_computed + num_new_tokens
        num_required = cdiv(num_total + num_lookahead_tokens, self.block_size)
        num_fresh = max(0, num_required - len(blocks) - len(new_computed_blocks))
        # Hits on free cached blocks leave the free queue too, so they count against the free supply.
        num_revived = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if num_fresh + num_revived > self.pool.num_free_blocks:
            return None

        self.pool.touch(new_computed_blocks)
        fresh = self.pool.get_new_blocks(num_fresh)
        if request.request_id not in self.req_to_blocks:
            self.req_to_blocks[request.request_id] = blocks
            self._num_cached_blocks[request.request_id] = 0
        blocks.extend(new_computed_blocks)
        blocks.extend(fresh)

        if not delay_caching:
            self.cache_blocks(request, num_total)
        return [b.block_id for b in new_computed_blocks] + [b.block_id for b in fresh]

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Register the request's full blocks among its first `num_tokens` tokens in the prefix cache (those whose
        KV is written by the end of the current step, or was before)."""
        if not self.enable_caching:
            return
        req_id = request.request_id
        num_cached = self._num_cached_blocks[req_id]
        num_full = min(num_tokens, request.num_tokens) // self.block_size
        if num_full > num_cached:
            self.pool.cache_full_blocks(
                self.req_to_blocks[req_id], request.block_hashes, num_cached, num_full, request.all_token_ids
            )
            self._num_cached_blocks[req_id] = num_full

    def _release_skipped(self, request: Request) -> None:
        """Sliding window: release the request's blocks that no query from num_computed_tokens on reads."""
        blocks = self.req_to_blocks.get(request.request_id)
        if self.sliding_window is None or not blocks:
            return
        first_key = request.num_computed_tokens - self.sliding_window + 1
        num_skipped = self._num_skipped.get(request.request_id, 0)
        num_unread = min(max(0, first_key) // self.block_size, len(blocks))
        if num_unread <= num_skipped:
            return
        released = blocks[num_skipped:num_unread]
        blocks[num_skipped:num_unread] = [SKIPPED_BLOCK] * len(released)
        self._num_skipped[request.request_id] = num_unread
        # Newest first, as `free` does: the chain's head stays cached longest.
        self.pool.free_blocks(reversed(released))

    def num_held_blocks(self, request_id: str) -> int:
        """Blocks the request holds (its table without the released SKIPPED_BLOCK places)."""
        return len(self.req_to_blocks.get(request_id, [])) - self._num_skipped.get(request_id, 0)

    def free(self, request: Request) -> None:
        """Release every block of the request, tail first (the tail of a chain is the least reusable)."""
        blocks = self.req_to_blocks.pop(request.request_id, None)
        self._num_cached_blocks.pop(request.request_id, None)
        num_skipped = self._num_skipped.pop(request.request_id, 0)
        if blocks:
            self.pool.free_blocks(reversed(blocks[num_skipped:]))

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, [])]

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()

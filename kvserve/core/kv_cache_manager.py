"""Per-request block tables on top of the block pool: prefix lookup, slot allocation, release."""

from __future__ import annotations

from kvserve.core.block_pool import BlockPool, KVBlock, PrefixCacheStats
from kvserve.request import Request
from kvserve.utils import cdiv


class KVCacheManager:
    """Owns which blocks each request holds.

    Contract: the scheduler calls `get_computed_blocks` only for a request with no blocks yet (new or preempted),
    then `allocate_slots` with what it returned; `free` releases everything the request holds. Blocks are
    registered in the prefix cache as soon as the tokens that fill them are scheduled: within a step the model
    writes every token's KV before any attention reads it, so a request admitted later in the same step may
    already hit them.
    """

    def __init__(
        self, num_blocks: int, block_size: int, enable_caching: bool = True, enable_kv_events: bool = False
    ) -> None:
        self.block_size = block_size
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
        new_computed_blocks = new_computed_blocks or []
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

    def free(self, request: Request) -> None:
        """Release every block of the request, tail first (the tail of a chain is the least reusable)."""
        blocks = self.req_to_blocks.pop(request.request_id, None)
        self._num_cached_blocks.pop(request.request_id, None)
        if blocks:
            self.pool.free_blocks(reversed(blocks))

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, [])]

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()

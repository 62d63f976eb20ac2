"""Block pool: LRU order, touch, eviction, ref counting, chain eviction. Exact state, no torch."""

import pytest

from kvserve.core.block_pool import BlockPool, FreeBlockQueue, KVBlock
from kvserve.core.hashing import extend_block_hashes, hash_block_tokens, hash_request_tokens
from kvserve.core.kv_cache_manager import SKIPPED_BLOCK, KVCacheManager
from tests.core.helpers import make_request


def chain(n: int, start: int = 0) -> list[bytes]:
    """Hashes of a chain of n blocks of 4 tokens each."""
    return hash_request_tokens(list(range(start, start + 4 * n)), block_size=4)


def assert_all_free(pool: BlockPool) -> None:
    assert pool.num_free_blocks == pool.num_blocks
    assert all(b.ref_cnt == 0 for b in pool.blocks)
    assert sorted(pool.free_queue.block_ids()) == list(range(pool.num_blocks))


def test_free_queue_is_o1_linked_list():
    blocks = [KVBlock(i) for i in range(5)]
    q = FreeBlockQueue(blocks)
    assert q.block_ids() == [0, 1, 2, 3, 4]
    q.remove(blocks[2])
    assert q.block_ids() == [0, 1, 3, 4] and len(q) == 4
    q.appendleft(blocks[2])
    assert q.block_ids() == [2, 0, 1, 3, 4]
    assert q.popleft() is blocks[2]
    q.append(blocks[2])
    assert q.block_ids() == [0, 1, 3, 4, 2]
    with pytest.raises(AssertionError):
        q.append(blocks[2])  # already queued
    for _ in range(5):
        q.popleft()
    with pytest.raises(ValueError):
        q.popleft()


def test_allocation_takes_lru_front_and_free_appends_in_given_order():
    pool = BlockPool(6)
    a = pool.get_new_blocks(3)
    assert [b.block_id for b in a] == [0, 1, 2]
    assert [b.ref_cnt for b in a] == [1, 1, 1]
    assert pool.free_queue.block_ids() == [3, 4, 5]
    pool.free_blocks(reversed(a))
    assert pool.free_queue.block_ids() == [3, 4, 5, 2, 1, 0]
    b = pool.get_new_blocks(4)
    assert [x.block_id for x in b] == [3, 4, 5, 2]
    with pytest.raises(ValueError):
        pool.get_new_blocks(3)
    pool.free_blocks(b)
    assert_all_free(pool)


def test_cache_hit_touch_removes_free_block_from_queue():
    pool = BlockPool(4)
    hashes = chain(2)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(blocks, hashes, 0, 2)
    assert pool.get_cached_block(hashes[0]) is blocks[0]
    pool.free_blocks(reversed(blocks))
    assert pool.free_queue.block_ids() == [2, 3, 1, 0]
    # A hit on a free cached block takes it out of the queue and references it.
    hit = pool.get_cached_block(hashes[0])
    pool.touch([hit])
    assert hit.ref_cnt == 1 and pool.free_queue.block_ids() == [2, 3, 1]
    # A second hit on an in-use block only bumps the count.
    pool.touch([hit])
    assert hit.ref_cnt == 2 and len(pool.free_queue) == 3
    pool.free_blocks([hit, hit])
    assert pool.free_queue.block_ids() == [2, 3, 1, 0]
    assert_all_free(pool)


def test_eviction_of_lru_cached_block_drops_its_hash():
    pool = BlockPool(3)
    hashes = chain(3)
    blocks = pool.get_new_blocks(3)
    pool.cache_full_blocks(blocks, hashes, 0, 3)
    pool.free_blocks(reversed(blocks))  # queue: 2, 1, 0 (tail of the chain first)
    new = pool.get_new_blocks(1)
    assert new[0].block_id == 2 and new[0].block_hash is None
    assert pool.get_cached_block(hashes[2]) is None
    assert pool.get_cached_block(hashes[0]) is blocks[0]
    assert pool.stats.num_evictions == 1
    pool.free_blocks(new)
    assert_all_free(pool)


def test_ref_counting_with_shared_prefix():
    pool = BlockPool(8)
    shared = chain(2)
    a = pool.get_new_blocks(3)
    a_hashes = shared + [hash_block_tokens(shared[-1], [100, 101, 102, 103])]
    pool.cache_full_blocks(a, a_hashes, 0, 3)
    # Request B shares the two prefix blocks and adds its own third block.
    hits = [pool.get_cached_block(h) for h in shared]
    pool.touch(hits)
    b_own = pool.get_new_blocks(1)
    assert [x.ref_cnt for x in a] == [2, 2, 1]
    pool.free_blocks(reversed(a))
    assert [x.ref_cnt for x in a] == [1, 1, 0]
    assert pool.free_queue.block_ids()[-1] == a[2].block_id  # only A's own block came back
    pool.free_blocks(reversed(hits + b_own))
    assert_all_free(pool)
    # Cached blocks stay reachable after everyone is gone.
    assert all(pool.get_cached_block(h) is not None for h in a_hashes)


def test_duplicate_hash_keeps_first_block():
    pool = BlockPool(4)
    hashes = chain(1)
    a = pool.get_new_blocks(1)
    b = pool.get_new_blocks(1)
    pool.cache_full_blocks(a, hashes, 0, 1)
    pool.cache_full_blocks(b, hashes, 0, 1)
    assert pool.get_cached_block(hashes[0]) is a[0]
    assert b[0].block_hash is None
    pool.free_blocks(a + b)
    assert_all_free(pool)


def test_chain_eviction_moves_orphaned_descendants_to_front():
    pool = BlockPool(8)
    hashes = chain(3)  # H0 <- H1 <- H2
    blocks = pool.get_new_blocks(3)  # ids 0, 1, 2
    pool.cache_full_blocks(blocks, hashes, 0, 3)
    other = pool.get_new_blocks(2)  # ids 3, 4: plain blocks of another request
    # Free the chain head-first so that H0 is the least recently used block of the chain.
    pool.free_blocks(blocks)
    pool.free_blocks(other)
    assert pool.free_queue.block_ids() == [5, 6, 7, 0, 1, 2, 3, 4]
    # Allocating 4 blocks reaches block 0 (H0): evicting it orphans H1 and H2, which jump to the front.
    taken = pool.get_new_blocks(4)
    assert [b.block_id for b in taken][:4] == [5, 6, 7, 0]
    assert pool.free_queue.block_ids()[:2] in ([1, 2], [2, 1])
    assert pool.free_queue.block_ids()[2:] == [3, 4]
    # The orphans are reclaimed before the plain blocks 3 and 4, although those were freed after them.
    more = pool.get_new_blocks(2)
    assert sorted(b.block_id for b in more) == [1, 2]
    assert pool.get_cached_block(hashes[1]) is None and pool.get_cached_block(hashes[2]) is None
    assert pool.stats.num_evictions == 3
    pool.free_blocks(taken + more)
    assert_all_free(pool)


def test_chain_eviction_without_it_orphans_would_outlive_useful_blocks():
    """The same scenario with a useful cached chain behind the orphans: the useful chain survives."""
    pool = BlockPool(6)
    dead = chain(3, start=0)
    useful = chain(2, start=1000)
    d = pool.get_new_blocks(3)  # 0, 1, 2
    pool.cache_full_blocks(d, dead, 0, 3)
    u = pool.get_new_blocks(2)  # 3, 4
    pool.cache_full_blocks(u, useful, 0, 2)
    pool.free_blocks(d)  # queue: 5, 0, 1, 2
    pool.free_blocks(reversed(u))  # queue: 5, 0, 1, 2, 4, 3
    taken = pool.get_new_blocks(4)  # 5, 0 (evicts H0 -> 1, 2 to the front), 1, 2 (or 2, 1)
    assert sorted(b.block_id for b in taken) == [0, 1, 2, 5]
    assert all(pool.get_cached_block(h) is not None for h in useful)
    pool.free_blocks(taken)


def test_in_use_orphan_goes_to_front_when_freed():
    pool = BlockPool(4)
    hashes = chain(2)
    blocks = pool.get_new_blocks(2)  # 0 (H0), 1 (H1)
    pool.cache_full_blocks(blocks, hashes, 0, 2)
    pool.free_blocks([blocks[0]])  # H0 free, H1 still in use
    assert pool.free_queue.block_ids() == [2, 3, 0]
    taken = pool.get_new_blocks(3)  # 2, 3, then 0 evicting H0 while H1 is in use
    assert pool.get_cached_block(hashes[0]) is None
    pool.free_blocks([blocks[1]])  # orphan H1 freed: front of the queue
    pool.free_blocks(taken)
    assert pool.free_queue.block_ids() == [1, 2, 3, 0]


def test_reset_prefix_cache_refused_while_blocks_in_use():
    pool = BlockPool(2)
    blocks = pool.get_new_blocks(1)
    pool.cache_full_blocks(blocks, chain(1), 0, 1)
    assert not pool.reset_prefix_cache()
    pool.free_blocks(blocks)
    assert pool.reset_prefix_cache()
    assert pool.cached == {} and blocks[0].block_hash is None


def test_hash_chains_distinguish_prefixes_and_salts():
    tokens = [1, 2, 3, 4]
    assert hash_block_tokens(None, tokens) == hash_block_tokens(None, tokens)
    assert hash_block_tokens(None, tokens) != hash_block_tokens(b"x" * 16, tokens)
    assert hash_block_tokens(None, tokens) != hash_block_tokens(None, tokens, ("salt",))
    assert len(hash_block_tokens(None, tokens)) == 16
    a = hash_request_tokens([9] * 4 + tokens, 4)
    b = hash_request_tokens([8] * 4 + tokens, 4)
    assert a[1] != b[1]  # same tokens, different parents


def test_extend_block_hashes_grows_incrementally_to_the_whole_chain():
    tokens = list(range(13))
    whole = hash_request_tokens(tokens, 4, ("salt",))
    assert len(whole) == 3
    hashes: list[bytes] = []
    for n in range(len(tokens) + 1):
        extend_block_hashes(hashes, tokens[:n], 4, ("salt",))
        assert hashes == whole[: n // 4]
    assert whole[0] == hash_block_tokens(None, tokens[:4], ("salt",))
    assert whole[1] == hash_block_tokens(whole[0], tokens[4:8])


def test_request_block_hashes_follow_the_shared_chain_as_it_decodes():
    req = make_request("r", list(range(6)), block_size=4, cache_salt="s")
    assert req.block_hashes == hash_request_tokens(list(range(6)), 4, ("s",))
    for t in (6, 7, 8):
        req.append_output_token_id(t)
    assert req.block_hashes == hash_request_tokens(list(range(9)), 4, ("s",))
    assert len(req.block_hashes) == 2


def test_sliding_window_releases_blocks_behind_the_window_and_hits_stay_exact():
    """Window 6, blocks of 4: once a request has computed 16 tokens, its next queries (from position 16) read
    keys from 11 on, so blocks 0 and 1 (positions 0-7) are released in place, still cached for prefix hits."""
    kv = KVCacheManager(num_blocks=10, block_size=4, sliding_window=6)
    req = make_request("a", list(range(10, 30)), block_size=4)  # 20 prompt tokens
    assert kv.allocate_slots(req, 8) == [0, 1]
    req.num_computed_tokens = 8
    assert kv.allocate_slots(req, 8) == [2, 3]  # first key 3: nothing released yet
    req.num_computed_tokens = 16
    assert kv.allocate_slots(req, 4) == [4]
    assert kv.get_block_ids("a") == [SKIPPED_BLOCK.block_id] * 2 + [2, 3, 4]
    assert kv.num_held_blocks("a") == 3 and kv.pool.num_free_blocks == 7
    assert [b.ref_cnt for b in kv.pool.blocks[:5]] == [0, 0, 1, 1, 1]
    # Released newest first, after the never-used blocks: the chain's head is evicted last.
    assert kv.pool.free_queue.block_ids()[-2:] == [1, 0]
    # The same prompt hits all four full blocks, the released ones included (their KV is still valid).
    other = make_request("b", list(range(10, 30)), block_size=4)
    blocks, num_tokens = kv.get_computed_blocks(other)
    assert [b.block_id for b in blocks] == [0, 1, 2, 3] and num_tokens == 16
    kv.free(req)
    assert kv.pool.num_free_blocks == 10 and all(b.ref_cnt == 0 for b in kv.pool.blocks)


def test_no_window_keeps_every_block():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    req = make_request("a", list(range(10, 30)), block_size=4)
    kv.allocate_slots(req, 16)
    req.num_computed_tokens = 16
    kv.allocate_slots(req, 4)
    assert kv.get_block_ids("a") == [0, 1, 2, 3, 4] and kv.num_held_blocks("a") == 5

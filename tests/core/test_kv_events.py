"""The block pool's KV events: exact events, in order, for stores, evictions (chains included) and a reset."""

from __future__ import annotations

from kvserve.core.block_pool import BlockPool
from kvserve.core.hashing import hash_request_tokens
from kvserve.core.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

BS = 2


def test_stored_removed_cleared_in_order():
    pool = BlockPool(4, enable_kv_events=True, block_size=BS)
    tokens = [1, 2, 3, 4, 5, 6]
    hashes = hash_request_tokens(tokens, BS)
    blocks = pool.get_new_blocks(3)
    pool.cache_full_blocks(blocks, hashes, 0, 2, tokens)
    pool.cache_full_blocks(blocks, hashes, 2, 3, tokens)
    assert pool.take_events() == [
        BlockStored(hashes[:2], None, [1, 2, 3, 4], BS),
        BlockStored(hashes[2:3], hashes[1], [5, 6], BS),
    ]
    assert pool.take_events() == []
    pool.free_blocks(reversed(blocks))
    pool.get_new_blocks(2)  # the free plain block, then the LRU cached one (the chain's tail, freed first)
    assert pool.take_events() == [BlockRemoved([hashes[2]])]


def test_reset_and_disabled():
    pool = BlockPool(2, enable_kv_events=True, block_size=BS)
    assert pool.reset_prefix_cache() and pool.take_events() == [AllBlocksCleared()]
    quiet = BlockPool(2, block_size=BS)
    blocks = quiet.get_new_blocks(1)
    quiet.cache_full_blocks(blocks, hash_request_tokens([1, 2], BS), 0, 1, [1, 2])
    assert quiet.take_events() == []

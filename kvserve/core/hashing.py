"""Chained block hashes for the prefix cache.

A block's hash covers its parent's hash, its own token ids and optional extra keys (e.g. a cache salt), so
equal hashes mean equal whole prefixes. We use the 128-bit xxh3 digest: at 2^-128 per pair, collisions are not
a practical concern even across billions of cached blocks, so hits are not re-verified against tokens.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

import xxhash

BlockHash = bytes  # 16-byte xxh3_128 digest

# Distinct seed for first blocks so a root block cannot collide with a child of some parent digest.
_ROOT = b"kvserve-root-block"


def hash_block_tokens(
    parent_hash: BlockHash | None, token_ids: Sequence[int], extra_keys: tuple | None = None
) -> BlockHash:
    h = xxhash.xxh3_128()
    h.update(parent_hash if parent_hash is not None else _ROOT)
    # Blocks are always full, so the token bytes have a fixed length and need no separator.
    h.update(array("q", token_ids).tobytes())
    if extra_keys:
        h.update(b"\x00extra:" + repr(extra_keys).encode())
    return h.digest()


def extend_block_hashes(
    block_hashes: list[BlockHash], token_ids: Sequence[int], block_size: int, extra_keys: tuple | None = None
) -> list[BlockHash]:
    """Append to `block_hashes` the hashes of the full blocks of `token_ids` it does not cover yet.

    `block_hashes` must hold the hashes of the first `len(block_hashes)` blocks of `token_ids` (it is extended in
    place and returned). `extra_keys` go into the first block only. Calling this after every appended token costs
    one hash per newly completed block, so a request's hashes grow incrementally as it decodes.
    """
    for i in range(len(block_hashes), len(token_ids) // block_size):
        parent = block_hashes[i - 1] if i > 0 else None
        block_hashes.append(
            hash_block_tokens(parent, token_ids[i * block_size : (i + 1) * block_size], extra_keys if i == 0 else None)
        )
    return block_hashes


def hash_request_tokens(token_ids: Sequence[int], block_size: int, extra_keys: tuple | None = None) -> list[BlockHash]:
    """Hashes of every full block of `token_ids` (extra keys go into the first block only)."""
    return extend_block_hashes([], token_ids, block_size, extra_keys)

"""An LRU index of the blocks a tier holds, keyed by chained block hash, with pins for blocks being loaded."""

from __future__ import annotations

from collections import OrderedDict

from kvserve.core.hashing import BlockHash


class TierIndex:
    """hash -> value (a RAM slot, or None for a disk file), least recently used first.

    A pinned entry (a load reads it) is never evicted. `capacity` counts entries (the byte budget divided by the
    bytes of one block).
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._entries: OrderedDict[BlockHash, int | None] = OrderedDict()
        self._pins: dict[BlockHash, int] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self._entries

    def get(self, block_hash: BlockHash) -> int | None:
        return self._entries[block_hash]

    def touch(self, block_hash: BlockHash) -> None:
        self._entries.move_to_end(block_hash)

    def pin(self, block_hash: BlockHash) -> None:
        self._pins[block_hash] = self._pins.get(block_hash, 0) + 1

    def unpin(self, block_hash: BlockHash) -> None:
        n = self._pins[block_hash] - 1
        if n:
            self._pins[block_hash] = n
        else:
            del self._pins[block_hash]

    @property
    def num_pinned(self) -> int:
        return len(self._pins)

    def make_room(self) -> tuple[BlockHash, int | None] | None | bool:
        """Evict the least recently used unpinned entry if the index is full. Returns the evicted (hash, value),
        None when there was room already, or False when every entry is pinned."""
        if len(self._entries) < self.capacity:
            return None
        for block_hash in self._entries:
            if block_hash not in self._pins:
                return block_hash, self._entries.pop(block_hash)
        return False

    def insert(self, block_hash: BlockHash, value: int | None) -> None:
        """Add as most recently used; the caller made room first."""
        assert len(self._entries) < self.capacity and block_hash not in self._entries
        self._entries[block_hash] = value

    def remove(self, block_hash: BlockHash) -> int | None:
        self._pins.pop(block_hash, None)
        return self._entries.pop(block_hash, None)

    def hashes(self) -> list[BlockHash]:
        return list(self._entries)

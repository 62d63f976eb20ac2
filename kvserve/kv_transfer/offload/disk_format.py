"""One block per file, in the shared block format (kv_transfer/common/block_format.py): its header, then the
payload. A file that is short, foreign or fails its checksum is rejected, never loaded."""

from __future__ import annotations

import os

from kvserve.kv_transfer.common.block_format import BadBlock, check, header, layout_digest, stored_size

__all__ = ["BadBlockFile", "file_name", "file_size", "hash_of", "layout_digest", "read_block", "write_block"]
SUFFIX = ".kvb"

BadBlockFile = BadBlock  # a block file that must be treated as a miss; the message says why
file_size = stored_size


def file_name(block_hash: bytes) -> str:
    return block_hash.hex() + SUFFIX


def hash_of(name: str) -> bytes | None:
    """The block hash a file name stands for, or None for a foreign name."""
    if not name.endswith(SUFFIX):
        return None
    try:
        return bytes.fromhex(name[: -len(SUFFIX)])
    except ValueError:
        return None


def write_block(path: str, digest: bytes, payload: bytes | memoryview) -> None:
    """Atomic: readers see the old file, no file, or the whole new one. `payload` is flat (len() counts bytes)."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(header(digest, payload))
        f.write(payload)
    os.replace(tmp, path)


def read_block(path: str, digest: bytes, payload_bytes: int) -> memoryview:
    """The payload, checked, as a writable view (torch.frombuffer takes it without a copy)."""
    data = bytearray(stored_size(payload_bytes) + 1)
    try:
        with open(path, "rb") as f:
            size = f.readinto(data)
    except OSError as e:
        raise BadBlockFile(f"cannot read: {e.strerror or e}") from None
    return check(memoryview(data)[:size], digest, payload_bytes)

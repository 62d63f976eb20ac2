"""One block per file: a header (magic, version, layout digest, payload length, xxh3-64 of the payload) and the
payload (K and V of every layer). A file that is short, foreign or fails its checksum is rejected, never loaded."""

from __future__ import annotations

import os
import struct

import xxhash

_MAGIC = b"KVB1"
_HEADER = struct.Struct("<4sI16sQQ")  # magic, version, layout digest, payload bytes, payload xxh3-64
_VERSION = 1
SUFFIX = ".kvb"


class BadBlockFile(Exception):
    """A block file that must be treated as a miss; the message says why."""


def layout_digest(layout_id: str) -> bytes:
    return xxhash.xxh3_128_digest(layout_id.encode())


def file_size(payload_bytes: int) -> int:
    return _HEADER.size + payload_bytes


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
    header = _HEADER.pack(_MAGIC, _VERSION, digest, len(payload), xxhash.xxh3_64_intdigest(payload))
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(header)
        f.write(payload)
    os.replace(tmp, path)


def read_block(path: str, digest: bytes, payload_bytes: int) -> memoryview:
    """The payload, checked, as a writable view (torch.frombuffer takes it without a copy)."""
    data = bytearray(_HEADER.size + payload_bytes + 1)
    try:
        with open(path, "rb") as f:
            size = f.readinto(data)
    except OSError as e:
        raise BadBlockFile(f"cannot read: {e.strerror or e}") from None
    if size != _HEADER.size + payload_bytes:
        raise BadBlockFile(f"size {size} bytes, expected {_HEADER.size + payload_bytes}")
    magic, version, file_digest, length, checksum = _HEADER.unpack_from(data)
    if magic != _MAGIC or version != _VERSION or length != payload_bytes:
        raise BadBlockFile("not a kvserve block file of this version")
    if file_digest != digest:
        raise BadBlockFile("written for another model or KV layout")
    payload = memoryview(data)[_HEADER.size : size]
    if xxhash.xxh3_64_intdigest(payload) != checksum:
        raise BadBlockFile("checksum mismatch")
    return payload

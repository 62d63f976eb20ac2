"""The bytes of one stored KV block, wherever it is stored (a disk tier's file, a shared pool's object): a header
(magic, version, layout digest, payload length, xxh3-64 of the payload) and the payload (this rank's K and V of
every layer, then the same block of every pool that mirrors the block ids). A block that is short, foreign or fails
its checksum is rejected, never loaded: a miss, recomputed."""

from __future__ import annotations

import struct

import xxhash

_MAGIC = b"KVB1"
_HEADER = struct.Struct("<4sI16sQQ")  # magic, version, layout digest, payload bytes, payload xxh3-64
_VERSION = 1
HEADER_BYTES = _HEADER.size


class BadBlock(Exception):
    """Stored bytes that must be treated as a miss; the message says why."""


def layout_digest(layout_id: str) -> bytes:
    return xxhash.xxh3_128_digest(layout_id.encode())


def stored_size(payload_bytes: int) -> int:
    return HEADER_BYTES + payload_bytes


def header(digest: bytes, payload: bytes | memoryview) -> bytes:
    """The header for `payload` (flat: len() counts bytes)."""
    return _HEADER.pack(_MAGIC, _VERSION, digest, len(payload), xxhash.xxh3_64_intdigest(payload))


def check(data: memoryview, digest: bytes, payload_bytes: int) -> memoryview:
    """The payload of `data` (header + payload, exactly), checked; raises BadBlock."""
    if len(data) != HEADER_BYTES + payload_bytes:
        raise BadBlock(f"size {len(data)} bytes, expected {HEADER_BYTES + payload_bytes}")
    magic, version, stored_digest, length, checksum = _HEADER.unpack_from(data)
    if magic != _MAGIC or version != _VERSION or length != payload_bytes:
        raise BadBlock("not a kvserve block of this version")
    if stored_digest != digest:
        raise BadBlock("written for another model or KV layout")
    payload = data[HEADER_BYTES:]
    if xxhash.xxh3_64_intdigest(payload) != checksum:
        raise BadBlock("checksum mismatch")
    return payload

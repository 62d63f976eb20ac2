"""The side channel's messages: typed msgpack frames (4-byte big-endian length, then the message) on a TCP socket,
and the handshake check both sides of a transfer rely on.

A consumer rank opens a connection to the producer rank of the same index and sends one `Pull` (or a `Release`).
The producer answers a `Pull` with a `Reply`; if it is ok, the blocks follow: raw bytes on the same socket (tcp)
or a Mooncake write into the consumer's memory followed by a `Done` frame (mooncake).
"""

from __future__ import annotations

import socket
import struct

import msgspec

from kvserve.kv_cache_spec import KVCacheSpec

_LEN = struct.Struct("!I")
MAX_FRAME = 16 << 20  # a Pull of a 1M-token prompt's block ids fits many times over

# Reply kinds.
OK = "ok"
MISMATCH = "mismatch"  # the two engines' KV caches differ: never recomputable into success by retrying
LEASE = "lease"  # the producer no longer (or never) held the request's blocks
ERROR = "error"  # anything else (bad request, transfer failure)


class Handshake(msgspec.Struct, frozen=True):
    """What decides whether one engine's block bytes mean the same in another's pool, for one rank."""

    engine_id: str
    layout_id: str  # model, dtype, quantization, backend's order in a block, KV heads, head size, TP size, draft
    block_size: int
    tp_size: int
    tp_rank: int
    kv_dtype: str
    num_layers: int
    tensor_block_bytes: list[int]  # one block's bytes in each K/V tensor this rank moves (mirror pools included)

    @classmethod
    def of(cls, engine_id: str, spec: KVCacheSpec, rank: int, tensor_block_bytes: list[int]) -> Handshake:
        kv_dtype = spec.layers[0].kv_dtype if spec.layers else ""
        return cls(
            engine_id,
            spec.layout_id,
            spec.block_size,
            spec.tp_size,
            rank,
            kv_dtype,
            spec.num_layers,
            tensor_block_bytes,
        )


def incompatibility(mine: Handshake, theirs: Handshake) -> str | None:
    """None when `theirs` (a peer's) can exchange blocks with `mine`; else what differs, first the plain fields a
    user recognises, then the layout id (model, backend packing, ...) with its first differing part."""
    for name, label in (
        ("tp_size", "tensor-parallel size"),
        ("tp_rank", "tensor-parallel rank"),
        ("block_size", "KV block size"),
        ("kv_dtype", "KV dtype"),
        ("num_layers", "number of layers"),
        ("tensor_block_bytes", "bytes per block"),
    ):
        a, b = getattr(mine, name), getattr(theirs, name)
        if a != b:
            return f"{label} differs: engine {mine.engine_id} has {a}, engine {theirs.engine_id} has {b}"
    if mine.layout_id != theirs.layout_id:
        ours, other = mine.layout_id.split("|"), theirs.layout_id.split("|")
        diff = next(((a, b) for a, b in zip(ours, other, strict=False) if a != b), (mine.layout_id, theirs.layout_id))
        return (
            f"KV layout differs (model, dtype, quantization or attention backend): engine {mine.engine_id} has "
            f"{diff[0]!r}, engine {theirs.engine_id} has {diff[1]!r}"
        )
    return None


class Pull(msgspec.Struct, tag="pull"):
    handshake: Handshake
    request_id: str  # the producer's request id (its lease)
    first_block: int  # the first of the request's held blocks to send (the consumer has those before it)
    dst_block_ids: list[int]  # where they go in the consumer's pool, one per block sent
    transport: str  # "tcp" | "mooncake"
    # mooncake: the consumer's TransferEngine ("host:rpc_port") and the base address of each of its K/V tensors.
    mooncake_endpoint: str | None = None
    dst_bases: list[int] | None = None


class Release(msgspec.Struct, tag="release"):
    engine_id: str
    request_ids: list[str]


class Reply(msgspec.Struct):
    kind: str  # OK, MISMATCH, LEASE, ERROR
    error: str = ""
    nbytes: int = 0  # tcp: the bytes that follow


class Done(msgspec.Struct):
    ok: bool
    error: str = ""


_encoder = msgspec.msgpack.Encoder()
_request_decoder = msgspec.msgpack.Decoder(Pull | Release)
_reply_decoder = msgspec.msgpack.Decoder(Reply)
_done_decoder = msgspec.msgpack.Decoder(Done)


def send_frame(sock: socket.socket, message: msgspec.Struct) -> None:
    data = _encoder.encode(message)
    sock.sendall(_LEN.pack(len(data)) + data)


def _recv_frame(sock: socket.socket) -> bytes:
    (n,) = _LEN.unpack(recv_exact(sock, _LEN.size))
    if n > MAX_FRAME:
        raise ConnectionError(f"side-channel frame of {n} bytes (at most {MAX_FRAME})")
    return recv_exact(sock, n)


def recv_request(sock: socket.socket) -> Pull | Release:
    return _request_decoder.decode(_recv_frame(sock))


def recv_reply(sock: socket.socket) -> Reply:
    return _reply_decoder.decode(_recv_frame(sock))


def recv_done(sock: socket.socket) -> Done:
    return _done_decoder.decode(_recv_frame(sock))


def recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise ConnectionError("the peer closed the side channel")
        got += k
    return bytes(buf)

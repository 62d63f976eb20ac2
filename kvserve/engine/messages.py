"""Messages between the frontend and the engine-core process, as msgpack (msgspec): typed, compact, no pickle.

Frontend -> core: AddRequest, AbortRequests, Shutdown. Core -> frontend: Ready (once), CoreOutputs (every step
that produced something, and after aborts), CoreError (a request the core refused).
"""

from __future__ import annotations

import msgspec

from kvserve.outputs import EngineCoreOutput
from kvserve.request import EngineCoreRequest


class AddRequest(msgspec.Struct, tag="add"):
    request: EngineCoreRequest


class AbortRequests(msgspec.Struct, tag="abort"):
    request_ids: list[str]


class Shutdown(msgspec.Struct, tag="shutdown"):
    pass


class CoreStats(msgspec.Struct):
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_preemptions: int  # cumulative
    prefix_cache_queries: int  # cumulative, tokens
    prefix_cache_hits: int  # cumulative, tokens
    num_blocks: int
    num_free_blocks: int


class Ready(msgspec.Struct, tag="ready"):
    num_blocks: int
    max_tokens_per_request: int


class CoreOutputs(msgspec.Struct, tag="outputs"):
    outputs: list[EngineCoreOutput]
    stats: CoreStats


class CoreError(msgspec.Struct, tag="error"):
    request_id: str
    message: str


ToCore = AddRequest | AbortRequests | Shutdown
FromCore = Ready | CoreOutputs | CoreError

encoder = msgspec.msgpack.Encoder()
to_core_decoder = msgspec.msgpack.Decoder(ToCore)
from_core_decoder = msgspec.msgpack.Decoder(FromCore)

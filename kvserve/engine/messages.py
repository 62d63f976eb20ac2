"""Messages between the frontend and the engine-core process, as msgpack (msgspec): typed, compact, no pickle.

Frontend -> core: AddRequest, AbortRequests, Shutdown. Core -> frontend: Ready (once), CoreOutputs (every step
that produced something, and after aborts), CoreError (a request the core refused).
"""

from __future__ import annotations

from dataclasses import asdict

import msgspec

from kvserve.core.block_pool import PrefixCacheStats
from kvserve.core.spec_policy import SpecDecodingStats
from kvserve.outputs import EngineCoreOutput
from kvserve.request import EngineCoreRequest


class AddRequest(msgspec.Struct, tag="add"):
    request: EngineCoreRequest


class AbortRequests(msgspec.Struct, tag="abort"):
    request_ids: list[str]


class Shutdown(msgspec.Struct, tag="shutdown"):
    pass


class CoreStats(msgspec.Struct):
    """The engine core's state after a step, built by EngineCore.make_stats() only.

    It rides on every CoreOutputs to the frontend (for /metrics); LLM.stats() returns it as a dict (to_dict).
    """

    num_running: int
    num_waiting: int
    kv_cache_usage: float  # fraction of blocks held by requests
    num_preemptions: int  # cumulative
    num_blocks: int
    num_free_blocks: int
    block_size: int
    prefix_cache: PrefixCacheStats  # cumulative counters (a copy, not the live object)
    spec_decoding: SpecDecodingStats | None = None  # cumulative; None when speculation is off
    num_loading: int = 0  # requests waiting for a KV connector load
    num_swapped_out: int = 0  # cumulative preemptions by swap (counted in num_preemptions too)
    num_swapped_in: int = 0
    num_swap_fallbacks: int = 0  # swap preemptions that recomputed because the swap space was full
    # The KV connector's cumulative counters (offload: per-tier hit/miss blocks, bytes and seconds of loads and
    # saves); None without a connector.
    kv_transfer: dict[str, float] | None = None

    def to_dict(self) -> dict:
        """Plain values, with the prefix cache's hit rate and speculation's acceptance beside their counters."""
        cache, spec = self.prefix_cache, self.spec_decoding
        out = {**msgspec.structs.asdict(self), "prefix_cache": {**asdict(cache), "hit_rate": cache.hit_rate}}
        if spec is not None:
            out["spec_decoding"] = {
                **asdict(spec),
                "acceptance_rate": spec.acceptance_rate,
                "mean_acceptance_length": spec.mean_acceptance_length,
            }
        return out


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

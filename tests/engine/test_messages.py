"""The core -> frontend stats value: one builder (EngineCore.make_stats), one wire format, one dict view."""

from __future__ import annotations

from kvserve.core.block_pool import PrefixCacheStats
from kvserve.core.spec_policy import SpecDecodingStats
from kvserve.engine.messages import CoreOutputs, CoreStats, encoder, from_core_decoder


def make_stats() -> CoreStats:
    cache = PrefixCacheStats(num_lookups=2, num_query_tokens=40, num_hit_tokens=10, num_hit_blocks=2)
    return CoreStats(
        num_running=1,
        num_waiting=2,
        kv_cache_usage=0.25,
        num_preemptions=3,
        num_blocks=8,
        num_free_blocks=6,
        block_size=16,
        prefix_cache=cache,
    )


def test_core_stats_survive_the_wire():
    stats = make_stats()
    msg = from_core_decoder.decode(encoder.encode(CoreOutputs([], stats)))
    assert isinstance(msg, CoreOutputs) and msg.stats == stats
    assert isinstance(msg.stats.prefix_cache, PrefixCacheStats)


def test_core_stats_dict_view():
    assert make_stats().to_dict() == {
        "num_running": 1,
        "num_waiting": 2,
        "kv_cache_usage": 0.25,
        "num_preemptions": 3,
        "num_blocks": 8,
        "num_free_blocks": 6,
        "block_size": 16,
        "prefix_cache": {
            "num_lookups": 2,
            "num_query_tokens": 40,
            "num_hit_tokens": 10,
            "num_hit_blocks": 2,
            "num_evictions": 0,
            "hit_rate": 0.25,
        },
        "spec_decoding": None,
        "num_loading": 0,
        "num_swapped_out": 0,
        "num_swapped_in": 0,
        "num_swap_fallbacks": 0,
        "kv_transfer": None,
    }


def test_kv_transfer_and_swap_stats_on_the_wire():
    stats = make_stats()
    stats.kv_transfer = {"ram_hit_blocks": 3.0, "load_time_s": 0.5}
    stats.num_swapped_out = 2
    msg = from_core_decoder.decode(encoder.encode(CoreOutputs([], stats)))
    assert msg.stats.kv_transfer == {"ram_hit_blocks": 3.0, "load_time_s": 0.5}
    assert msg.stats.num_swapped_out == 2


def test_spec_decoding_stats_on_the_wire_and_in_the_dict():
    spec = SpecDecodingStats(
        num_drafts=4, num_draft_tokens=10, num_accepted_tokens=6, num_accepted_tokens_per_pos=[4, 2]
    )
    stats = make_stats()
    stats.spec_decoding = spec
    msg = from_core_decoder.decode(encoder.encode(CoreOutputs([], stats)))
    assert msg.stats.spec_decoding == spec
    assert stats.to_dict()["spec_decoding"] == {
        "num_drafts": 4,
        "num_draft_tokens": 10,
        "num_accepted_tokens": 6,
        "num_accepted_tokens_per_pos": [4, 2],
        "acceptance_rate": 0.6,
        "mean_acceptance_length": 2.5,
    }


def test_structured_outputs_survive_both_wires():
    """A constrained request to the engine core, and a step's bitmask to the worker processes (TP ranks)."""
    from kvserve.core.sched_output import SchedulerOutput
    from kvserve.engine.messages import AddRequest, encoder, to_core_decoder
    from kvserve.executor import wire
    from kvserve.request import EngineCoreRequest
    from kvserve.sampling_params import SamplingParams, StructuredOutputsParams

    for spec in (
        StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": ["integer", "null"]}}}),
        StructuredOutputsParams(json='{"type": "string"}'),
        StructuredOutputsParams(choice=["x", "y"]),
        StructuredOutputsParams(json_object=True),
    ):
        req = EngineCoreRequest("r", [1, 2], SamplingParams(structured_outputs=spec), frozenset({2}), 1.0, 5)
        back = to_core_decoder.decode(encoder.encode(AddRequest(req)))
        assert back.request.sampling_params.structured_outputs == spec
    so = SchedulerOutput(
        structured_output_request_ids=["a", "b"], grammar_bitmask=bytes(range(16)), grammar_bitmask_words=2
    )
    back = wire.step_decoder.decode(wire.encoder.encode(so))
    assert (back.structured_output_request_ids, back.grammar_bitmask, back.grammar_bitmask_words) == (
        ["a", "b"],
        bytes(range(16)),
        2,
    )

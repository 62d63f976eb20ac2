"""KVOutputAggregator: the engine's view of the ranks' connector reports, exact states."""

from __future__ import annotations

from kvserve.kv_transfer.aggregate import KVOutputAggregator
from kvserve.kv_transfer.base import KVConnectorOutput as Out


def test_a_load_is_done_when_every_rank_reports_it():
    agg = KVOutputAggregator(2)
    got = agg.aggregate([Out(finished_loading={"a", "b"}), Out(finished_loading={"a"})])
    assert got.finished_loading == {"a"} and agg.num_pending == 1
    got = agg.aggregate([Out(), Out(finished_loading={"b"})])
    assert got.finished_loading == {"b"} and agg.num_pending == 0


def test_a_failure_on_any_rank_fails_the_load_with_the_fewest_tokens():
    agg = KVOutputAggregator(3)
    got = agg.aggregate([Out(finished_loading={"a"}), Out(failed_loading={"a": 32}), Out()])
    assert not got.finished_loading and not got.failed_loading
    got = agg.aggregate([Out(), Out(), Out(failed_loading={"a": 16})])
    assert got.failed_loading == {"a": 16} and not got.finished_loading


def test_saves_count_to_the_world_size_and_reports_stay_per_rank():
    agg = KVOutputAggregator(2)
    got = agg.aggregate([Out(finished_saving={"s"}, report="r0"), None])
    assert not got.finished_saving and got.report == ["r0", None]
    got = agg.aggregate([Out(), Out(finished_saving={"s"})])
    assert got.finished_saving == {"s"} and got.report is None
    assert agg.aggregate([None, None]) is None


def test_sub_outputs_are_aggregated_each_on_its_own():
    agg = KVOutputAggregator(2)
    got = agg.aggregate(
        [Out(sub_outputs=[Out(finished_loading={"x"}), Out()]), Out(sub_outputs=[Out(), Out(finished_loading={"x"})])]
    )
    # Connector 0 heard "x" from rank 0 only, connector 1 from rank 1 only: neither is done.
    assert [s.finished_loading for s in got.sub_outputs] == [set(), set()]
    got = agg.aggregate([Out(sub_outputs=[Out(), Out()]), Out(sub_outputs=[Out(finished_loading={"x"}), Out()])])
    assert [s.finished_loading for s in got.sub_outputs] == [{"x"}, set()]


def test_outputs_that_crossed_the_wire_as_maps_are_converted():
    import msgspec

    wire = msgspec.msgpack.decode(msgspec.msgpack.encode(Out(finished_loading={"a"}, failed_loading={"b": 8})))
    got = KVOutputAggregator(1).aggregate([wire])
    assert got.finished_loading == {"a"} and got.failed_loading == {"b": 8}

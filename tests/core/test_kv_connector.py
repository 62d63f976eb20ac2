"""The scheduler with a fake KV connector (asynchronous loads over several steps, synchronous loads within the step
that computes the rest, loads of either kind that fail, aborts while loading) and with swap preemption, against the
pure-function fake model of tests/core/helpers.py."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import pytest

from kvserve.attention.spec import AttentionSpec
from kvserve.config import CacheConfig, KVTransferConfig, SchedulerConfig
from kvserve.core.sched_output import SchedulerOutput
from kvserve.core.scheduler import Scheduler
from kvserve.kv_cache_spec import KVCacheSpec
from kvserve.kv_transfer.base import (
    KVConnectorMetadata,
    KVConnectorOutput,
    KVConnectorScheduler,
)
from kvserve.request import RequestStatus
from tests.core.helpers import (
    FakeRunner,
    assert_no_leak,
    make_request,
    make_scheduler,
    reference_output,
    run_to_completion,
)

BS = 4


@dataclass
class FakeMeta(KVConnectorMetadata):
    loads: dict[str, list[int]] = field(default_factory=dict)  # req_id -> block ids to load
    load_async: bool = True


class FakeConnector(KVConnectorScheduler):
    """Holds whatever prefixes `stored` lists (by block hash); its worker is simulated by FakeWorker."""

    def __init__(self, stored: set[bytes], load_async: bool = True) -> None:
        super().__init__(KVTransferConfig("fake"), KVCacheSpec(BS, (AttentionSpec("float32"),), (64,), "fake"))
        self.stored = stored
        self.load_async = load_async
        self._pending: dict[str, list[int]] = {}
        self.finished: list[str] = []
        self.reports: list[KVConnectorOutput] = []

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        n = 0
        for h in request.block_hashes[num_computed_tokens // BS : (request.num_tokens - 1) // BS]:
            if h not in self.stored:
                break
            n += 1
        return n * BS, self.load_async

    def update_state_after_alloc(self, request, block_ids, num_external_tokens):
        start = request.num_computed_tokens // BS
        if num_external_tokens:
            self._pending[request.request_id] = block_ids[start : start + num_external_tokens // BS]

    def build_connector_meta(self, scheduler_output, requests):
        meta = FakeMeta(self._pending, self.load_async)
        self._pending = {}
        return meta

    def update_connector_output(self, output):
        self.reports.append(output)

    def request_finished(self, request, block_ids):
        self.finished.append(request.request_id)
        return False, None


class FakeWorker:
    """Finishes each asynchronous load `num_steps` steps after it starts, each synchronous one in `start_load_kv`;
    `fail_at` (block index) fails every load there."""

    def __init__(self, num_steps: int = 1, fail_at: int | None = None) -> None:
        self.num_steps = num_steps
        self.fail_at = fail_at
        self.in_flight: dict[str, int] = {}  # req_id -> steps left
        self._out = KVConnectorOutput()

    def _done(self, req_id: str) -> None:
        if self.fail_at is None:
            self._out.finished_loading.add(req_id)
        else:
            self._out.failed_loading[req_id] = self.fail_at * BS

    def start_load_kv(self, meta: FakeMeta) -> set[str]:
        for req_id in meta.loads:
            if meta.load_async:
                self.in_flight[req_id] = self.num_steps
            else:
                self._done(req_id)
        return set(self._out.failed_loading)

    def get_finished(self) -> KVConnectorOutput:
        for req_id in list(self.in_flight):
            self.in_flight[req_id] -= 1
            if self.in_flight[req_id] == 0:
                del self.in_flight[req_id]
                self._done(req_id)
        out, self._out = self._out, KVConnectorOutput()
        return out


def run_step(s: Scheduler, so: SchedulerOutput, runner: FakeRunner, worker: FakeWorker):
    """One step as the real runner runs it: loads first, requests whose synchronous load failed left out."""
    skipped = worker.start_load_kv(so.kv_connector_metadata)
    forward = replace(
        so,
        scheduled_new_reqs=[new for new in so.scheduled_new_reqs if new.req_id not in skipped],
        num_scheduled_tokens={r: n for r, n in so.num_scheduled_tokens.items() if r not in skipped},
    )
    ro = runner.execute(forward)
    ro.kv_connector_output = worker.get_finished()
    return s.update_from_output(so, ro)


def drive(s: Scheduler, worker: FakeWorker, requests, on_step=None, max_steps: int = 500):
    for r in requests:
        s.add_request(r)
    runner = FakeRunner()
    outputs = {r.request_id: [] for r in requests}
    history = []
    for step in range(max_steps):
        if not s.has_unfinished_requests():
            break
        so = s.schedule()
        history.append(so)
        for out in run_step(s, so, runner, worker):
            outputs[out.request_id].extend(out.new_token_ids)
        if on_step is not None:
            on_step(step, s)
    else:
        raise AssertionError("requests did not finish")
    return outputs, history


def stored_prefix(prompt: list[int], num_blocks: int) -> set[bytes]:
    return set(make_request("probe", prompt, block_size=BS).block_hashes[:num_blocks])


def with_connector(connector: FakeConnector, **kw) -> Scheduler:
    base = make_scheduler(block_size=BS, **kw)
    return Scheduler(base.config, CacheConfig(block_size=BS), base.kv.num_blocks, connector=connector)


def test_async_load_over_several_steps_then_resumes_with_the_loaded_tokens():
    prompt = list(range(10, 31))  # 21 tokens: 5 full blocks, at most 5 loadable (one token left to compute)
    conn = FakeConnector(stored_prefix(prompt, 3))
    s = with_connector(conn)
    req = make_request("a", prompt, max_tokens=6, block_size=BS)
    statuses = []
    outputs, history = drive(s, FakeWorker(num_steps=3), [req], on_step=lambda i, s: statuses.append(req.status))
    # Three steps waiting for the load, nothing scheduled; then admitted with 12 tokens computed.
    assert statuses[:3] == [RequestStatus.WAITING_FOR_REMOTE_KVS] * 2 + [RequestStatus.WAITING]
    assert all(so.is_empty for so in history[:3])
    first = history[3].scheduled_new_reqs[0]
    assert first.req_id == "a" and first.num_computed_tokens == 12
    assert history[3].num_scheduled_tokens == {"a": 9}
    assert outputs["a"] == reference_output(prompt, 6)
    assert req.num_cached_tokens == 12
    assert conn.finished == ["a"]
    assert_no_leak(s)


def test_loading_blocks_are_not_prefix_hits_until_loaded():
    prompt = list(range(10, 31))
    conn = FakeConnector(stored_prefix(prompt, 3))
    s = with_connector(conn)
    s.add_request(make_request("a", prompt, max_tokens=2, block_size=BS))
    so = s.schedule()
    assert so.is_empty and "a" in s.loading
    # The same prompt again: the blocks being loaded must not count as cached.
    other = make_request("b", prompt, max_tokens=2, block_size=BS)
    assert s.kv.get_computed_blocks(other) == ([], 0)
    # After the load is reported they are registered at the next allocation, with the blocks computed then.
    runner = FakeRunner()
    ro = runner.execute(so)
    ro.kv_connector_output = KVConnectorOutput(finished_loading={"a"})
    s.update_from_output(so, ro)
    s.schedule()
    assert s.kv.get_computed_blocks(other)[1] == 20


def test_failed_load_recomputes_from_the_failed_block_without_losing_the_request():
    prompt = list(range(40, 63))
    conn = FakeConnector(stored_prefix(prompt, 4))
    s = with_connector(conn)
    req = make_request("a", prompt, max_tokens=5, block_size=BS)
    outputs, history = drive(s, FakeWorker(num_steps=2, fail_at=1), [req])
    new = next(so.scheduled_new_reqs[0] for so in history if so.scheduled_new_reqs)
    assert new.num_computed_tokens == 4  # only the first block loaded; the other three are recomputed
    assert outputs["a"] == reference_output(prompt, 5)
    assert conn.reports and any("a" in r.failed_loading for r in conn.reports)
    assert_no_leak(s)


class NoRecompute(FakeConnector):
    """Refuses to recompute what a failed load did not bring (a remote KV that must come from its source)."""

    def load_failure(self, request):
        return f"remote KV of {request.request_id} did not arrive"


def test_failed_load_ends_the_request_with_an_error_when_the_connector_refuses_a_recompute():
    prompt = list(range(40, 63))
    conn = NoRecompute(stored_prefix(prompt, 4))
    s = with_connector(conn)
    worker = FakeWorker(num_steps=2, fail_at=1)
    runner = FakeRunner()
    req = make_request("a", prompt, max_tokens=5, block_size=BS)
    other = make_request("b", list(range(100, 107)), max_tokens=3, block_size=BS)
    s.add_request(req)
    s.add_request(other)
    ended = []
    for _ in range(20):
        if not s.has_unfinished_requests():
            break
        so = s.schedule()
        assert "a" not in so.num_scheduled_tokens  # never computed
        ended += [o for o in run_step(s, so, runner, worker) if o.request_id == "a"]
    assert len(ended) == 1
    out = ended[0]
    assert (out.new_token_ids, out.finish_reason) == ([], "abort")
    assert out.kv_transfer_params == {"error": "remote KV of a did not arrive"}
    assert req.status == RequestStatus.FINISHED_ABORTED and sorted(conn.finished) == ["a", "b"]
    assert_no_leak(s)


def test_abort_while_loading_frees_blocks_only_after_the_load_reports():
    prompt = list(range(10, 31))
    conn = FakeConnector(stored_prefix(prompt, 3))
    s = with_connector(conn)
    worker = FakeWorker(num_steps=3)
    runner = FakeRunner()
    s.add_request(make_request("a", prompt, max_tokens=4, block_size=BS))
    so = s.schedule()
    held = s.kv.get_block_ids("a")
    assert len(held) == 3
    s.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    assert s.kv.get_block_ids("a") == held and s.has_unfinished_requests()  # the load still writes them
    for _ in range(5):
        run_step(s, so, runner, worker)
        if not s.has_unfinished_requests():
            break
        so = s.schedule()
    assert not s.has_unfinished_requests()
    assert_no_leak(s)


def test_local_prefix_hits_come_before_the_connector():
    prompt = list(range(10, 31))
    conn = FakeConnector(stored_prefix(prompt, 4))
    s = with_connector(conn)
    drive(s, FakeWorker(num_steps=1), [make_request("warm", prompt[:9], max_tokens=1, block_size=BS)])
    outputs, history = drive(s, FakeWorker(num_steps=1), [make_request("a", prompt, max_tokens=3, block_size=BS)])
    new = next(so.scheduled_new_reqs[0] for so in history if so.scheduled_new_reqs)
    assert new.num_computed_tokens == 16  # 2 blocks from the pool, 2 loaded
    assert outputs["a"] == reference_output(prompt, 3)
    assert_no_leak(s)


# ---------------------------------------------------------------------------------------------- synchronous loads


def test_sync_load_computes_the_rest_in_the_same_step():
    prompt = list(range(10, 31))
    conn = FakeConnector(stored_prefix(prompt, 3), load_async=False)
    s = with_connector(conn)
    req = make_request("a", prompt, max_tokens=6, block_size=BS)
    s.add_request(req)
    so = s.schedule()
    # Admitted at once with the 12 loaded tokens computed, the other 9 scheduled; never waiting for the load.
    (new,) = so.scheduled_new_reqs
    assert new.num_computed_tokens == 12 and so.num_scheduled_tokens == {"a": 9}
    assert so.kv_connector_metadata.loads == {"a": new.block_ids[:3]}
    assert req.status == RequestStatus.RUNNING and not s.loading
    # Until the load is reported, its blocks (and those the step computes after them) are no prefix hits.
    other = make_request("b", prompt, max_tokens=2, block_size=BS)
    assert s.kv.get_computed_blocks(other) == ([], 0)
    runner, worker = FakeRunner(), FakeWorker()
    outputs = run_step(s, so, runner, worker)
    assert [o.new_token_ids for o in outputs] == [reference_output(prompt, 1)]
    assert s.kv.get_computed_blocks(other)[1] == 20
    while s.has_unfinished_requests():
        for out in run_step(s, s.schedule(), runner, worker):
            outputs.append(out)
    assert [t for o in outputs for t in o.new_token_ids] == reference_output(prompt, 6)
    assert req.num_cached_tokens == 12 and conn.finished == ["a"]
    assert_no_leak(s)


@pytest.mark.parametrize("fail_at", [0, 1])
def test_failed_sync_load_sits_out_its_step_and_recomputes_without_losing_the_request(fail_at):
    prompt = list(range(40, 63))
    conn = FakeConnector(stored_prefix(prompt, 4), load_async=False)
    s = with_connector(conn)
    req = make_request("a", prompt, max_tokens=5, block_size=BS)
    other = make_request("b", list(range(200, 209)), max_tokens=5, block_size=BS)
    outputs, history = drive(s, FakeWorker(fail_at=fail_at), [req, other])
    first, second = history[0], history[1]
    assert [new.req_id for new in first.scheduled_new_reqs] == ["a", "b"]
    assert first.num_scheduled_tokens["a"] == 23 - 16
    # The failed request was left out of the forward pass (the other one ran), then sent again in full from the
    # tokens that did load; the runner was told to forget it in between.
    assert "a" in second.finished_req_ids
    (again,) = [new for new in second.scheduled_new_reqs if new.req_id == "a"]
    assert again.num_computed_tokens == fail_at * BS and second.num_scheduled_tokens["a"] == 23 - fail_at * BS
    assert outputs["a"] == reference_output(prompt, 5)
    assert outputs["b"] == reference_output(other.prompt_token_ids, 5)
    assert req.num_cached_tokens == fail_at * BS
    assert any("a" in r.failed_loading for r in conn.reports)
    assert_no_leak(s)


# ---------------------------------------------------------------------------------------------- swap preemption


def swap_scheduler(num_blocks: int, num_swap_blocks: int) -> Scheduler:
    return Scheduler(
        SchedulerConfig(16, 64, 256, True, preemption_mode="swap"),
        CacheConfig(block_size=BS),
        num_blocks,
        num_swap_blocks=num_swap_blocks,
    )


def swap_requests():
    """Three decodes that a pool of 10 blocks cannot hold at once."""
    return [
        make_request(f"r{i}", list(range(100 * i + 5, 100 * i + 15)), max_tokens=12, block_size=BS) for i in range(3)
    ]


def run_swapped(num_swap_blocks: int) -> tuple[Scheduler, list[SchedulerOutput]]:
    """Run swap_requests() to completion on a 10-block pool; every output must match the reference."""
    s = swap_scheduler(num_blocks=10, num_swap_blocks=num_swap_blocks)
    reqs = swap_requests()
    outputs, history = run_to_completion(s, reqs)
    for r in reqs:
        assert outputs[r.request_id] == reference_output(r.prompt_token_ids, 12)
    assert_no_leak(s)
    return s, history


def test_swap_preemption_resumes_with_its_computed_tokens():
    s, history = run_swapped(num_swap_blocks=64)
    assert s.swap is not None and s.swap.stats.num_swapped_out > 0
    assert s.swap.stats.num_swapped_in == s.swap.stats.num_swapped_out
    assert s.swap.num_free_blocks == 64
    outs = [so for so in history if so.blocks_to_swap_out]
    ins = [so for so in history if so.blocks_to_swap_in]
    assert outs and ins
    # A swapped request comes back with its computed tokens, not from zero.
    resumed = [new for so in ins for new in so.scheduled_new_reqs]
    assert resumed and all(new.num_computed_tokens > 0 for new in resumed)
    for so in ins:
        swapped_in = {d for d, _ in so.blocks_to_swap_in}
        assert swapped_in <= {b for new in so.scheduled_new_reqs for b in new.block_ids}


def test_swap_falls_back_to_recompute_when_the_swap_space_is_full():
    s, _ = run_swapped(num_swap_blocks=1)
    assert s.swap is not None and s.swap.stats.num_swap_fallbacks > 0
    assert s.swap.num_free_blocks == 1


def test_abort_of_a_swapped_request_frees_its_swap_blocks():
    s = swap_scheduler(num_blocks=10, num_swap_blocks=64)
    reqs = swap_requests()
    for r in reqs:
        s.add_request(r)
    runner = FakeRunner()
    for _ in range(100):
        so = s.schedule()
        s.update_from_output(so, runner.execute(so))
        swapped = [r for r in s.waiting if r.status == RequestStatus.SWAPPED]
        if swapped:
            break
    assert swapped
    s.finish_requests([r.request_id for r in reqs], RequestStatus.FINISHED_ABORTED)
    assert s.swap.num_free_blocks == 64
    so = s.schedule()
    assert_no_leak(s)

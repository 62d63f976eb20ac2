"""Prometheus metrics, named like vLLM's with a `kvserve:` prefix (prometheus-client adds `_total` to counters).

The engine core reports its state (queues, KV usage, cumulative prefix-cache and preemption counts) with every
batch of outputs; the frontend measures latencies as tokens arrive. Each server owns its registry.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvserve.engine.messages import CoreStats
from kvserve.engine.output_processor import IterationStats

_LATENCY_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)


class EngineMetrics:
    def __init__(self, model_name: str, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        labels = ["model_name"]
        r = self.registry

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(f"kvserve:{name}", doc, labels, registry=r)

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(f"kvserve:{name}", doc, labels + list(extra), registry=r)

        def histogram(name: str, doc: str) -> Histogram:
            return Histogram(f"kvserve:{name}", doc, labels, buckets=_LATENCY_BUCKETS, registry=r)

        self._num_running = gauge("num_requests_running", "Requests in the running batch.")
        self._num_waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled (incl. preempted).")
        self._kv_usage = gauge("kv_cache_usage_perc", "Fraction of KV blocks held by requests (0..1).")
        self._prefix_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self._prefix_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self._preemptions = counter("num_preemptions", "Preemptions by recompute.")
        self._prompt_tokens = counter("prompt_tokens", "Prompt tokens of requests that started generating.")
        self._generation_tokens = counter("generation_tokens", "Generated tokens.")
        self._success = counter("request_success", "Finished requests by reason.", ("finished_reason",))
        self._ttft = histogram("time_to_first_token_seconds", "Time from arrival to the first token.")
        self._itl = histogram("inter_token_latency_seconds", "Time between consecutive tokens of a sequence.")
        self._e2e = histogram("e2e_request_latency_seconds", "Time from arrival to the last token.")
        self._queue = histogram("request_queue_time_seconds", "Time from arrival to first being scheduled.")
        self._spec_drafts = counter("spec_decode_num_drafts", "Verified drafts (one request's drafts in one step).")
        self._spec_draft_tokens = counter("spec_decode_num_draft_tokens", "Verified draft tokens.")
        self._spec_accepted = counter("spec_decode_num_accepted_tokens", "Accepted draft tokens.")
        self._spec_accepted_pos = counter(
            "spec_decode_num_accepted_tokens_per_pos", "Accepted draft tokens by position in the draft.", ("position",)
        )
        self._spec_rate = gauge("spec_decode_acceptance_rate", "Accepted / verified draft tokens since start.")
        self._spec_length = gauge(
            "spec_decode_mean_acceptance_length", "Tokens emitted per verified draft (accepted + 1) since start."
        )
        self._swaps = counter("num_swaps", "Swap preemption: swaps out, swaps in, fallbacks to recompute.", ("kind",))
        self._kv_transfer = Gauge(
            "kvserve:kv_transfer",
            "The KV connector's cumulative counters (offload: per-tier hit/miss/saved blocks, bytes, seconds).",
            labels + ["stat"],
            registry=r,
        )
        self._model = model_name
        self._last_core: CoreStats | None = None
        for m in (self._num_running, self._num_waiting, self._kv_usage):
            m.labels(model_name).set(0)
        for reason in ("stop", "length", "abort"):
            self._success.labels(model_name, reason)

    def record_core(self, stats: CoreStats) -> None:
        m = self._model
        self._num_running.labels(m).set(stats.num_running)
        self._num_waiting.labels(m).set(stats.num_waiting)
        self._kv_usage.labels(m).set(stats.kv_cache_usage)
        last = self._last_core
        cache, last_cache = stats.prefix_cache, last.prefix_cache if last else None
        self._prefix_queries.labels(m).inc(cache.num_query_tokens - (last_cache.num_query_tokens if last_cache else 0))
        self._prefix_hits.labels(m).inc(cache.num_hit_tokens - (last_cache.num_hit_tokens if last_cache else 0))
        self._preemptions.labels(m).inc(stats.num_preemptions - (last.num_preemptions if last else 0))
        for kind, now, before in (
            ("out", stats.num_swapped_out, last.num_swapped_out if last else 0),
            ("in", stats.num_swapped_in, last.num_swapped_in if last else 0),
            ("fallback", stats.num_swap_fallbacks, last.num_swap_fallbacks if last else 0),
        ):
            if now > before:
                self._swaps.labels(m, kind).inc(now - before)
        for name, value in (stats.kv_transfer or {}).items():
            self._kv_transfer.labels(m, name).set(value)
        spec = stats.spec_decoding
        if spec is not None:
            last_spec = last.spec_decoding if last else None
            self._spec_drafts.labels(m).inc(spec.num_drafts - (last_spec.num_drafts if last_spec else 0))
            self._spec_draft_tokens.labels(m).inc(
                spec.num_draft_tokens - (last_spec.num_draft_tokens if last_spec else 0)
            )
            self._spec_accepted.labels(m).inc(
                spec.num_accepted_tokens - (last_spec.num_accepted_tokens if last_spec else 0)
            )
            last_pos = last_spec.num_accepted_tokens_per_pos if last_spec else []
            for pos, n in enumerate(spec.num_accepted_tokens_per_pos):
                self._spec_accepted_pos.labels(m, str(pos)).inc(n - (last_pos[pos] if pos < len(last_pos) else 0))
            self._spec_rate.labels(m).set(spec.acceptance_rate)
            self._spec_length.labels(m).set(spec.mean_acceptance_length)
        self._last_core = stats

    def record_iteration(self, it: IterationStats) -> None:
        m = self._model
        if it.num_prompt_tokens:
            self._prompt_tokens.labels(m).inc(it.num_prompt_tokens)
        if it.num_generation_tokens:
            self._generation_tokens.labels(m).inc(it.num_generation_tokens)
        for v in it.time_to_first_tokens:
            self._ttft.labels(m).observe(v)
        for v in it.inter_token_latencies:
            self._itl.labels(m).observe(v)
        for v in it.queue_times:
            self._queue.labels(m).observe(v)
        for reason, e2e in it.finished:
            self._success.labels(m, reason).inc()
            self._e2e.labels(m).observe(e2e)

    def record_abort(self, count: int = 1) -> None:
        self._success.labels(self._model, "abort").inc(count)

    def mark_engine_dead(self) -> None:
        for g in (self._num_running, self._num_waiting, self._kv_usage):
            g.labels(self._model).set(0)

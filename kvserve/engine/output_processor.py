"""Frontend side of a step: EngineCoreOutputs -> text, stop strings, logprobs, RequestOutputs.

Each engine-core request is one sequence. A request with n > 1 is fanned out into n child sequences (sharing
the prompt's blocks through the prefix cache) and fanned back in here.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from transformers import PreTrainedTokenizerBase

from kvserve.engine.detokenizer import IncrementalDetokenizer
from kvserve.outputs import CompletionOutput, EngineCoreOutput, Logprob, RequestMetrics, RequestOutput
from kvserve.sampling_params import SamplingParams


class OutputKind(enum.Enum):
    FINAL_ONLY = enum.auto()  # one RequestOutput when every sequence has finished (offline LLM)
    DELTA = enum.auto()  # every step: only what is new since the last output (streaming)


@dataclass
class SequenceState:
    seq_id: str  # the engine-core request id
    index: int  # position among the parent's n sequences
    params: SamplingParams
    detokenizer: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # DELTA mode: how much has been streamed already, and whether the finishing chunk went out.
    num_sent_tokens: int = 0
    num_sent_chars: int = 0
    num_sent_logprobs: int = 0
    final_sent: bool = False
    last_token_time: float | None = None


@dataclass
class ParentState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    output_kind: OutputKind
    metrics: RequestMetrics
    sequences: list[SequenceState]
    num_cached_tokens: int = 0
    # The KV connector's parameters for the client (from a finishing sequence; with n > 1, the first one's).
    kv_transfer_params: dict | None = None

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.sequences)


@dataclass
class IterationStats:
    """What one batch of engine-core outputs tells about latency and volume (consumed by metrics)."""

    num_generation_tokens: int = 0
    num_prompt_tokens: int = 0  # of requests whose first token arrived now
    time_to_first_tokens: list[float] = field(default_factory=list)
    inter_token_latencies: list[float] = field(default_factory=list)
    queue_times: list[float] = field(default_factory=list)
    # (finish reason, end-to-end latency) of requests that finished now.
    finished: list[tuple[str, float]] = field(default_factory=list)


@dataclass
class ProcessedOutputs:
    request_outputs: list[RequestOutput]
    # Sequences the frontend finished (stop strings) that the engine core must abort.
    seq_ids_to_abort: list[str]
    stats: IterationStats


class OutputProcessor:
    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        self.parents: dict[str, ParentState] = {}
        self.seq_to_parent: dict[str, tuple[ParentState, SequenceState]] = {}

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        seqs: list[tuple[str, SamplingParams]],
        output_kind: OutputKind,
        arrival_time: float,
    ) -> None:
        parent = ParentState(
            request_id, prompt, prompt_token_ids, output_kind, RequestMetrics(arrival_time=arrival_time), []
        )
        for index, (seq_id, params) in enumerate(seqs):
            seq = SequenceState(seq_id, index, params, IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params))
            if params.logprobs is not None:
                seq.logprobs, seq.cumulative_logprob = [], 0.0
            parent.sequences.append(seq)
            self.seq_to_parent[seq_id] = (parent, seq)
        self.parents[request_id] = parent

    def has_unfinished_requests(self) -> bool:
        return bool(self.parents)

    def abort_request(self, request_id: str) -> list[str]:
        """Forget a request; returns the engine-core ids of its sequences."""
        parent = self.parents.pop(request_id, None)
        if parent is None:
            return []
        for seq in parent.sequences:
            self.seq_to_parent.pop(seq.seq_id, None)
        return [s.seq_id for s in parent.sequences]

    def process_outputs(self, outputs: list[EngineCoreOutput]) -> ProcessedOutputs:
        now = time.time()
        touched: dict[str, ParentState] = {}
        to_abort: list[str] = []
        stats = IterationStats()
        for out in outputs:
            entry = self.seq_to_parent.get(out.request_id)
            if entry is None:
                continue  # aborted by the user while in flight
            parent, seq = entry
            if seq.finish_reason is not None:
                continue
            metrics = parent.metrics
            if out.first_scheduled_time is not None and metrics.first_scheduled_time is None:
                metrics.first_scheduled_time = out.first_scheduled_time
                stats.queue_times.append(max(0.0, out.first_scheduled_time - metrics.arrival_time))
            if out.new_token_ids:
                stats.num_generation_tokens += len(out.new_token_ids)
                if metrics.first_token_time is None:
                    metrics.first_token_time = now
                    stats.time_to_first_tokens.append(now - metrics.arrival_time)
                    stats.num_prompt_tokens += len(parent.prompt_token_ids)
                elif seq.token_ids:
                    stats.inter_token_latencies.append(now - (seq.last_token_time or now))
                seq.last_token_time = now
                metrics.last_token_time = now
            parent.num_cached_tokens = max(parent.num_cached_tokens, out.num_cached_tokens)
            if out.kv_transfer_params is not None and parent.kv_transfer_params is None:
                parent.kv_transfer_params = out.kv_transfer_params
            seq.token_ids.extend(out.new_token_ids)
            if seq.logprobs is not None and out.new_logprobs:
                self._append_logprobs(seq, out.new_logprobs)
            # EOS (stop_reason None) or a stop token id; stop strings are found below, by the detokenizer. A
            # completed structured output ends on a token of its text.
            stopped_by_token = (
                out.finish_reason == "stop"
                and not out.grammar_completed
                and (out.stop_reason is None or isinstance(out.stop_reason, int))
            )
            skip_last = stopped_by_token and not seq.params.include_stop_str_in_output
            stop_str = seq.detokenizer.update(out.new_token_ids, skip_last)
            if stop_str is not None:
                seq.finish_reason, seq.stop_reason = "stop", stop_str
                if out.finish_reason is None:
                    to_abort.append(seq.seq_id)
            elif out.finish_reason is not None:
                seq.finish_reason, seq.stop_reason = out.finish_reason, out.stop_reason
            touched[parent.request_id] = parent

        request_outputs = []
        for parent in touched.values():
            finished = parent.finished
            if finished:
                parent.metrics.finished_time = now
                reason = parent.sequences[0].finish_reason or "stop"
                stats.finished.append((reason, now - parent.metrics.arrival_time))
                self.abort_request(parent.request_id)  # forget it
            if parent.output_kind == OutputKind.DELTA:
                request_outputs.append(self._make_output(parent, finished, delta=True))
            elif finished:
                request_outputs.append(self._make_output(parent, finished, delta=False))
        return ProcessedOutputs(request_outputs, to_abort, stats)

    def _append_logprobs(self, seq: SequenceState, entries: list[tuple[list[int], list[float], int]]) -> None:
        assert seq.logprobs is not None and seq.cumulative_logprob is not None
        for token_ids, lps, rank in entries:
            texts = self.tokenizer.batch_decode([[t] for t in token_ids])
            d: dict[int, Logprob] = {}
            for k, (tid, lp, text) in enumerate(zip(token_ids, lps, texts, strict=True)):
                if tid not in d:
                    d[tid] = Logprob(lp, rank if k == 0 else k, text)
            seq.logprobs.append(d)
            seq.cumulative_logprob += lps[0]

    def _make_output(self, parent: ParentState, finished: bool, delta: bool) -> RequestOutput:
        completions = []
        for seq in parent.sequences:
            completion = self._delta_completion(seq) if delta else self._full_completion(seq)
            if completion is not None:
                completions.append(completion)
        return RequestOutput(
            request_id=parent.request_id,
            prompt=parent.prompt,
            prompt_token_ids=parent.prompt_token_ids,
            outputs=completions,
            finished=finished,
            metrics=parent.metrics,
            num_cached_tokens=parent.num_cached_tokens,
            kv_transfer_params=parent.kv_transfer_params if finished else None,
        )

    @staticmethod
    def _full_completion(seq: SequenceState) -> CompletionOutput:
        return CompletionOutput(
            index=seq.index,
            text=seq.detokenizer.text_to_show(finished=True),
            token_ids=list(seq.token_ids),
            cumulative_logprob=seq.cumulative_logprob,
            logprobs=seq.logprobs,
            finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason,
        )

    @staticmethod
    def _delta_completion(seq: SequenceState) -> CompletionOutput | None:
        """What is new since the last delta; None if nothing is (a finished sequence reports once more)."""
        finished = seq.finish_reason is not None
        text = seq.detokenizer.text_to_show(finished)
        new_text = text[seq.num_sent_chars :]
        new_ids = seq.token_ids[seq.num_sent_tokens :]
        if not new_text and not new_ids and (not finished or seq.final_sent):
            return None
        new_lps = seq.logprobs[seq.num_sent_logprobs :] if seq.logprobs is not None else None
        seq.num_sent_chars = len(text)
        seq.num_sent_tokens = len(seq.token_ids)
        seq.num_sent_logprobs = len(seq.logprobs) if seq.logprobs is not None else 0
        seq.final_sent = finished
        return CompletionOutput(
            index=seq.index,
            text=new_text,
            token_ids=new_ids,
            cumulative_logprob=seq.cumulative_logprob,
            logprobs=new_lps,
            finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason,
        )

"""Values that leave a stage: ModelRunnerOutput (runner -> scheduler), EngineCoreOutput (core -> frontend)
and the user-facing RequestOutput (shaped like vLLM's)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None  # 1 = most likely
    decoded_token: str | None = None


# One dict per generated token: token id -> Logprob (the sampled token plus the top-N).
SampleLogprobs = list[dict[int, Logprob]]


@dataclass
class SpecStepTiming:
    """What a step with a proposer cost, measured by the runner (seconds, plain numbers for the speculation
    policy): the target's step (inputs, forward pass, logits, sampling or verification, tokens on the host),
    the proposer's pass over the requests it drafts for (a model proposer's run over their step positions, the
    n-gram search) and its draft steps."""

    step_seconds: float
    pass_seconds: float = 0.0
    num_pass_requests: int = 0
    draft_seconds: float = 0.0
    num_draft_tokens: int = 0  # drafted in the draft steps (EAGLE's first draft comes from its pass)


@dataclass
class ModelRunnerOutput:
    """Lists only, no tensors. `sampled_token_ids[i]` is empty for a request whose prefill is not finished."""

    req_ids: list[str]
    sampled_token_ids: list[list[int]]
    # Per request, per sampled token: (token ids, logprobs, rank of the sampled token); None when not asked.
    logprobs: list[list[tuple[list[int], list[float], int]] | None] | None = None
    # Speculative decoding: per request, the drafts proposed for its next step (None when speculation is off).
    spec_token_ids: list[list[int]] | None = None
    # The KV connector's worker side report (kvserve.kv_transfer.base.KVConnectorOutput), or None.
    kv_connector_output: Any = None
    # Speculative decoding: the step's measured costs (None when speculation is off).
    spec_timing: SpecStepTiming | None = None
    # Where the drafts are an EAGLE-2 tree's nodes (topological order): per request, each node's parent (-1: the
    # root), None for a chain; the whole field None when no request has a tree. The grammar's bitmask needs them.
    spec_parents: list[list[int] | None] | None = None


@dataclass
class EngineCoreOutput:
    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[tuple[list[int], list[float], int]] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    # Set on a request's first output only: when the scheduler first admitted it (for queue-time metrics).
    first_scheduled_time: float | None = None
    # Finished because its structured output is complete: the last token is content, not a stop token to hide.
    grammar_completed: bool = False
    # Set on a finished request's last output only: what the KV connector tells the client (e.g. where another
    # instance can fetch this request's KV: prefill/decode disaggregation), vLLM's field.
    kv_transfer_params: dict[str, Any] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0
    prompt_logprobs: None = None  # vLLM's field; prompt logprobs are not supported, so always None
    # The KV connector's parameters for the client, on the finished output (EngineCoreOutput.kv_transfer_params).
    kv_transfer_params: dict[str, Any] | None = None

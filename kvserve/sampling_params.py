"""SamplingParams: how one request is decoded, validated at construction (vLLM-compatible names)."""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Any

_MAX_TOP_LOGPROBS = 20
_MAX_TEMPERATURE = 1e4


@dataclass
class StructuredOutputsParams:
    """Constrain the output to a language (vLLM's StructuredOutputsParams): exactly one of

    - `json`: a JSON schema (a dict, or its JSON text);
    - `regex`: a regular expression the whole output matches;
    - `choice`: a list of strings, the output being one of them;
    - `grammar`: a Lark grammar (llguidance's dialect), or a GBNF one (recognised by its `::=`);
    - `json_object=True`: any JSON object (OpenAI's `response_format={"type": "json_object"}`).

    Checked here for shape only; the grammar itself is compiled, and refused with a ValueError, by the frontend
    (kvserve.structured_output.grammar).
    """

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False

    def __post_init__(self) -> None:
        given = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        if self.json_object:
            given.append("json_object")
        if len(given) != 1:
            raise ValueError(
                "StructuredOutputsParams needs exactly one of json, regex, choice, grammar or json_object, got "
                + (", ".join(given) if given else "none")
            )
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise ValueError(f"StructuredOutputsParams.json must be a JSON schema (dict or str), got {self.json!r}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"StructuredOutputsParams.{name} must be a non-empty string, got {value!r}")
        if self.choice is not None:
            if not isinstance(self.choice, list) or not self.choice:
                raise ValueError(f"StructuredOutputsParams.choice must be a non-empty list, got {self.choice!r}")
            for c in self.choice:
                if not isinstance(c, str) or not c:
                    raise ValueError(f"StructuredOutputsParams.choice must hold non-empty strings, got {c!r}")
        if not isinstance(self.json_object, bool):
            raise ValueError(f"StructuredOutputsParams.json_object must be a boolean, got {self.json_object!r}")


@dataclass
class SamplingParams:
    """Per-request decoding options.

    Invariants after construction (else ValueError naming the field):
    temperature in [0, 1e4] (0 means greedy); 0 < top_p <= 1; top_k == 0 or -1 (off) or >= 1; 0 <= min_p <= 1;
    max_tokens is None (fill up to max_model_len) or >= 1; 0 <= min_tokens <= max_tokens; n >= 1;
    repetition_penalty in [1e-3, 1e3]; presence/frequency penalties in [-2, 2]; logprobs in [0, 20] or None;
    every number finite.
    `stop` is normalised to a list of non-empty strings and `stop_token_ids` to a list of ints.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True
    # Only with skip_special_tokens=False: False writes consecutive added tokens ("<a><b>") without the space some
    # decoders put between them ("<a> <b>"), as vLLM does.
    spaces_between_special_tokens: bool = True
    # Extra key mixed into the first block hash, so tenants who must not share cached prefixes don't.
    cache_salt: str | None = None
    # Constrain the output to a JSON schema, regex, choice or grammar (kvserve.structured_output).
    structured_outputs: StructuredOutputsParams | None = None
    # vLLM's free-form extras; kvserve reads `kv_transfer_params` (a dict for the KV connector: e.g. where a
    # prefill instance left this prompt's KV), which the OpenAI server fills from the request body's field.
    extra_args: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self._verify()

    def _verify(self) -> None:
        def bad(field_name: str, why: str) -> ValueError:
            return ValueError(f"SamplingParams.{field_name} {why}")

        if not isinstance(self.n, int) or isinstance(self.n, bool) or self.n < 1:
            raise bad("n", f"must be an integer >= 1, got {self.n!r}")
        if not _is_number(self.temperature) or not 0 <= self.temperature <= _MAX_TEMPERATURE:
            raise bad("temperature", f"must be in [0, {_MAX_TEMPERATURE}], got {self.temperature!r}")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise bad("top_p", f"must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 0:
            raise bad("top_k", f"must be -1 or 0 (disabled) or a positive integer, got {self.top_k!r}")
        if not _is_number(self.min_p) or not 0 <= self.min_p <= 1:
            raise bad("min_p", f"must be in [0, 1], got {self.min_p!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -2 <= value <= 2:
                raise bad(name, f"must be in [-2, 2], got {value!r}")
        # Bounded away from 0 and infinity so that dividing fp32 logits by it stays finite.
        if not _is_number(self.repetition_penalty) or not 1e-3 <= self.repetition_penalty <= 1e3:
            raise bad("repetition_penalty", f"must be in [0.001, 1000], got {self.repetition_penalty!r}")
        if self.max_tokens is not None and (
            not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1
        ):
            raise bad("max_tokens", f"must be an integer >= 1 or None, got {self.max_tokens!r}")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise bad("min_tokens", f"must be an integer >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise bad("seed", f"must be an integer or None, got {self.seed!r}")
        if self.logprobs is not None and (
            not isinstance(self.logprobs, int) or not 0 <= self.logprobs <= _MAX_TOP_LOGPROBS
        ):
            raise bad("logprobs", f"must be an integer in [0, {_MAX_TOP_LOGPROBS}] or None, got {self.logprobs!r}")
        assert isinstance(self.stop, list)
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise bad("stop", f"must be a string or a list of non-empty strings, got {s!r}")
        for t in self.stop_token_ids:
            if not isinstance(t, int) or isinstance(t, bool) or t < 0:
                raise bad("stop_token_ids", f"must be a list of non-negative integers, got {t!r}")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise bad("structured_outputs", f"must be a StructuredOutputsParams, got {self.structured_outputs!r}")
        if self.extra_args is not None and not isinstance(self.extra_args, dict):
            raise bad("extra_args", f"must be a dict or None, got {self.extra_args!r}")
        params = (self.extra_args or {}).get("kv_transfer_params")
        if params is not None and not isinstance(params, dict):
            raise bad("extra_args", f"['kv_transfer_params'] must be an object, got {params!r}")

    @property
    def kv_transfer_params(self) -> dict[str, Any] | None:
        return (self.extra_args or {}).get("kv_transfer_params")

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def max_stop_str_len(self) -> int:
        assert isinstance(self.stop, list)
        return max((len(s) for s in self.stop), default=0)

    def clone(self) -> SamplingParams:
        return copy.copy(self)


# Temperatures below this are treated as greedy (as in vLLM), avoiding a division by ~0.
_GREEDY_EPS = 1e-5


def _is_number(x: object) -> bool:
    """A finite int or float (NaN and infinities are refused)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)

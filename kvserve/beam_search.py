"""Beam search over an engine that only ever decodes one token: vLLM v1's `BeamSearchParams` and output shape,
with HF transformers' scoring and stopping rules.

The search itself is pure Python (no torch, no engine): a `BeamSearchInstance` per prompt names the token lists
to score next (`running_prompts`) and is advanced with each beam's top-K log-probabilities (`advance`). The
drivers (`LLM.beam_search`, the OpenAI completions handler) submit every running beam as an ordinary request of
one token with `logprobs=K`; beams that share a prefix share its KV blocks through the prefix cache, and every
request finishes within its step, so no block stays held once the search is over.

Semantics matched: HF `generate(num_beams=B, do_sample=False, length_penalty=lp, early_stopping=...,
num_return_sequences=B)` of transformers 5.x (`GenerationMixin._beam_search`), per prompt:

- each step keeps the top K = max(2, 1 + #EOS ids) * B continuations of all running beams by cumulative
  log-probability (the model's unscaled log-softmax; temperature plays no part, as with do_sample=False);
- a continuation that ends in an EOS id, or reaches max_tokens, is finished; it enters the finished set only if
  it ranks among the top B of the K, scored cum_logprob / generated_len ** lp, where generated_len counts the new
  tokens including the EOS token (not the prompt); the finished set keeps the best B scores;
- the next running beams are the best B of the K continuations that did not finish;
- the search of a prompt stops at max_tokens, or (early_stopping=False, HF's default) once B hypotheses are
  finished and the best running beam's cum_logprob / generated_len ** lp can no longer beat the worst of them;
  with early_stopping=True as soon as B are finished; with "never" the bound uses max_tokens when lp > 0;
- the B finished hypotheses are returned best score first.

This differs from vLLM's own `LLM.beam_search`, which adds every EOS continuation of the 2B to its finished
list, never stops early, and normalises by the prompt-plus-output length; kvserve follows HF so that the result
is the reference one. `ignore_eos=True` treats no token as EOS (HF with an EOS id that never occurs).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from kvserve.outputs import CompletionOutput, Logprob, RequestOutput
from kvserve.sampling_params import SamplingParams

# A request's top-logprobs are capped at 20 (SamplingParams.logprobs), which bounds K = 2 * beam_width.
_MAX_CANDIDATES = 20


@dataclass
class BeamSearchParams:
    """vLLM's fields, plus `early_stopping` (HF's, default False as in HF's generate()).

    `temperature` is accepted for vLLM compatibility and changes nothing: scores are the model's unscaled
    log-probabilities. `include_stop_str_in_output` is vLLM's field too; stop strings are not part of beam search.
    """

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    early_stopping: bool | Literal["never"] = False

    def __post_init__(self) -> None:
        if not isinstance(self.beam_width, int) or isinstance(self.beam_width, bool) or self.beam_width < 1:
            raise ValueError(f"BeamSearchParams.beam_width must be an integer >= 1, got {self.beam_width!r}")
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            raise ValueError(f"BeamSearchParams.max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not isinstance(self.length_penalty, (int, float)) or isinstance(self.length_penalty, bool):
            raise ValueError(f"BeamSearchParams.length_penalty must be a number, got {self.length_penalty!r}")
        if self.temperature < 0:
            raise ValueError(f"BeamSearchParams.temperature must be >= 0, got {self.temperature!r}")
        if self.early_stopping not in (True, False, "never"):
            raise ValueError(
                f'BeamSearchParams.early_stopping must be True, False or "never", got {self.early_stopping!r}'
            )

    def num_candidates(self, num_eos_ids: int) -> int:
        """K: continuations kept per step (HF: enough that B survive even if every beam's best is an EOS)."""
        return max(2, 1 + num_eos_ids) * self.beam_width


@dataclass
class BeamSearchSequence:
    """One hypothesis. `tokens` holds the prompt and the generated tokens; `logprobs` one dict per generated token
    (the top-K of that step, keyed by token id); `text` is filled on the returned sequences only."""

    tokens: list[int]
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None  # "stop" (an EOS id) | "length"
    stop_reason: int | str | None = None
    # HF's sequence score: cum_logprob / num_generated_tokens ** length_penalty (set once finished).
    score: float | None = None


@dataclass
class BeamSearchOutput:
    """The best `beam_width` hypotheses of one prompt, best score first."""

    sequences: list[BeamSearchSequence]


class BeamSearchInstance:
    """The search state of one prompt. Invariant: all running beams have the same number of generated tokens
    (`num_generated`), are sorted by cum_logprob (best first), and number at most beam_width."""

    def __init__(self, prompt_token_ids: list[int], params: BeamSearchParams, eos_token_ids: frozenset[int]) -> None:
        self.params = params
        self.eos_token_ids = frozenset() if params.ignore_eos else frozenset(eos_token_ids)
        self.num_candidates = params.num_candidates(len(self.eos_token_ids))
        if self.num_candidates > _MAX_CANDIDATES:
            raise ValueError(
                f"beam_width {params.beam_width} needs {self.num_candidates} log-probabilities per step; "
                f"at most {_MAX_CANDIDATES} are available"
            )
        self.prompt_len = len(prompt_token_ids)
        self.running: list[BeamSearchSequence] = [BeamSearchSequence(tokens=list(prompt_token_ids))]
        self.finished: list[BeamSearchSequence] = []  # at most beam_width, best score first
        self.num_generated = 0
        self.done = False

    def step_params(self) -> SamplingParams:
        """What each running beam is submitted with: one greedy token and the top-K log-probabilities."""
        return SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, logprobs=self.num_candidates)

    def running_prompts(self) -> list[list[int]]:
        """The token lists to score next (empty once done)."""
        return [] if self.done else [beam.tokens for beam in self.running]

    def advance(self, top_logprobs: list[dict[int, Logprob]]) -> None:
        """One step: `top_logprobs[i]` holds at least the top-K log-probabilities of the next token after
        `running[i]` (token id -> Logprob, as a request with `logprobs=K` reports them); extra entries are
        harmless."""
        assert not self.done and len(top_logprobs) == len(self.running)
        p = self.params
        candidates = [
            (beam.cum_logprob + lp.logprob, i, token, step)
            for i, (beam, step) in enumerate(zip(self.running, top_logprobs, strict=True))
            for token, lp in step.items()
        ]
        # Best first; the sort is stable, so exact ties keep beam order, then token order (HF's flat index order).
        candidates.sort(key=lambda c: (-c[0], c[1], c[2]))
        candidates = candidates[: self.num_candidates]
        length = self.num_generated + 1
        at_limit = length >= p.max_tokens
        next_running: list[BeamSearchSequence] = []
        for rank, (cum, i, token, step) in enumerate(candidates):
            is_eos = token in self.eos_token_ids
            if not (is_eos or at_limit):
                if len(next_running) < p.beam_width:
                    next_running.append(self._extend(self.running[i], token, step, cum))
                continue
            if rank >= p.beam_width:
                continue  # HF: only the top B of the K may finish; the rest are the running beams' reserve
            seq = self._extend(self.running[i], token, step, cum)
            seq.finish_reason = "stop" if is_eos else "length"
            seq.stop_reason = token if is_eos else None
            seq.score = cum / length**p.length_penalty
            self._add_finished(seq)
        self.running = next_running
        self.num_generated = length
        self.done = at_limit or not self._can_improve()

    def result(self) -> list[BeamSearchSequence]:
        assert self.done
        return list(self.finished)

    def _extend(self, beam: BeamSearchSequence, token: int, step: dict[int, Logprob], cum: float) -> BeamSearchSequence:
        return BeamSearchSequence(tokens=beam.tokens + [token], logprobs=beam.logprobs + [step], cum_logprob=cum)

    def _add_finished(self, seq: BeamSearchSequence) -> None:
        assert seq.score is not None
        # Earlier hypotheses win exact ties (HF's topk over [old finished, new] in that order).
        pos = next((k for k, f in enumerate(self.finished) if f.score is not None and f.score < seq.score), None)
        self.finished.insert(len(self.finished) if pos is None else pos, seq)
        del self.finished[self.params.beam_width :]

    def _can_improve(self) -> bool:
        """HF's stopping test after a step (`_check_early_stop_heuristic` and `_beam_search_has_unfinished...`)."""
        p = self.params
        if not self.running:
            return False
        if len(self.finished) < p.beam_width:
            return True
        if p.early_stopping is True:
            return False
        length = p.max_tokens if p.early_stopping == "never" and p.length_penalty > 0 else self.num_generated
        best_possible = self.running[0].cum_logprob / length**p.length_penalty
        worst_finished = self.finished[-1].score
        assert worst_finished is not None
        return best_possible > worst_finished


def to_request_output(
    request_id: str,
    prompt: str | None,
    prompt_token_ids: list[int],
    sequences: list[BeamSearchSequence],
    decode: Callable[[list[int]], str],
) -> RequestOutput:
    """The finished hypotheses as one RequestOutput, one CompletionOutput per beam (best first): the generated
    tokens only, their text without a final EOS token (as vLLM's server answers beam search)."""
    outputs = []
    for i, seq in enumerate(sequences):
        generated = seq.tokens[len(prompt_token_ids) :]
        shown = generated[:-1] if seq.finish_reason == "stop" else generated
        outputs.append(
            CompletionOutput(
                index=i,
                text=decode(shown),
                token_ids=generated,
                cumulative_logprob=seq.cum_logprob,
                logprobs=seq.logprobs,
                finish_reason=seq.finish_reason,
                stop_reason=seq.stop_reason,
            )
        )
    return RequestOutput(request_id, prompt, list(prompt_token_ids), outputs, finished=True)

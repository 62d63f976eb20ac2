"""Frontend input processing: prompt -> token ids, validation, EngineCoreRequest."""

from __future__ import annotations

import time
from typing import Any

from transformers import PreTrainedTokenizerBase

from kvserve.config import ModelConfig
from kvserve.loader.tokenizer import render_chat_prompt
from kvserve.request import EngineCoreRequest
from kvserve.sampling_params import SamplingParams
from kvserve.structured_output.grammar import check as check_grammar

# A prompt is text, {"prompt": text} or {"prompt_token_ids": [...]} (vLLM's TextPrompt / TokensPrompt).
PromptType = str | dict[str, Any]

__all__ = ["Processor", "PromptType", "render_chat_prompt"]


class Processor:
    def __init__(
        self, model_config: ModelConfig, tokenizer: PreTrainedTokenizerBase, max_tokens_per_request: int
    ) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = model_config.max_model_len
        # Most tokens one request can hold: max_model_len, or less when the whole KV pool is smaller.
        self.max_tokens_per_request = max_tokens_per_request
        self.vocab_size = model_config.arch.vocab_size
        eos = set(model_config.arch.eos_token_ids)
        if tokenizer.eos_token_id is not None:
            eos.add(tokenizer.eos_token_id)
        self.eos_token_ids = frozenset(eos)

    def tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """Returns (prompt text if given, prompt token ids)."""
        if isinstance(prompt, str):
            return prompt, self.tokenizer(prompt).input_ids
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                ids = prompt["prompt_token_ids"]
                if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
                    raise ValueError("prompt_token_ids must be a list of integers")
                return prompt.get("prompt"), list(ids)
            if isinstance(prompt.get("prompt"), str):
                return prompt["prompt"], self.tokenizer(prompt["prompt"]).input_ids
        raise ValueError(
            f"a prompt must be a string, {{'prompt': str}} or {{'prompt_token_ids': [int, ...]}}, got {type(prompt)}"
        )

    def make_core_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, arrival_time: float | None
    ) -> EngineCoreRequest:
        """Validate lengths and ids; resolve max_tokens. Raises ValueError with a user-facing message."""
        num_prompt = len(prompt_token_ids)
        if num_prompt == 0:
            raise ValueError("The prompt is empty: it must contain at least one token.")
        bad = next((t for t in prompt_token_ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise ValueError(f"Token id {bad} is out of vocabulary (vocab size {self.vocab_size}).")
        limit = self.max_tokens_per_request
        if params.max_tokens is None:
            if num_prompt >= limit:
                raise ValueError(self._too_long(num_prompt, None, limit))
            max_tokens = limit - num_prompt
        else:
            max_tokens = params.max_tokens
            if num_prompt + max_tokens > limit:
                raise ValueError(self._too_long(num_prompt, max_tokens, limit))
        if params.structured_outputs is not None:
            check_grammar(params.structured_outputs)  # a bad schema or grammar is the caller's error (HTTP 400)
        return EngineCoreRequest(
            request_id=request_id,
            prompt_token_ids=list(prompt_token_ids),
            sampling_params=params,
            eos_token_ids=self.eos_token_ids,
            arrival_time=arrival_time or time.time(),
            max_tokens=max_tokens,
            kv_transfer_params=params.kv_transfer_params,
        )

    def _too_long(self, num_prompt: int, max_tokens: int | None, limit: int) -> str:
        what = "maximum context length" if limit == self.max_model_len else "KV cache capacity"
        if max_tokens is None:
            return (
                f"This model's {what} is {limit} tokens. However, your prompt has {num_prompt} tokens, "
                "leaving no room for a completion."
            )
        return (
            f"This model's {what} is {limit} tokens. However, you requested {num_prompt + max_tokens} tokens "
            f"({num_prompt} in the prompt, {max_tokens} for the completion). Reduce the prompt or max_tokens."
        )

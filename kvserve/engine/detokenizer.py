"""Incremental detokenization and stop-string detection for one sequence (frontend side)."""

from __future__ import annotations

from tokenizers.decoders import DecodeStream
from transformers import PreTrainedTokenizerBase

from kvserve.sampling_params import SamplingParams

# Prompt tokens primed into the decode stream so the first output token decodes in context (leading spaces).
_PRIME_TOKENS = 8


class IncrementalDetokenizer:
    """Keeps the output text of one sequence; cuts it at the first stop string.

    Uses the tokenizers library's DecodeStream, which buffers tokens until they form valid UTF-8.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self._tokenizer = tokenizer._tokenizer  # the Rust tokenizers.Tokenizer behind the fast tokenizer
        self._stream = DecodeStream(
            ids=prompt_token_ids[-_PRIME_TOKENS:], skip_special_tokens=params.skip_special_tokens
        )
        # vLLM's rule for fast tokenizers: with special tokens shown and spaces_between_special_tokens off, an added
        # token right after another added token is written as its bare content, without the space the decoder
        # would put before it. Empty (the rule is off) otherwise.
        self._added_tokens: dict[int, str] = {}
        if not params.skip_special_tokens and not params.spaces_between_special_tokens:
            self._added_tokens = {i: t.content for i, t in tokenizer.added_tokens_decoder.items()}
        self._last_was_added = False
        self.stop = list(params.stop or ())
        self.include_stop = params.include_stop_str_in_output
        self.max_stop_len = params.max_stop_str_len
        self.output_text = ""

    def update(self, new_token_ids: list[int], skip_last: bool) -> str | None:
        """Append the text of new tokens; returns the stop string if one now appears (text is cut there).

        `skip_last`: the last token stopped the sequence (EOS or a stop id) and its text is not shown.
        """
        ids = new_token_ids[:-1] if skip_last else new_token_ids
        added = 0
        for token_id in ids:
            piece = self._stream.step(self._tokenizer, token_id)
            if self._added_tokens:
                content = self._added_tokens.get(token_id)
                if content is not None and self._last_was_added:
                    piece = content
                self._last_was_added = content is not None
            if piece:
                self.output_text += piece
                added += len(piece)
        if not self.stop or not added:
            return None
        # Only text that the new pieces could complete needs searching.
        search_from = max(0, len(self.output_text) - added - self.max_stop_len + 1)
        best: tuple[int, str] | None = None
        for s in self.stop:
            idx = self.output_text.find(s, search_from)
            if idx >= 0 and (best is None or idx < best[0]):
                best = (idx, s)
        if best is None:
            return None
        idx, s = best
        self.output_text = self.output_text[: idx + len(s) if self.include_stop else idx]
        return s

    def text_to_show(self, finished: bool) -> str:
        """While running, hold back text that could still turn out to be the start of a stop string."""
        if finished or not self.stop or self.include_stop:
            return self.output_text
        hold = self.max_stop_len - 1
        return self.output_text[: len(self.output_text) - hold] if hold else self.output_text

"""What a request's prompt is, as the instances will see it: token ids and the prefix cache's block hashes.

The router tokenizes with the model's own tokenizer and chat template (kvserve/loader/tokenizer.py, the code the
server runs), and hashes full blocks with the engine's chained hash (kvserve/core/hashing.py), which depends only on
the tokens, so the hashes equal the ones the instances publish in their KV events. A body it cannot read gives no
hashes (the request is then routed by load, and the instance answers any error).
"""

from __future__ import annotations

import logging
from typing import Any

from kvserve.core.hashing import hash_request_tokens
from kvserve.loader.tokenizer import load_tokenizer, render_chat_prompt

logger = logging.getLogger(__name__)


class PromptHasher:
    def __init__(self, tokenizer_path: str | None, block_size: int) -> None:
        self.block_size = block_size
        self.tokenizer = load_tokenizer(tokenizer_path) if tokenizer_path else None

    def token_ids(self, path: str, body: dict[str, Any]) -> list[int] | None:
        """The prompt's token ids (the first prompt of a batch), or None when unknown."""
        try:
            if path.endswith("/chat/completions"):
                if self.tokenizer is None:
                    return None
                messages = body["messages"]
                conversation = [
                    {"role": "system" if m["role"] == "developer" else m["role"], "content": _text(m.get("content"))}
                    for m in messages
                ]
                rendered = render_chat_prompt(
                    self.tokenizer,
                    conversation,
                    body.get("add_generation_prompt", True),
                    body.get("chat_template_kwargs"),
                )
                return rendered["prompt_token_ids"]
            prompt = body["prompt"]
            if isinstance(prompt, list) and prompt and isinstance(prompt[0], list):
                prompt = prompt[0]
            if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
                prompt = prompt[0]
            if isinstance(prompt, list):
                return [int(t) for t in prompt]
            if isinstance(prompt, str) and self.tokenizer is not None:
                return self.tokenizer(prompt).input_ids
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            logger.debug("cannot read the prompt (%s): routing by load", e)
        return None

    def block_hashes(self, token_ids: list[int]) -> list[bytes]:
        """The hashes of the blocks an instance could hit: every full block but one that would hold the last token
        (an instance always computes at least that one)."""
        hashes = hash_request_tokens(token_ids, self.block_size)
        return hashes[: (len(token_ids) - 1) // self.block_size]


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(part.get("text", "") for part in content)

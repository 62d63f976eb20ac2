"""The shared chat rendering used by LLM.chat and /v1/chat/completions."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvserve.engine.processor import render_chat_prompt


class FakeTokenizer:
    def __init__(self, result) -> None:
        self.result = result
        self.calls: list[dict] = []

    def apply_chat_template(self, conversation, **kwargs):
        self.calls.append(kwargs)
        if isinstance(self.result, Exception):
            raise self.result
        return self.result

    def __call__(self, text: str, add_special_tokens: bool = True):
        bos = [1] if add_special_tokens else []
        return SimpleNamespace(input_ids=bos + [ord(c) for c in text])


def test_render_chat_prompt_returns_text_and_ids_without_an_extra_bos():
    tok = FakeTokenizer("<s>hi")
    prompt = render_chat_prompt(tok, [{"role": "user", "content": "hi"}], False, {"enable_thinking": False})
    assert prompt == {"prompt": "<s>hi", "prompt_token_ids": [ord(c) for c in "<s>hi"]}
    assert tok.calls == [{"tokenize": False, "add_generation_prompt": False, "enable_thinking": False}]


@pytest.mark.parametrize(
    ("result", "message"),
    [(KeyError("role"), "cannot apply the chat template"), ([1, 2], "the chat template did not produce text")],
)
def test_render_chat_prompt_raises_value_error_for_a_bad_conversation(result, message):
    with pytest.raises(ValueError, match=message):
        render_chat_prompt(FakeTokenizer(result), [{"role": "user", "content": "hi"}])

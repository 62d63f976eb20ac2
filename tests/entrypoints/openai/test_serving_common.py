"""OpenAI request -> SamplingParams, without a server."""

from __future__ import annotations

from kvserve.entrypoints.openai.protocol import CompletionRequest
from kvserve.entrypoints.openai.serving_common import to_sampling_params


def test_special_token_fields_reach_sampling_params():
    req = CompletionRequest(prompt="x", skip_special_tokens=False, spaces_between_special_tokens=False)
    params = to_sampling_params(req, 4, None, vocab_size=100)
    assert params.skip_special_tokens is False and params.spaces_between_special_tokens is False
    assert to_sampling_params(CompletionRequest(prompt="x"), 4, None, 100).spaces_between_special_tokens is True

"""OpenAI request -> SamplingParams, without a server."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from kvserve.entrypoints.openai.protocol import CompletionRequest
from kvserve.entrypoints.openai.serving_common import to_sampling_params


def test_special_token_fields_reach_sampling_params():
    req = CompletionRequest(prompt="x", skip_special_tokens=False, spaces_between_special_tokens=False)
    params = to_sampling_params(req, 4, None, vocab_size=100)
    assert params.skip_special_tokens is False and params.spaces_between_special_tokens is False
    assert to_sampling_params(CompletionRequest(prompt="x"), 4, None, 100).spaces_between_special_tokens is True


def test_cancelled_handler_cancels_its_work():
    """A handler cancelled while its work runs (uvicorn's graceful-shutdown timeout does this) must take the work
    down with it: left running, the work fails later on the shutdown's abort, and asyncio logs a traceback for an
    exception nobody reads."""
    import asyncio

    from kvserve.entrypoints.openai.serving_common import run_unless_disconnected

    class NeverDisconnects:
        async def receive(self):
            await asyncio.Event().wait()

    async def scenario() -> str:
        release = asyncio.Event()
        state = {"work": "running"}

        async def work():
            try:
                await release.wait()
            except asyncio.CancelledError:
                state["work"] = "cancelled"
                raise
            state["work"] = "ran on after its handler was cancelled"

        handler = asyncio.ensure_future(run_unless_disconnected(NeverDisconnects(), work(), lambda: None))
        await asyncio.sleep(0.01)
        handler.cancel()
        await asyncio.gather(handler, return_exceptions=True)
        release.set()
        await asyncio.sleep(0.01)
        return state["work"]

    assert asyncio.run(scenario()) == "cancelled"


@pytest.mark.parametrize("params", [{"a": [{}, -(2**127)]}, {"b": 2**64}, {"\udaf0": 1}])
def test_kv_transfer_params_the_engine_wire_cannot_carry_are_a_client_error(params):
    """Found by the fuzzer: an int past 64 bits reached msgpack in the engine client and came back as a 500."""
    with pytest.raises(ValidationError, match="kv_transfer_params"):
        CompletionRequest(prompt="x", kv_transfer_params=params)
    assert CompletionRequest(prompt="x", kv_transfer_params={"a": [2**63 - 1, -(2**63), "ok"]}).kv_transfer_params

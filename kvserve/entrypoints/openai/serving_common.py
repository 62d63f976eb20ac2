"""Pieces shared by the completion and chat handlers: errors, sampling parameters, SSE, disconnects."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from http import HTTPStatus
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from kvserve.engine.async_llm import AsyncLLM
from kvserve.entrypoints.openai.protocol import ErrorInfo, ErrorResponse, SamplingFields
from kvserve.outputs import Logprob
from kvserve.sampling_params import SamplingParams, StructuredOutputsParams

T = TypeVar("T")


class OpenAIError(Exception):
    """Turned into an OpenAI-style error body by the server's exception handler."""

    def __init__(self, message: str, status: int = 400, param: str | None = None, err_type: str | None = None):
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.err_type = err_type or ("BadRequestError" if status == 400 else HTTPStatus(status).phrase.replace(" ", ""))

    def body(self) -> dict[str, Any]:
        info = ErrorInfo(message=self.message, type=self.err_type, param=self.param, code=self.status)
        return ErrorResponse(error=info).model_dump()

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def to_sampling_params(
    req: SamplingFields, max_tokens: int | None, logprobs: int | None, vocab_size: int
) -> SamplingParams:
    """Map an OpenAI request onto SamplingParams; OpenAI's defaults where the field is absent."""
    if req.stop_token_ids and max(req.stop_token_ids) >= vocab_size:
        raise OpenAIError(f"stop_token_ids must be < vocab size {vocab_size}", param="stop_token_ids")
    structured_outputs = to_structured_outputs(req)
    try:
        return SamplingParams(
            n=req.n,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=0 if req.top_k in (None, -1) else req.top_k,
            min_p=req.min_p or 0.0,
            presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            seed=req.seed,
            max_tokens=max_tokens,
            min_tokens=req.min_tokens,
            stop=req.stop,
            stop_token_ids=req.stop_token_ids,
            include_stop_str_in_output=req.include_stop_str_in_output,
            ignore_eos=req.ignore_eos,
            logprobs=logprobs,
            skip_special_tokens=req.skip_special_tokens,
            spaces_between_special_tokens=req.spaces_between_special_tokens,
            structured_outputs=structured_outputs,
            extra_args={"kv_transfer_params": req.kv_transfer_params} if req.kv_transfer_params is not None else None,
        )
    except ValueError as e:
        field = str(e).split()[0].removeprefix("SamplingParams.")
        raise OpenAIError(str(e), param=field) from None


def to_structured_outputs(req: SamplingFields) -> StructuredOutputsParams | None:
    """The request's output constraint, from whichever of the accepted fields carries it (at most one). Whether
    the schema or grammar itself is valid is checked by the engine's frontend (also a 400)."""
    given: dict[str, dict[str, Any]] = {}
    fmt = req.response_format
    if fmt is not None and fmt.type == "json_object":
        given["response_format"] = {"json_object": True}
    elif fmt is not None and fmt.type == "json_schema":
        assert fmt.json_schema is not None
        given["response_format"] = {"json": fmt.json_schema.json_schema}
    if req.structured_outputs is not None:
        so = req.structured_outputs
        fields = {"json": so.json_schema, "regex": so.regex, "choice": so.choice, "grammar": so.grammar}
        given["structured_outputs"] = {k: v for k, v in fields.items() if v is not None}
        if so.json_object:
            given["structured_outputs"]["json_object"] = True
    for name, key in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice")):
        if getattr(req, name) is not None:
            given[name] = {key: getattr(req, name)}
    if req.guided_grammar is not None:
        given["guided_grammar"] = {"grammar": req.guided_grammar}
    if not given:
        return None
    if len(given) > 1:
        raise OpenAIError(f"give at most one output constraint, got {', '.join(given)}", param=next(iter(given)))
    name, fields = next(iter(given.items()))
    try:
        return StructuredOutputsParams(**fields)
    except ValueError as e:
        raise OpenAIError(str(e), param=name) from None


def sse(payload: BaseModel | dict) -> str:
    data = payload.model_dump_json(exclude_unset=False) if isinstance(payload, BaseModel) else json.dumps(payload)
    return f"data: {data}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def token_text(lp: Logprob, token_id: int, decode: Callable[[list[int]], str]) -> str:
    return lp.decoded_token if lp.decoded_token is not None else decode([token_id])


def json_logprob(lp: Logprob) -> float:
    """A logprob JSON can carry: a token a grammar forbids has -inf, which JSON has no number for (vLLM's
    clamp)."""
    return max(lp.logprob, -9999.0)


async def _wait_for_disconnect(request: Request) -> None:
    """Returns when the client goes away (the ASGI server delivers http.disconnect once the body is read)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def run_unless_disconnected(request: Request, work: Awaitable[T], on_disconnect: Callable[[], None]) -> T | None:
    """Await `work`; if the client disconnects first, cancel it, call `on_disconnect` and return None."""
    work_task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        done, _ = await asyncio.wait({work_task, watch}, return_when=asyncio.FIRST_COMPLETED)
        if work_task in done:
            return work_task.result()
        work_task.cancel()
        on_disconnect()
        return None
    finally:
        watch.cancel()
        if not work_task.done():
            # We were cancelled ourselves (the server's graceful-shutdown timeout cancels in-flight handlers): the
            # work must not outlive us, or the shutdown's abort later fails it with nobody to read the error.
            work_task.cancel()


async def stream_unless_disconnected(
    request: Request, stream: AsyncIterator[str], on_disconnect: Callable[[], None]
) -> AsyncIterator[str]:
    """Relay an SSE stream; a client disconnect aborts the work at once, even between tokens."""
    watch = asyncio.ensure_future(_wait_for_disconnect(request))
    watch.add_done_callback(lambda t: None if t.cancelled() else on_disconnect())
    try:
        async for chunk in stream:
            if watch.done():
                return
            yield chunk
    finally:
        watch.cancel()


def engine_error(e: Exception) -> OpenAIError:
    """Map exceptions from the engine onto HTTP errors."""
    from kvserve.engine.core_client import EngineDeadError

    if isinstance(e, EngineDeadError):
        return OpenAIError(str(e), status=503, err_type="EngineDeadError")
    if isinstance(e, ValueError):
        return OpenAIError(str(e))
    if isinstance(e, OpenAIError):
        return e
    return OpenAIError(f"internal error: {type(e).__name__}: {e}", status=500, err_type="InternalServerError")


def check_model(engine: AsyncLLM, served_names: list[str], model: str | None) -> str:
    if model is not None and model not in served_names:
        raise OpenAIError(f"The model `{model}` does not exist.", param="model", err_type="NotFoundError")
    return served_names[0]

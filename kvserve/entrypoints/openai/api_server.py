"""The OpenAI-compatible HTTP server (FastAPI + uvicorn) in front of an AsyncLLM.

Errors always come back as `{"error": {"message", "type", "param", "code"}}`: 400 for bad input (including
malformed JSON and schema violations, which FastAPI would otherwise answer with 422), 503 once the engine core
has died, 500 for anything unexpected.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import sys
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvserve import __version__
from kvserve.engine.arg_utils import EngineArgs
from kvserve.engine.async_llm import AsyncLLM
from kvserve.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
    VersionResponse,
)
from kvserve.entrypoints.openai.serving_chat import ChatHandler, render_chat
from kvserve.entrypoints.openai.serving_common import OpenAIError, check_model
from kvserve.entrypoints.openai.serving_completion import CompletionHandler

logger = logging.getLogger(__name__)

_ERROR_RESPONSES = {
    400: {"description": "Bad request (OpenAI-style error body)"},
    503: {"description": "The engine is not running"},
}


def build_app(engine_args: EngineArgs, served_model_name: str | None = None) -> FastAPI:
    """The app starts the engine core process in its lifespan and stops it on shutdown."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine = await AsyncLLM.create(engine_args, served_model_name)
        app.state.engine = engine
        names = [engine.model_name]
        if engine.config.model.model not in names:
            names.append(engine.config.model.model)
        app.state.served_names = names
        app.state.completions = CompletionHandler(engine, names[0])
        app.state.chat = ChatHandler(engine, names[0])
        app.openapi_schema = None  # regenerate with this engine's limits (see _openapi_with_limits)
        logger.info("serving %s (%d KV blocks)", names[0], engine.num_blocks)
        try:
            yield
        finally:
            await engine.shutdown()

    app = FastAPI(title="kvserve", version=__version__, lifespan=lifespan)
    install_routes(app)
    default_openapi = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            app.openapi_schema = _openapi_with_limits(default_openapi(), app)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    return app


def _openapi_with_limits(schema: dict, app: FastAPI) -> dict:
    """Describe what the running engine accepts: the served model names, token ids below the vocabulary size,
    max_tokens within the context. Clients (and schema-driven fuzzers) then know the real bounds."""
    engine = getattr(app.state, "engine", None)
    if engine is None:
        return schema
    import copy

    schema = copy.deepcopy(schema)
    vocab = engine.config.model.arch.vocab_size
    max_len = engine.config.model.max_model_len
    names = app.state.served_names

    def walk(node):
        if isinstance(node, dict):
            if node.get("type") == "integer" and node.get("minimum") == 0 and "maximum" not in node:
                node["maximum"] = vocab - 1  # token ids (the only non-negative integer lists we take)
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    for name, model in schema.get("components", {}).get("schemas", {}).items():
        props = model.get("properties", {})
        if "model" in props and name.endswith("Request"):
            props["model"] = {"anyOf": [{"type": "string", "enum": names}, {"type": "null"}], "title": "Model"}
        for field in ("prompt", "tokens", "stop_token_ids"):
            if field in props:
                walk(props[field])
        for field in ("max_tokens", "max_completion_tokens"):
            for option in props.get(field, {}).get("anyOf", []):
                if option.get("type") == "integer":
                    option["maximum"] = max_len - 1
    return schema


def install_routes(app: FastAPI) -> None:
    def engine(request: Request) -> AsyncLLM:
        return request.app.state.engine

    @app.exception_handler(OpenAIError)
    async def _openai_error(_: Request, e: OpenAIError) -> JSONResponse:
        return e.response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, e: RequestValidationError) -> JSONResponse:
        errors = e.errors()
        first = errors[0] if errors else {}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        if first.get("type") == "json_invalid":
            return OpenAIError(f"malformed JSON body: {first.get('msg', '')}", param=None).response()
        else:
            message = "; ".join(
                f"{'.'.join(str(x) for x in err.get('loc', ()) if x != 'body')}: {err.get('msg')}" for err in errors[:5]
            )
        return OpenAIError(message or "invalid request", param=".".join(loc) or None).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
        return OpenAIError(str(e.detail), status=e.status_code).response()

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, e: Exception) -> JSONResponse:
        logger.exception("unhandled error")
        return OpenAIError(f"internal error: {type(e).__name__}", status=500, err_type="InternalServerError").response()

    @app.get("/health", responses=_ERROR_RESPONSES)
    async def health(request: Request) -> Response:
        if not engine(request).is_healthy:
            return OpenAIError("engine core is not running", status=503, err_type="EngineDeadError").response()
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> VersionResponse:
        return VersionResponse(version=__version__)

    @app.get("/v1/models")
    async def models(request: Request) -> ModelList:
        e = engine(request)
        return ModelList(
            data=[
                ModelCard(id=name, root=e.config.model.path, max_model_len=e.config.model.max_model_len)
                for name in request.app.state.served_names
            ]
        )

    @app.get("/server_info")
    async def server_info(request: Request) -> dict:
        """What a router needs to know of this instance (its KV block size, its KV events endpoint)."""
        e = engine(request)
        config = e.config
        events = config.kv_events
        return {
            "model": request.app.state.served_names[0],
            "model_path": config.model.path,
            "block_size": config.cache.block_size,
            "max_model_len": config.model.max_model_len,
            "dtype": str(config.model.dtype),
            "tensor_parallel_size": config.parallel.tensor_parallel_size,
            "kv_events_endpoint": events.endpoint if events is not None and events.publisher == "zmq" else None,
            "kv_events_replay_endpoint": events.replay_endpoint if events is not None else None,
            "kv_connector": config.kv_transfer.kv_connector if config.kv_transfer is not None else None,
            "kv_role": config.kv_transfer.kv_role if config.kv_transfer is not None else None,
            "version": __version__,
        }

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        return Response(generate_latest(engine(request).metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/completions", responses=_ERROR_RESPONSES)
    async def completions(body: CompletionRequest, request: Request):
        check_model(engine(request), request.app.state.served_names, body.model)
        return await request.app.state.completions.create(body, request)

    @app.post("/v1/chat/completions", responses=_ERROR_RESPONSES)
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        check_model(engine(request), request.app.state.served_names, body.model)
        return await request.app.state.chat.create(body, request)

    @app.post("/tokenize", responses=_ERROR_RESPONSES)
    async def tokenize(body: TokenizeCompletionRequest | TokenizeChatRequest, request: Request) -> TokenizeResponse:
        e = engine(request)
        check_model(e, request.app.state.served_names, body.model)
        if isinstance(body, TokenizeChatRequest):
            ids = render_chat(e.tokenizer, body.messages, body.add_generation_prompt, None)["prompt_token_ids"]
        else:
            ids = e.tokenizer(body.prompt, add_special_tokens=body.add_special_tokens).input_ids
        return TokenizeResponse(count=len(ids), max_model_len=e.config.model.max_model_len, tokens=ids)

    @app.post("/detokenize", responses=_ERROR_RESPONSES)
    async def detokenize(body: DetokenizeRequest, request: Request) -> DetokenizeResponse:
        e = engine(request)
        check_model(e, request.app.state.served_names, body.model)
        vocab = e.config.model.arch.vocab_size
        if any(t >= vocab for t in body.tokens):
            raise OpenAIError(f"token ids must be < vocab size {vocab}", param="tokens")
        return DetokenizeResponse(prompt=e.tokenizer.decode(body.tokens))


def run_server(
    engine_args: EngineArgs,
    host: str = "127.0.0.1",
    port: int = 8000,
    served_model_name: str | None = None,
    graceful_shutdown_s: float = 5.0,
    log_level: str = "info",
) -> None:
    """Serve until SIGINT/SIGTERM: then stop accepting, give in-flight requests `graceful_shutdown_s` to finish,
    abort the rest, and stop the engine core process."""
    import uvicorn

    app = build_app(engine_args, served_model_name)
    # uvicorn shuts down gracefully on SIGTERM, restores the previous handler and re-raises the signal; this
    # handler turns that last step into a clean exit status 0 instead of death by signal.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        timeout_graceful_shutdown=graceful_shutdown_s,
        access_log=log_level == "debug",
    )
    uvicorn.Server(config).run()

"""POST /v1/chat/completions: the model's chat template, n, logprobs/top_logprobs, streaming with usage."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from kvserve.engine.async_llm import AsyncLLM, RequestAborted, RequestStream
from kvserve.engine.output_processor import OutputKind
from kvserve.engine.processor import render_chat_prompt
from kvserve.entrypoints.openai.protocol import (
    ChatChoiceLogprobs,
    ChatCompletionChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobToken,
    ChatLogprobTop,
    ChatMessage,
    ChatResponseMessage,
    ChatStreamChoice,
    DeltaMessage,
    UsageInfo,
)
from kvserve.entrypoints.openai.serving_common import (
    SSE_DONE,
    OpenAIError,
    engine_error,
    json_logprob,
    run_unless_disconnected,
    sse,
    stream_unless_disconnected,
    to_sampling_params,
    token_text,
)
from kvserve.outputs import CompletionOutput, RequestOutput
from kvserve.utils import random_uuid


def render_chat(tokenizer, messages: list[ChatMessage], add_generation_prompt: bool, kwargs: dict | None) -> dict:
    """Apply the model's chat template; any failure of the template is the request's fault (400)."""
    conversation = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in messages]
    try:
        return render_chat_prompt(tokenizer, conversation, add_generation_prompt, kwargs)
    except ValueError as e:
        raise OpenAIError(str(e), param="messages") from None


class ChatHandler:
    def __init__(self, engine: AsyncLLM, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name

    async def create(self, req: ChatCompletionRequest, raw: Request):
        vocab = self.engine.config.model.arch.vocab_size
        max_tokens = req.max_completion_tokens or req.max_tokens
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        params = to_sampling_params(req, max_tokens, logprobs, vocab)
        prompt = render_chat(self.engine.tokenizer, req.messages, req.add_generation_prompt, req.chat_template_kwargs)
        request_id = f"chatcmpl-{random_uuid()}"
        kind = OutputKind.DELTA if req.stream else OutputKind.FINAL_ONLY
        try:
            stream = await self.engine.add_request(prompt, params, request_id, kind)
        except Exception as e:
            raise engine_error(e) from None
        created = int(time.time())
        echo = req.messages[-1].text() if req.echo and req.messages[-1].role == "assistant" else ""
        if req.stream:
            body = self._stream(req, request_id, created, stream, echo)
            return StreamingResponse(
                stream_unless_disconnected(raw, body, lambda: self.engine.abort(request_id)),
                media_type="text/event-stream",
            )
        result = await run_unless_disconnected(
            raw, self._collect(req, request_id, created, stream, echo), lambda: self.engine.abort(request_id)
        )
        return JSONResponse({}, status_code=499) if result is None else result

    async def _collect(self, req, request_id, created, stream: RequestStream, echo: str) -> ChatCompletionResponse:
        final: RequestOutput | None = None
        try:
            async for out in stream:
                final = out
        except Exception as e:
            raise engine_error(e) from None
        finally:
            stream.close()
        assert final is not None
        usage = UsageInfo(prompt_tokens=len(final.prompt_token_ids))
        choices = []
        for c in final.outputs:
            usage.completion_tokens += len(c.token_ids)
            choices.append(
                ChatCompletionChoice(
                    index=c.index,
                    message=ChatResponseMessage(content=echo + c.text),
                    logprobs=self._logprobs(c, req.top_logprobs or 0) if req.logprobs else None,
                    finish_reason=c.finish_reason,
                    stop_reason=c.stop_reason,
                )
            )
        usage.total_tokens = usage.prompt_tokens + usage.completion_tokens
        return ChatCompletionResponse(
            id=request_id,
            created=created,
            model=self.model_name,
            choices=choices,
            usage=usage,
            kv_transfer_params=final.kv_transfer_params,
        )

    async def _stream(self, req, request_id, created, stream: RequestStream, echo: str) -> AsyncIterator[str]:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        def chunk(choices: list[ChatStreamChoice], usage: UsageInfo | None = None) -> str:
            c = ChatCompletionChunk(id=request_id, created=created, model=self.model_name, choices=choices, usage=usage)
            return sse(c.model_dump(exclude_none=False, exclude={"usage"} if usage is None else set()))

        # OpenAI opens every choice with the assistant role and empty content.
        for i in range(req.n):
            yield chunk([ChatStreamChoice(index=i, delta=DeltaMessage(role="assistant", content=echo))])
        prompt_tokens = completion_tokens = 0
        try:
            async for out in stream:
                prompt_tokens = len(out.prompt_token_ids)
                for c in out.outputs:
                    completion_tokens += len(c.token_ids)
                    yield chunk(
                        [
                            ChatStreamChoice(
                                index=c.index,
                                delta=DeltaMessage(content=c.text),
                                logprobs=self._logprobs(c, req.top_logprobs or 0) if req.logprobs else None,
                                finish_reason=c.finish_reason,
                                stop_reason=c.stop_reason,
                            )
                        ]
                    )
        except RequestAborted:
            return
        except Exception as e:
            yield sse(engine_error(e).body())
            return
        finally:
            stream.close()
        if include_usage:
            usage = UsageInfo(
                prompt_tokens=prompt_tokens,
                completion_tokens=completion_tokens,
                total_tokens=prompt_tokens + completion_tokens,
            )
            yield chunk([], usage)
        yield SSE_DONE

    def _logprobs(self, c: CompletionOutput, top_n: int) -> ChatChoiceLogprobs:
        decode = self.engine.tokenizer.decode
        content = []
        for token_id, entry in zip(c.token_ids, c.logprobs or [], strict=False):
            text = token_text(entry[token_id], token_id, decode)
            # The entry holds the sampled token (at its true rank) and the top-N (ranks 1..N).
            tops = sorted(
                ((t, v) for t, v in entry.items() if v.rank is not None and v.rank <= top_n), key=lambda tv: tv[1].rank
            )
            content.append(
                ChatLogprobToken(
                    token=text,
                    logprob=json_logprob(entry[token_id]),
                    bytes=list(text.encode()),
                    top_logprobs=[
                        ChatLogprobTop(
                            token=(tt := token_text(v, t, decode)), logprob=json_logprob(v), bytes=list(tt.encode())
                        )
                        for t, v in tops
                    ],
                )
            )
        return ChatChoiceLogprobs(content=content)

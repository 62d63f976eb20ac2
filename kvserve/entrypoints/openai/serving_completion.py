"""POST /v1/completions: text or token-id prompts (one or many), n, echo, logprobs, streaming with usage."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from kvserve.beam_search import BeamSearchParams
from kvserve.engine.async_llm import AsyncLLM, RequestAborted, RequestStream
from kvserve.engine.output_processor import OutputKind
from kvserve.entrypoints.openai.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
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
    to_structured_outputs,
    token_text,
)
from kvserve.outputs import CompletionOutput, RequestOutput
from kvserve.utils import random_uuid


class CompletionHandler:
    def __init__(self, engine: AsyncLLM, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name

    def _prompts(self, req: CompletionRequest) -> list[str | dict]:
        p = req.prompt
        if isinstance(p, str):
            return [p]
        if p and isinstance(p[0], int):
            return [{"prompt_token_ids": list(p)}]
        if p and isinstance(p[0], list):
            return [{"prompt_token_ids": list(x)} for x in p]
        return list(p)

    async def create(self, req: CompletionRequest, raw: Request):
        if req.use_beam_search:
            return await self._beam_search(req, raw)
        vocab = self.engine.config.model.arch.vocab_size
        params = to_sampling_params(req, req.max_tokens, req.logprobs, vocab)
        prompts = self._prompts(req)
        base_id = f"cmpl-{random_uuid()}"
        request_ids = [f"{base_id}-{i}" for i in range(len(prompts))]
        kind = OutputKind.DELTA if req.stream else OutputKind.FINAL_ONLY
        # Every prompt is validated and queued before we answer, so bad input is a clean 400.
        streams: list[RequestStream] = []
        try:
            for rid, prompt in zip(request_ids, prompts, strict=True):
                streams.append(await self.engine.add_request(prompt, params, rid, kind))
        except Exception as e:
            for st in streams:
                st.close()
            raise engine_error(e) from None

        created = int(time.time())
        if req.stream:
            stream = self._stream(req, base_id, created, streams, params.n)
            body = stream_unless_disconnected(raw, stream, lambda: self._abort(request_ids))
            return StreamingResponse(body, media_type="text/event-stream")
        result = await run_unless_disconnected(
            raw, self._collect(req, base_id, created, streams, params.n), lambda: self._abort(request_ids)
        )
        if result is None:
            return JSONResponse({}, status_code=499)
        return result

    async def _beam_search(self, req: CompletionRequest, raw: Request):
        """`n` beams per prompt (kvserve.beam_search); the choices are the beams, best first. The options that
        beam search does not apply are refused rather than ignored."""
        unsupported = {
            "stream": req.stream,
            "logprobs": req.logprobs is not None,
            "stop": bool(req.stop),
            "stop_token_ids": bool(req.stop_token_ids),
            "max_tokens": req.max_tokens is None,
            "structured outputs": to_structured_outputs(req) is not None,
            "kv_transfer_params": req.kv_transfer_params is not None,
        }
        refused = [name for name, given in unsupported.items() if given]
        if refused:
            raise OpenAIError(f"use_beam_search does not support: {', '.join(refused)}", param=refused[0])
        try:
            params = BeamSearchParams(
                beam_width=req.n,
                max_tokens=req.max_tokens,  # type: ignore[arg-type]
                ignore_eos=req.ignore_eos,
                temperature=req.temperature or 0.0,
                length_penalty=req.length_penalty,
                include_stop_str_in_output=req.include_stop_str_in_output,
            )
        except ValueError as e:
            raise OpenAIError(str(e)) from None
        base_id = f"cmpl-{random_uuid()}"
        created = int(time.time())

        async def run() -> list[RequestOutput]:
            prompts = self._prompts(req)
            searches = [self.engine.beam_search(p, params, f"{base_id}-{i}") for i, p in enumerate(prompts)]
            try:
                return list(await asyncio.gather(*searches))
            except Exception as e:
                raise engine_error(e) from None

        # A disconnect cancels the searches, which aborts their step's requests.
        finals = await run_unless_disconnected(raw, run(), lambda: None)
        if finals is None:
            return JSONResponse({}, status_code=499)
        choices, usage = [], UsageInfo()
        for p_idx, out in enumerate(finals):
            usage.prompt_tokens += len(out.prompt_token_ids)
            echo = self._echo_text(req, out)
            for c in out.outputs:
                usage.completion_tokens += len(c.token_ids)
                choices.append(
                    CompletionChoice(
                        index=p_idx * req.n + c.index,
                        text=echo + c.text,
                        finish_reason=c.finish_reason,
                        stop_reason=c.stop_reason,
                        token_ids=list(c.token_ids) if req.return_token_ids else None,
                    )
                )
        usage.total_tokens = usage.prompt_tokens + usage.completion_tokens
        return CompletionResponse(id=base_id, created=created, model=self.model_name, choices=choices, usage=usage)

    def _abort(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self.engine.abort(rid)

    async def _collect(self, req, base_id, created, streams, n) -> CompletionResponse:
        async def final(stream: RequestStream) -> RequestOutput:
            last = None
            async for out in stream:
                last = out
            assert last is not None
            return last

        try:
            finals = await asyncio.gather(*(final(st) for st in streams))
        except Exception as e:
            raise engine_error(e) from None
        finally:
            for st in streams:
                st.close()
        choices, usage = [], UsageInfo()
        for p_idx, out in enumerate(finals):
            usage.prompt_tokens += len(out.prompt_token_ids)
            echo = self._echo_text(req, out)
            for c in out.outputs:
                usage.completion_tokens += len(c.token_ids)
                choices.append(
                    CompletionChoice(
                        index=p_idx * n + c.index,
                        text=echo + c.text,
                        logprobs=self._logprobs(c, len(echo)) if req.logprobs is not None else None,
                        finish_reason=c.finish_reason,
                        stop_reason=c.stop_reason,
                        token_ids=list(c.token_ids) if req.return_token_ids else None,
                    )
                )
        usage.total_tokens = usage.prompt_tokens + usage.completion_tokens
        choices.sort(key=lambda c: c.index)
        params = next((out.kv_transfer_params for out in finals if out.kv_transfer_params is not None), None)
        return CompletionResponse(
            id=base_id, created=created, model=self.model_name, choices=choices, usage=usage, kv_transfer_params=params
        )

    async def _stream(self, req, base_id, created, streams, n) -> AsyncIterator[str]:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        queue: asyncio.Queue = asyncio.Queue()
        done = object()

        async def pump(p_idx: int, stream: RequestStream) -> None:
            try:
                async for out in stream:
                    await queue.put((p_idx, out))
            except Exception as e:  # relayed to the client as an SSE error event
                await queue.put((p_idx, e))
            finally:
                await queue.put((p_idx, done))

        tasks = [asyncio.create_task(pump(i, st)) for i, st in enumerate(streams)]
        prompt_tokens = [0] * len(streams)
        completion_tokens = 0
        echoed: set[int] = set()
        offsets: dict[int, int] = {}
        remaining = len(streams)
        try:
            while remaining:
                p_idx, item = await queue.get()
                if item is done:
                    remaining -= 1
                    continue
                if isinstance(item, RequestAborted):
                    return
                if isinstance(item, Exception):
                    yield sse(engine_error(item).body())
                    return
                out: RequestOutput = item
                prompt_tokens[p_idx] = len(out.prompt_token_ids)
                for c in out.outputs:
                    index = p_idx * n + c.index
                    text = c.text
                    if req.echo and index not in echoed:
                        echoed.add(index)
                        text = self._echo_text(req, out) + text
                    completion_tokens += len(c.token_ids)
                    logprobs = None
                    if req.logprobs is not None:
                        logprobs = self._logprobs(c, offsets.get(index, 0))
                        offsets[index] = offsets.get(index, 0) + sum(len(t) for t in logprobs.tokens)
                    chunk = CompletionResponse(
                        id=base_id,
                        created=created,
                        model=self.model_name,
                        choices=[
                            CompletionChoice(
                                index=index,
                                text=text,
                                logprobs=logprobs,
                                finish_reason=c.finish_reason,
                                stop_reason=c.stop_reason,
                                token_ids=list(c.token_ids) if req.return_token_ids else None,
                            )
                        ],
                    )
                    yield sse(chunk.model_dump(exclude={"usage"}))
            if include_usage:
                usage = UsageInfo(prompt_tokens=sum(prompt_tokens), completion_tokens=completion_tokens)
                usage.total_tokens = usage.prompt_tokens + usage.completion_tokens
                yield sse(
                    CompletionResponse(id=base_id, created=created, model=self.model_name, choices=[], usage=usage)
                )
            yield SSE_DONE
        finally:
            for t in tasks:
                t.cancel()
            for st in streams:
                st.close()

    def _echo_text(self, req: CompletionRequest, out: RequestOutput) -> str:
        if not req.echo:
            return ""
        if out.prompt is not None:
            return out.prompt
        return self.engine.tokenizer.decode(out.prompt_token_ids)

    def _logprobs(self, c: CompletionOutput, start_offset: int) -> CompletionLogprobs:
        lp = CompletionLogprobs()
        offset = start_offset
        decode = self.engine.tokenizer.decode
        for token_id, entry in zip(c.token_ids, c.logprobs or [], strict=False):
            text = token_text(entry[token_id], token_id, decode)
            lp.tokens.append(text)
            lp.token_logprobs.append(json_logprob(entry[token_id]))
            lp.top_logprobs.append({token_text(v, t, decode): json_logprob(v) for t, v in entry.items()})
            lp.text_offset.append(offset)
            offset += len(text)
        return lp


__all__ = ["CompletionHandler", "OpenAIError"]

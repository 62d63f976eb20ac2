"""AsyncLLM: the asyncio frontend of a server. Tokenization, detokenization, stop strings and metrics run here;
the engine core runs in its own process.

`generate()` is an async iterator of RequestOutputs for one request. Leaving it early (the consumer stops,
is cancelled, or the client disconnects) aborts the request in the core, which frees its blocks at once.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from collections.abc import AsyncIterator

from kvserve.beam_search import BeamSearchInstance, BeamSearchParams, to_request_output
from kvserve.config import EngineConfig
from kvserve.engine.arg_utils import EngineArgs
from kvserve.engine.core_client import AsyncMPClient, EngineDeadError
from kvserve.engine.llm_engine import fan_out
from kvserve.engine.messages import CoreError, CoreOutputs
from kvserve.engine.metrics import EngineMetrics
from kvserve.engine.output_processor import OutputKind, OutputProcessor
from kvserve.engine.processor import Processor, PromptType
from kvserve.loader.tokenizer import load_tokenizer
from kvserve.outputs import RequestOutput
from kvserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class RequestAborted(Exception):
    """Raised by generate() when the request was aborted (by the client going away or by shutdown)."""


class RequestStream:
    """Outputs of one request, in order. `close()` before the end aborts the request (idempotent)."""

    def __init__(self, engine: AsyncLLM, request_id: str, queue: asyncio.Queue) -> None:
        self._engine = engine
        self.request_id = request_id
        self._queue = queue
        self.finished = False
        self._closed = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished or self._closed:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self.close()
            raise item
        if item.finished:
            self.finished = True
            self.close()
        return item

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if not self.finished:
            self._engine.abort(self.request_id)
        self._engine._forget(self.request_id)


class AsyncLLM:
    def __init__(self, config: EngineConfig, model_name: str) -> None:
        self.config = config
        self.model_name = model_name
        self.tokenizer = load_tokenizer(config.model.tokenizer)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.metrics = EngineMetrics(model_name)
        self.client: AsyncMPClient | None = None
        self.processor: Processor | None = None
        self._queues: dict[str, asyncio.Queue[RequestOutput | BaseException]] = {}
        self._seq_to_request: dict[str, str] = {}
        self._output_task: asyncio.Task | None = None
        self.num_blocks = 0

    @classmethod
    async def create(cls, args: EngineArgs, model_name: str | None = None) -> AsyncLLM:
        config = args.create_engine_config(serving=True)
        llm = cls(config, model_name or config.model.model)
        await llm.start()
        return llm

    async def start(self) -> None:
        self.client = AsyncMPClient(self.config)
        self.client.on_death(self._on_engine_death)
        ready = await self.client.wait_ready()
        self.num_blocks = ready.num_blocks
        self.processor = Processor(self.config.model, self.tokenizer, ready.max_tokens_per_request)
        self._output_task = asyncio.create_task(self._output_loop(), name="kvserve-output-loop")
        gc.collect()
        gc.freeze()  # start-up's objects stay for good: full collections while serving skip them

    @property
    def is_healthy(self) -> bool:
        return self.client is not None and not self.client.dead

    # ------------------------------------------------------------------ requests

    async def add_request(
        self,
        prompt: PromptType,
        params: SamplingParams,
        request_id: str,
        output_kind: OutputKind = OutputKind.DELTA,
    ) -> RequestStream:
        """Validate and queue a request; iterate the returned stream for its outputs.

        Raises ValueError for bad input (nothing is queued then) and EngineDeadError if the core is gone.
        """
        if not self.is_healthy:
            raise EngineDeadError("engine core is not running")
        assert self.processor is not None and self.client is not None
        if request_id in self._queues:
            raise ValueError(f"duplicate request id {request_id!r}")
        arrival = time.time()
        prompt_text, prompt_ids = self.processor.tokenize(prompt)
        seqs = fan_out(request_id, params)
        core_reqs = [self.processor.make_core_request(sid, prompt_ids, p, arrival) for sid, p in seqs]
        queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._queues[request_id] = queue
        self.output_processor.add_request(request_id, prompt_text, prompt_ids, seqs, output_kind, arrival)
        for sid, _ in seqs:
            self._seq_to_request[sid] = request_id
        stream = RequestStream(self, request_id, queue)
        try:
            for core_req in core_reqs:
                await self.client.add_request(core_req)
        except BaseException:
            stream.close()
            raise
        return stream

    async def generate(
        self,
        prompt: PromptType,
        params: SamplingParams,
        request_id: str,
        output_kind: OutputKind = OutputKind.DELTA,
    ) -> AsyncIterator[RequestOutput]:
        """Yields RequestOutputs (deltas, or one final) until the request finishes; leaving early aborts it."""
        stream = await self.add_request(prompt, params, request_id, output_kind)
        try:
            async for out in stream:
                yield out
        finally:
            stream.close()

    async def beam_search(self, prompt: PromptType, params: BeamSearchParams, request_id: str) -> RequestOutput:
        """Beam search for one prompt (kvserve.beam_search states the semantics); the result holds one finished
        output per beam, best first. Each step submits the running beams as one-token requests named
        `{request_id}-{step}-{beam}`; cancelling this coroutine aborts the step's requests."""
        assert self.processor is not None
        prompt_text, prompt_ids = self.processor.tokenize(prompt)
        # Validates the prompt and that prompt + max_tokens fits, without queueing anything.
        self.processor.make_core_request(request_id, prompt_ids, SamplingParams(max_tokens=params.max_tokens), None)
        instance = BeamSearchInstance(prompt_ids, params, self.processor.eos_token_ids)

        async def score(beam_id: str, tokens: list[int]) -> RequestOutput:
            last = None
            step_params = instance.step_params()
            prompt = {"prompt_token_ids": tokens}
            async for out in self.generate(prompt, step_params, beam_id, OutputKind.FINAL_ONLY):
                last = out
            assert last is not None
            return last

        step = 0
        while not instance.done:
            # A TaskGroup: one failing beam request cancels (and so aborts) its siblings.
            try:
                async with asyncio.TaskGroup() as group:
                    tasks = [
                        group.create_task(score(f"{request_id}-{step}-{i}", tokens))
                        for i, tokens in enumerate(instance.running_prompts())
                    ]
            except ExceptionGroup as group_error:
                raise group_error.exceptions[0] from None
            instance.advance([task.result().outputs[0].logprobs[0] for task in tasks])  # type: ignore[index]
            step += 1
        return to_request_output(request_id, prompt_text, prompt_ids, instance.result(), self.tokenizer.decode)

    def abort(self, request_id: str) -> None:
        """Stop a request now (safe from synchronous cleanup); its blocks are freed by the core."""
        seq_ids = self.output_processor.abort_request(request_id)
        if seq_ids:
            self.metrics.record_abort()
            if self.client is not None:
                self.client.abort_requests(seq_ids)
        queue = self._queues.get(request_id)
        if queue is not None:
            queue.put_nowait(RequestAborted(f"request {request_id} aborted"))

    def _forget(self, request_id: str) -> None:
        self._queues.pop(request_id, None)
        for sid in [s for s, r in self._seq_to_request.items() if r == request_id]:
            del self._seq_to_request[sid]

    # ------------------------------------------------------------------ outputs

    async def _output_loop(self) -> None:
        assert self.client is not None
        try:
            while True:
                msg = await self.client.get_output()
                if isinstance(msg, CoreOutputs):
                    processed = self.output_processor.process_outputs(msg.outputs)
                    for out in processed.request_outputs:
                        queue = self._queues.get(out.request_id)
                        if queue is not None:
                            queue.put_nowait(out)
                    if processed.seq_ids_to_abort:
                        self.client.abort_requests(processed.seq_ids_to_abort)
                    self.metrics.record_iteration(processed.stats)
                    self.metrics.record_core(msg.stats)
                elif isinstance(msg, CoreError):
                    request_id = self._seq_to_request.get(msg.request_id)
                    if request_id is not None and request_id in self._queues:
                        self.output_processor.abort_request(request_id)
                        self._queues[request_id].put_nowait(ValueError(msg.message))
        except asyncio.CancelledError:
            raise
        except Exception:
            logger.exception("output loop failed")
            raise

    def _on_engine_death(self) -> None:
        err = EngineDeadError("the engine core process died; the request cannot complete")
        for request_id, queue in list(self._queues.items()):
            self.output_processor.abort_request(request_id)
            queue.put_nowait(err)
        self.metrics.mark_engine_dead()

    # ------------------------------------------------------------------ shutdown

    async def shutdown(self) -> None:
        for request_id in list(self._queues):
            self.abort(request_id)
        if self._output_task is not None:
            self._output_task.cancel()
            try:
                await self._output_task
            except (asyncio.CancelledError, Exception):
                pass
        if self.client is not None:
            self.client.shutdown()

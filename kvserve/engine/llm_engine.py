"""LLMEngine: frontend (tokenize, detokenize, stop strings, n > 1) around an in-process EngineCore."""

from __future__ import annotations

import time

from kvserve.config import EngineConfig
from kvserve.engine.arg_utils import EngineArgs
from kvserve.engine.core import EngineCore
from kvserve.engine.output_processor import OutputKind, OutputProcessor
from kvserve.engine.processor import Processor, PromptType
from kvserve.loader.tokenizer import load_tokenizer
from kvserve.outputs import RequestOutput
from kvserve.sampling_params import SamplingParams


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.tokenizer = load_tokenizer(config.model.tokenizer)
        self.engine_core = EngineCore(config)
        self.processor = Processor(config.model, self.tokenizer, self.engine_core.max_tokens_per_request)
        self.output_processor = OutputProcessor(self.tokenizer)

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> LLMEngine:
        return cls(args.create_engine_config())

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        arrival_time: float | None = None,
        output_kind: OutputKind = OutputKind.FINAL_ONLY,
    ) -> None:
        """Validate and queue. Raises ValueError (and queues nothing) on bad input."""
        if request_id in self.output_processor.parents:
            raise ValueError(f"duplicate request id {request_id!r}")
        arrival_time = arrival_time or time.time()
        prompt_text, prompt_ids = self.processor.tokenize(prompt)
        seqs = fan_out(request_id, params)
        core_reqs = [self.processor.make_core_request(sid, prompt_ids, p, arrival_time) for sid, p in seqs]
        self.output_processor.add_request(request_id, prompt_text, prompt_ids, seqs, output_kind, arrival_time)
        added: list[str] = []
        try:
            for core_req in core_reqs:
                self.engine_core.add_request(core_req)  # may still refuse one (ValueError)
                added.append(core_req.request_id)
        except Exception:
            self.output_processor.abort_request(request_id)
            self.engine_core.abort_requests(added)
            raise

    def abort_request(self, request_ids: list[str]) -> None:
        seq_ids = [sid for rid in request_ids for sid in self.output_processor.abort_request(rid)]
        self.engine_core.abort_requests(seq_ids)

    def step(self) -> list[RequestOutput]:
        core_outputs = self.engine_core.step()
        processed = self.output_processor.process_outputs(core_outputs)
        if processed.seq_ids_to_abort:
            self.engine_core.abort_requests(processed.seq_ids_to_abort)
        return processed.request_outputs

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished_requests() or self.engine_core.has_unfinished_requests()

    def get_stats(self) -> dict:
        return self.engine_core.get_stats()


def fan_out(request_id: str, params: SamplingParams) -> list[tuple[str, SamplingParams]]:
    """n > 1: one engine-core sequence per sample; a seeded request gives sample i the seed seed + i."""
    if params.n == 1:
        return [(request_id, params)]
    seqs = []
    for i in range(params.n):
        child = params.clone()
        child.n = 1
        if params.seed is not None:
            child.seed = params.seed + i
        seqs.append((f"{request_id}#{i}", child))
    return seqs

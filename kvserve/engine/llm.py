"""The offline API, shaped like vLLM's: `LLM(model=...).generate(prompts, sampling_params)` and `.chat(...)`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import fields
from typing import Any

from tqdm.auto import tqdm

from kvserve.beam_search import BeamSearchInstance, BeamSearchOutput, BeamSearchParams
from kvserve.engine.arg_utils import EngineArgs
from kvserve.engine.llm_engine import LLMEngine
from kvserve.engine.processor import PromptType, render_chat_prompt
from kvserve.outputs import RequestOutput
from kvserve.sampling_params import SamplingParams
from kvserve.utils import next_request_id

Message = dict[str, Any]


class LLM:
    """An engine in this process for batch generation.

    Example:
        llm = LLM()  # the embedded SmolLM2-135M-Instruct
        out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                       SamplingParams(temperature=0, max_tokens=32))
        print(out[0].outputs[0].text)
    """

    def __init__(self, model: str | None = None, **engine_kwargs: Any) -> None:
        """`model` and the keywords are EngineArgs fields (tokenizer, dtype, seed, max_model_len, max_num_seqs,
        max_num_batched_tokens, enable_prefix_caching, enable_chunked_prefill, block_size, kv_cache_memory,
        num_kv_blocks, kv_prefault, num_threads, cpu_bind); EngineArgs documents each. An unknown keyword raises
        TypeError."""
        options = {f.name for f in fields(EngineArgs)}
        unknown = sorted(set(engine_kwargs) - options)
        if unknown:
            raise TypeError(
                f"LLM() got unexpected keyword argument(s) {', '.join(unknown)}; "
                f"the engine options (EngineArgs fields) are: {', '.join(sorted(options))}"
            )
        self.engine = LLMEngine.from_engine_args(EngineArgs(model=model, **engine_kwargs))

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> LLM:
        llm = cls.__new__(cls)
        llm.engine = LLMEngine.from_engine_args(args)
        return llm

    def shutdown(self) -> None:
        """Stop the engine's workers (worker processes or actors with tensor parallelism). Idempotent."""
        self.engine.engine_core.shutdown()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in prompt order.

        If any prompt is invalid, a ValueError is raised and none of them runs.
        """
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(
                    f"got {len(params_list)} SamplingParams for {len(prompts)} prompts; pass one or one per prompt"
                )

        request_ids: list[str] = []
        try:
            for prompt, params in zip(prompts, params_list, strict=True):
                request_id = next_request_id()
                self.engine.add_request(request_id, prompt, params)
                request_ids.append(request_id)
        except Exception:
            self.engine.abort_request(request_ids)
            raise
        return self._run(request_ids, use_tqdm)

    def chat(
        self,
        messages: list[Message] | list[list[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation or a list of them, then generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts: list[PromptType] = [
            render_chat_prompt(self.engine.tokenizer, c, add_generation_prompt, chat_template_kwargs)
            for c in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def beam_search(
        self,
        prompts: PromptType | Sequence[PromptType],
        params: BeamSearchParams,
        *,
        use_tqdm: bool = False,
    ) -> list[BeamSearchOutput]:
        """Beam search (kvserve.beam_search states the semantics: HF's), one BeamSearchOutput per prompt in
        prompt order; each sequence's `tokens` include the prompt and its `text` decodes them all (vLLM's shape).

        Every step submits all running beams of all prompts as one batch of one-token requests; a beam's prompt
        is its parent's tokens plus one, so its full blocks are prefix-cache hits. Invalid prompts raise
        ValueError before anything runs.
        """
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        processor = self.engine.processor
        instances: list[BeamSearchInstance] = []
        for prompt in prompts:
            _, prompt_ids = processor.tokenize(prompt)
            # Validates the prompt and that prompt + max_tokens fits, without queueing anything.
            processor.make_core_request("beam-check", prompt_ids, SamplingParams(max_tokens=params.max_tokens), None)
            instances.append(BeamSearchInstance(prompt_ids, params, processor.eos_token_ids))
        bar = tqdm(total=params.max_tokens, desc="Beam search", dynamic_ncols=True, disable=not use_tqdm)
        while any(not inst.done for inst in instances):
            batch = [inst.running_prompts() for inst in instances]
            flat: list[PromptType] = [{"prompt_token_ids": tokens} for beams in batch for tokens in beams]
            outputs = self.generate(flat, instances[0].step_params(), use_tqdm=False)
            start = 0
            for inst, beams in zip(instances, batch, strict=True):
                if beams:
                    step = outputs[start : start + len(beams)]
                    inst.advance([out.outputs[0].logprobs[0] for out in step])  # type: ignore[index]
                    start += len(beams)
            bar.update(1)
        bar.close()
        results = []
        for inst in instances:
            sequences = inst.result()
            for seq in sequences:
                seq.text = self.engine.tokenizer.decode(seq.tokens)
            results.append(BeamSearchOutput(sequences=sequences))
        return results

    def stats(self) -> dict:
        """KV usage (blocks held by requests), queue sizes, preemptions and prefix-cache counters."""
        return self.engine.get_stats()

    def reset_prefix_cache(self) -> bool:
        return self.engine.engine_core.reset_prefix_cache()

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        results: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(request_ids), desc="Processed prompts", dynamic_ncols=True, disable=not use_tqdm)
        num_out_tokens = 0
        while self.engine.has_unfinished_requests():
            for output in self.engine.step():
                if output.finished:
                    results[output.request_id] = output
                    num_out_tokens += sum(len(c.token_ids) for c in output.outputs)
                    bar.update(1)
                    rate = num_out_tokens / max(bar.format_dict["elapsed"], 1e-6)
                    bar.set_postfix_str(f"output {rate:.1f} tok/s", refresh=False)
        bar.close()
        return [results[r] for r in request_ids]

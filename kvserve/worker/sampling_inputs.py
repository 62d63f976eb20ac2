"""Build the sampler's per-row tensors from the runner's request states."""

from __future__ import annotations

import numpy as np
import torch

from kvserve.sample.sampler import SamplingMetadata, to_device
from kvserve.worker.input_batch import InputBatch, RequestState


def build_sampling_metadata(
    states: list[RequestState],
    batch: InputBatch,
    vocab_size: int,
    generator: torch.Generator,
    offsets: np.ndarray | None = None,
    device: torch.device | str = "cpu",
) -> SamplingMetadata:
    """One row per state, in order. Features no row uses are left None so the sampler skips them.

    `offsets` (speculative decoding): row i samples the token `offsets[i]` places after the state's known
    tokens, i.e. after that many of its draft tokens (stored past the known tokens in the batch row); its seed
    position, min_tokens count and penalty history are those of that position. Tensors are made on `device`
    (where the logits are).
    """
    if offsets is None:
        offsets = np.zeros(len(states), dtype=np.int64)
    params = [s.sampling_params for s in states]
    temps = [0.0 if p.greedy else float(p.temperature) for p in params]
    all_greedy = all(t == 0.0 for t in temps)

    seeds: dict[int, tuple[int, int]] = {}
    banned: list[tuple[int, list[int]]] = []
    for i, (state, p) in enumerate(zip(states, params, strict=True)):
        num_tokens = int(batch.num_tokens[state.row] + offsets[i])
        if p.seed is not None and not p.greedy:
            # The position of the token being drawn: stable across batches and preemption.
            seeds[i] = (p.seed, num_tokens)
        if num_tokens - state.num_prompt_tokens < p.min_tokens:
            stop_ids = list(p.stop_token_ids or ()) + ([] if p.ignore_eos else sorted(state.eos_token_ids))
            if stop_ids:
                banned.append((i, stop_ids))

    top_ks = [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params]
    use_penalties = any(
        p.presence_penalty != 0 or p.frequency_penalty != 0 or p.repetition_penalty != 1 for p in params
    )
    logprob_counts = [p.logprobs for p in params if p.logprobs is not None]
    sampling = not all_greedy
    return SamplingMetadata(
        all_greedy=all_greedy,
        temperature=to_device(torch.tensor(temps, dtype=torch.float32), device) if sampling else None,
        top_k=_unless_all(top_ks, vocab_size, torch.int64, sampling, device),
        top_p=_unless_all([float(p.top_p) for p in params], 1.0, torch.float32, sampling, device),
        min_p=_unless_all([float(p.min_p) for p in params], 0.0, torch.float32, sampling, device),
        seeds=seeds,
        generator=generator,
        presence_penalty=_unless_all([p.presence_penalty for p in params], 0.0, torch.float32, use_penalties, device),
        frequency_penalty=_unless_all([p.frequency_penalty for p in params], 0.0, torch.float32, use_penalties, device),
        repetition_penalty=_unless_all(
            [p.repetition_penalty for p in params], 1.0, torch.float32, use_penalties, device
        ),
        output_token_ids=[batch.output_token_ids(s, int(o)) for s, o in zip(states, offsets, strict=True)]
        if use_penalties
        else None,
        prompt_token_ids=[batch.prompt_token_ids(s) for s in states] if use_penalties else None,
        banned_tokens=banned,
        max_num_logprobs=max(logprob_counts) if logprob_counts else None,
        # Known here: the sampler need not read them back from the device.
        any_greedy=any(t == 0.0 for t in temps),
        any_temperature=any(t not in (0.0, 1.0) for t in temps),
        max_top_k=max(top_ks, default=None),
    )


def _unless_all(
    values: list, neutral: float, dtype: torch.dtype, enabled: bool, device: torch.device | str
) -> torch.Tensor | None:
    if not enabled or all(v == neutral for v in values):
        return None
    return to_device(torch.tensor(values, dtype=dtype), device)

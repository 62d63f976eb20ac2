"""Size the GPU's KV pool by profiling, as vLLM does: run a dummy forward at the largest batch shape, measure the
peak, and give the KV cache what is left of `total * gpu_memory_utilization`.

    kv_budget = total * gpu_memory_utilization - weights - peak_activations - non_torch_increase

- weights: what torch holds once the model is loaded;
- peak_activations: torch's peak during the dummy step (forward at max_num_batched_tokens, logits and sampling
  of max_num_seqs rows) above the weights;
- non_torch_increase: device memory this process took outside torch's allocator since the runner started
  (cuBLAS workspaces, Triton's modules, ...).

The CUDA context and other processes' memory are in the baseline taken when the runner starts, as in vLLM; the
share 1 - gpu_memory_utilization is the headroom for those and for the captured decode graphs (small: decode
batches are at most max_num_seqs tokens).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from kvserve.attention.base import AttentionInputs
from kvserve.sample.sampler import SamplingMetadata
from kvserve.utils import cdiv

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class MemorySnapshot:
    """Device-wide and torch-allocator figures at one moment, in bytes."""

    total: int
    free: int
    torch_allocated: int
    torch_reserved: int

    @property
    def non_torch(self) -> int:
        """Memory in use on the device outside this process's torch allocator (the CUDA context, libraries'
        workspaces, other processes)."""
        return self.total - self.free - self.torch_reserved

    @classmethod
    def take(cls, device: torch.device) -> MemorySnapshot:
        torch.cuda.synchronize(device)
        free, total = torch.cuda.mem_get_info(device)
        return cls(total, free, torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device))


@dataclass(frozen=True)
class MemoryProfile:
    total: int
    weights: int
    peak_activations: int
    non_torch_increase: int

    def kv_budget(self, gpu_memory_utilization: float) -> int:
        """Bytes the KV cache may take (negative when nothing is left)."""
        return int(self.total * gpu_memory_utilization) - self.weights - self.peak_activations - self.non_torch_increase

    def describe(self, gpu_memory_utilization: float) -> str:
        gib = 2**30
        return (
            f"total {self.total / gib:.2f} GiB x {gpu_memory_utilization} - weights {self.weights / gib:.2f} GiB - "
            f"peak activations {self.peak_activations / gib:.2f} GiB - non-torch {self.non_torch_increase / gib:.2f}"
            f" GiB = KV cache {max(0, self.kv_budget(gpu_memory_utilization)) / gib:.2f} GiB"
        )


def profile_from_snapshots(
    baseline: MemorySnapshot, before_run: MemorySnapshot, after_run: MemorySnapshot, peak_allocated: int
) -> MemoryProfile:
    """`baseline`: when the runner started (before the weights); `before_run` / `after_run`: around the dummy step;
    `peak_allocated`: torch's peak allocation during it."""
    return MemoryProfile(
        total=after_run.total,
        weights=before_run.torch_allocated - baseline.torch_allocated,
        peak_activations=max(0, peak_allocated - before_run.torch_allocated),
        non_torch_increase=max(0, after_run.non_torch - baseline.non_torch),
    )


def profile_run(run: Callable[[], None], device: torch.device, baseline: MemorySnapshot) -> MemoryProfile:
    """Run the dummy step `run` and measure it against `baseline`."""
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    before = MemorySnapshot.take(device)
    run()
    after = MemorySnapshot.take(device)
    peak = torch.cuda.max_memory_allocated(device)
    profile = profile_from_snapshots(baseline, before, after, peak)
    torch.cuda.empty_cache()  # the dummy step's activations go back to the device for the KV pool
    return profile


def num_blocks_from_profile(profile: MemoryProfile, gpu_memory_utilization: float, bytes_per_block: int) -> int:
    budget = profile.kv_budget(gpu_memory_utilization)
    num_blocks = budget // bytes_per_block
    if num_blocks < 1:
        raise ValueError(
            f"no GPU memory left for the KV cache ({profile.describe(gpu_memory_utilization)}; one block takes "
            f"{bytes_per_block} bytes): raise gpu_memory_utilization, or lower max_num_batched_tokens / "
            "max_num_seqs"
        )
    return int(num_blocks)


def dummy_attention_inputs(num_tokens: int, num_reqs: int, block_size: int) -> AttentionInputs:
    """The profiling step's batch: `num_tokens` prompt tokens spread evenly over min(num_reqs, num_tokens) fresh
    requests, every slot -1 (nothing written) and every block id 0 (a one-block dummy cache serves all reads)."""
    num_reqs = max(1, min(num_reqs, num_tokens))
    q_lens = np.full(num_reqs, num_tokens // num_reqs, dtype=np.int64)
    q_lens[: num_tokens % num_reqs] += 1
    return AttentionInputs(
        num_decodes=int(np.count_nonzero(q_lens == 1)),
        query_start_loc=np.concatenate([[0], np.cumsum(q_lens)]),
        seq_lens=q_lens.copy(),
        block_table=np.zeros((num_reqs, cdiv(int(q_lens.max()), block_size)), dtype=np.int32),
        slot_mapping=np.full(num_tokens, -1, dtype=np.int64),
        block_size=block_size,
    )


def dummy_sampling_metadata(num_rows: int, device: torch.device, generator: torch.Generator) -> SamplingMetadata:
    """Random draws with top-k and top-p on every row: the sampler's largest temporaries (a sort of the logits)."""
    return SamplingMetadata(
        all_greedy=False,
        temperature=torch.ones(num_rows, device=device),
        top_k=torch.full((num_rows,), 50, dtype=torch.int64, device=device),
        top_p=torch.full((num_rows,), 0.9, device=device),
        min_p=None,
        seeds={},
        generator=generator,
        presence_penalty=None,
        frequency_penalty=None,
        repetition_penalty=None,
        output_token_ids=None,
        prompt_token_ids=None,
        banned_tokens=[],
        max_num_logprobs=None,
    )

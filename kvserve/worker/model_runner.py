"""ModelRunner: SchedulerOutput -> model inputs -> forward -> sample -> ModelRunnerOutput.

Holds the model, the KV cache tensors and its own per-request state (InputBatch); never sees scheduler objects.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch

from kvserve.attention.base import AttentionInputs, KVCache
from kvserve.attention.torch_cpu import TorchAttentionBackend
from kvserve.config import CacheConfig, ModelConfig, SchedulerConfig
from kvserve.core.sched_output import SchedulerOutput
from kvserve.loader.model_loader import load_model
from kvserve.outputs import ModelRunnerOutput
from kvserve.sample.sampler import Sampler, SamplerOutput
from kvserve.utils import cdiv
from kvserve.worker.input_batch import InputBatch, RequestState
from kvserve.worker.kv_cache import allocate_kv_cache, num_blocks_for
from kvserve.worker.sampling_inputs import build_sampling_metadata

logger = logging.getLogger(__name__)


class ModelRunner:
    def __init__(self, model_config: ModelConfig, cache_config: CacheConfig, scheduler_config: SchedulerConfig) -> None:
        self.model_config = model_config
        self.cache_config = cache_config
        self.block_size = cache_config.block_size
        self.dtype = getattr(torch, model_config.dtype)
        arch = model_config.arch
        self.attn_backend = TorchAttentionBackend(
            arch.num_attention_heads, arch.num_key_value_heads, arch.head_dim, self.dtype
        )
        start = time.perf_counter()
        self.model = load_model(model_config, self.attn_backend)
        logger.info("loaded %s in %.1fs", model_config.model, time.perf_counter() - start)
        self.vocab_size = arch.vocab_size
        self.sampler = Sampler()
        self.generator = torch.Generator().manual_seed(model_config.seed)
        self.batch = InputBatch(
            scheduler_config.max_num_seqs,
            model_config.max_model_len,
            cdiv(model_config.max_model_len, self.block_size),
        )
        self.num_blocks = num_blocks_for(cache_config, arch, self.dtype)
        self.kv_caches: list[KVCache] = allocate_kv_cache(self.num_blocks, cache_config.block_size, arch, self.dtype)

    # ------------------------------------------------------------------ one step

    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        batch = self.batch
        for req_id in so.finished_req_ids:
            batch.remove(req_id)
        for new in so.scheduled_new_reqs:
            batch.add(new)
        for cached in so.scheduled_cached_reqs:
            batch.update(cached)
        if so.is_empty:
            return ModelRunnerOutput([], [])

        # Single-token queries (decodes) first: the attention backend batches them.
        req_ids = sorted(so.num_scheduled_tokens, key=lambda r: so.num_scheduled_tokens[r] > 1)
        states = [batch.states[r] for r in req_ids]
        rows = np.fromiter((s.row for s in states), dtype=np.int64, count=len(states))
        q_lens = np.fromiter((so.num_scheduled_tokens[r] for r in req_ids), dtype=np.int64, count=len(states))
        num_decodes = int(np.count_nonzero(q_lens == 1))

        start_pos = batch.num_computed_tokens[rows]
        query_start_loc = np.zeros(len(rows) + 1, dtype=np.int64)
        np.cumsum(q_lens, out=query_start_loc[1:])
        num_tokens = int(query_start_loc[-1])
        token_req = np.repeat(np.arange(len(rows)), q_lens)  # request index of each token
        positions = start_pos[token_req] + np.arange(num_tokens) - query_start_loc[token_req]
        token_rows = rows[token_req]
        input_ids = batch.token_ids[token_rows, positions]
        block_ids = batch.block_table[token_rows, positions // self.block_size].astype(np.int64)
        slot_mapping = block_ids * self.block_size + positions % self.block_size
        seq_lens = start_pos + q_lens

        attn_metadata = self.attn_backend.build_metadata(
            AttentionInputs(
                num_decodes=num_decodes,
                query_start_loc=query_start_loc,
                seq_lens=seq_lens,
                block_table=batch.block_table[rows],
                slot_mapping=slot_mapping,
                block_size=self.block_size,
            )
        )
        hidden = self.model(torch.from_numpy(input_ids), torch.from_numpy(positions), self.kv_caches, attn_metadata)

        # Only requests whose known tokens are now all computed produce a token (not mid-prompt chunks).
        num_known = batch.num_tokens[rows]
        sampling = seq_lens >= num_known
        sample_idx = np.flatnonzero(sampling)
        batch.num_computed_tokens[rows] = seq_lens
        sampled_lists: list[list[int]] = [[] for _ in req_ids]
        logprobs_lists: list = [None] * len(req_ids)
        if len(sample_idx):
            logits = self.model.compute_logits(hidden[torch.from_numpy(query_start_loc[1:][sample_idx] - 1)])
            sample_states = [states[i] for i in sample_idx]
            out = self.sampler(logits, build_sampling_metadata(sample_states, batch, self.vocab_size, self.generator))
            sampled = out.sampled_token_ids.numpy()
            sample_rows = rows[sample_idx]
            batch.token_ids[sample_rows, batch.num_tokens[sample_rows]] = sampled
            batch.num_tokens[sample_rows] += 1
            for j, i in enumerate(sample_idx.tolist()):
                sampled_lists[i] = [int(sampled[j])]
            if out.logprobs is not None:
                self._collect_logprobs(out, sample_idx, sample_states, logprobs_lists)
        has_logprobs = any(x is not None for x in logprobs_lists)
        return ModelRunnerOutput(req_ids, sampled_lists, logprobs_lists if has_logprobs else None)

    @staticmethod
    def _collect_logprobs(out: SamplerOutput, sample_idx: np.ndarray, states: list[RequestState], dest: list) -> None:
        assert out.logprobs is not None and out.logprob_token_ids is not None and out.sampled_ranks is not None
        ids = out.logprob_token_ids.tolist()
        lps = out.logprobs.tolist()
        ranks = out.sampled_ranks.tolist()
        for j, (i, state) in enumerate(zip(sample_idx.tolist(), states, strict=True)):
            n = state.sampling_params.logprobs
            if n is None:
                continue
            dest[i] = [(ids[j][: n + 1], lps[j][: n + 1], ranks[j])]

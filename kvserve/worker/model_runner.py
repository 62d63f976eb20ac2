"""ModelRunner: SchedulerOutput -> model inputs -> forward -> sample -> ModelRunnerOutput.

Holds the model, the KV cache tensors and its own per-request state (InputBatch); never sees scheduler objects.

Devices: the CPU (numpy inputs used in place, no copies) or a GPU ("cuda"): inputs are built in numpy as on the CPU
and copied over once per step; the KV pool is sized by profiling (worker/gpu_memory.py) and decode-only steps
replay captured CUDA graphs (worker/cuda_graph.py) unless enforce_eager. Sampling runs where the logits are.

Speculative decoding: a request scheduled with k draft tokens has them written after its known tokens in its
InputBatch row, so they are fed like any other token; the last k + 1 positions are scored and the rejection
sampler keeps the accepted drafts plus one token. The proposer then drafts the next step's tokens for every
request that produced tokens; a model proposer (draft model, EAGLE: kvserve.spec_decode.model_proposer) also sees
the step's layout and the target's last hidden states, and hands its draft distributions q to the next
verification.

Async scheduling (execute_model_async): the engine core hands over step N+1 before it has read step N's tokens.
The runner launches N+1 with the tokens N is still sampling taken from the device (InputBatch.pending), then
reads N's tokens on the host, and only then builds N+1's sampling inputs (penalties and seeds see them). On a GPU
the host thus prepares and launches N+1 while N runs; on the CPU every call is synchronous and only the order
changes.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvserve.attention.base import AttentionInputs, KVCache
from kvserve.attention.selector import get_attn_backend
from kvserve.config import CacheConfig, KVTransferConfig, ModelConfig, SchedulerConfig, SpeculativeConfig
from kvserve.core.sched_output import SchedulerOutput
from kvserve.core.spec_decode import SpecDecodePolicy
from kvserve.distributed.parallel_state import get_tp_group
from kvserve.distributed.sharding import head_slice
from kvserve.kv_transfer.base import KVConnectorInfo
from kvserve.layers.batch_invariant import resolve_deterministic
from kvserve.layers.quant.apply import model_weight_bytes
from kvserve.loader.model_loader import load_model
from kvserve.outputs import ModelRunnerOutput
from kvserve.platform import startup_summary
from kvserve.profiling import StepTimer
from kvserve.sample.bitmask import apply_grammar_bitmask
from kvserve.sample.rejection_sampler import DraftInputs, RejectionSampler
from kvserve.sample.sampler import Sampler, SamplerOutput
from kvserve.spec_decode.base import Proposer
from kvserve.spec_decode.build import build_proposer
from kvserve.spec_decode.model_proposer import DraftStepInputs, ModelProposer
from kvserve.utils import cdiv
from kvserve.worker.cuda_graph import DecodeGraphRunner, capture_sizes
from kvserve.worker.gpu_memory import (
    MemorySnapshot,
    dummy_attention_inputs,
    dummy_sampling_metadata,
    num_blocks_from_profile,
    profile_run,
)
from kvserve.worker.input_batch import InputBatch, RequestState
from kvserve.worker.kv_cache import allocate_kv_cache, bytes_per_block, num_blocks_for, prefault_kv_cache
from kvserve.worker.kv_transfer import KVTransfer
from kvserve.worker.sampling_inputs import build_sampling_metadata

logger = logging.getLogger(__name__)


@dataclass
class _StepInputs:
    req_ids: list[str]  # in batch order: decodes first
    states: list[RequestState]
    rows: np.ndarray  # [R] InputBatch row of each request
    input_ids: np.ndarray  # [T]
    positions: np.ndarray  # [T]
    query_start_loc: np.ndarray  # [R + 1]
    seq_lens: np.ndarray  # [R] context length after this step
    sample_idx: np.ndarray  # indices into req_ids of the requests that sample a token this step
    num_drafts: np.ndarray  # [R] draft tokens scheduled per request (0 without speculation)
    attn_inputs: AttentionInputs
    attn_metadata: Any  # None when the step replays a CUDA graph (its metadata lives in the graph's buffers)
    graph_size: int | None  # the padded batch size of the CUDA graph this step replays, or None (eager)
    token_rows: np.ndarray  # [T] InputBatch row of each token


@dataclass
class _InFlight:
    """A launched step (async scheduling) whose sampled tokens the host has not read yet."""

    req_ids: list[str]  # the step's requests, in batch order
    sample_idx: np.ndarray  # indices into req_ids of those that sample
    states: list[RequestState]  # theirs, in order
    positions: np.ndarray  # where each sampled token goes in its request's row
    sampled: torch.Tensor | None  # [S] on the device (None: no request samples)
    host: torch.Tensor | None  # [S] on the host, valid once `ready` has passed
    ready: torch.cuda.Event | None
    out: SamplerOutput | None


class ModelRunner:
    def __init__(
        self,
        model_config: ModelConfig,
        cache_config: CacheConfig,
        scheduler_config: SchedulerConfig,
        timer: StepTimer | None = None,
        spec_config: SpeculativeConfig | None = None,
        kv_transfer_config: KVTransferConfig | None = None,
        allocate_kv_cache: bool = True,
    ) -> None:
        """`allocate_kv_cache=False`: the owner sizes the pool (determine_num_kv_blocks, e.g. the minimum over
        tensor-parallel ranks) and calls initialize_kv_cache itself."""
        self.timer = timer or StepTimer()
        self.model_config = model_config
        self.cache_config = cache_config
        self.scheduler_config = scheduler_config
        self.block_size = cache_config.block_size
        self.dtype = getattr(torch, model_config.dtype)
        self.device = torch.device(model_config.device)
        self.on_gpu = self.device.type == "cuda"
        self._memory_baseline: MemorySnapshot | None = None
        if self.on_gpu:
            if self.device.index is None:  # "cuda": the current GPU, named by index (set_device needs one)
                self.device = torch.device("cuda", torch.cuda.current_device())
            torch.cuda.set_device(self.device)
            self._memory_baseline = MemorySnapshot.take(self.device)
        arch = model_config.arch
        tp = get_tp_group()
        self.tp_size = tp.world_size
        # This rank's heads: the attention backend and the KV cache see only them.
        heads = head_slice(arch.num_attention_heads, arch.num_key_value_heads, tp.world_size, tp.rank)
        self.attn_backend = get_attn_backend(
            heads.num_heads,
            heads.num_kv_heads,
            arch.head_dim,
            self.dtype,
            self.device,
            model_config.attention_backend,
            model_config.deterministic,
        )
        start = time.perf_counter()
        self.model = load_model(model_config, self.attn_backend)
        logger.info("loaded %s in %.1fs", model_config.model, time.perf_counter() - start)
        # "on" or "off (why)"; raises if deterministic=True cannot hold here.
        self.deterministic = resolve_deterministic(
            model_config.deterministic, self.model, self.attn_backend, self.block_size
        )
        self.weight_bytes = model_weight_bytes(self.model)
        weights = f"{model_config.quantization or model_config.dtype} weights {self.weight_bytes / 2**20:.0f} MiB"
        # Its own logger, which the CLI shows even without -v: what the platform chose is worth one line always.
        logging.getLogger("kvserve.startup").info(
            startup_summary(
                f"{model_config.dtype} ({weights})",
                torch.get_num_threads(),
                self.attn_backend.describe(self.block_size),
                model_config.device,
                self.deterministic,
            )
        )
        self.vocab_size = arch.vocab_size
        self.sampler = Sampler(self.device)
        self.rejection_sampler = RejectionSampler(self.sampler)
        # NOTE: on the CPU whatever the device: it draws only the [B] noise keys of unseeded rows, so a seed gives
        # the same draws on any device.
        self.generator = torch.Generator().manual_seed(model_config.seed)
        self.graphs: DecodeGraphRunner | None = None  # with the KV cache, on a GPU
        self._in_flight: _InFlight | None = None  # async scheduling: the last launched step
        self.batch = InputBatch(
            scheduler_config.max_num_seqs,
            model_config.max_model_len,
            cdiv(model_config.max_model_len, self.block_size),
        )
        num_layers = arch.num_hidden_layers
        block_bytes = bytes_per_block(self.attn_backend, self.block_size, num_layers, self.dtype)
        self._kv_transfer_config = kv_transfer_config
        self.kv_transfer: KVTransfer | None = None  # with the KV cache (initialize_kv_cache)
        self.num_blocks = 0
        self.kv_caches: list[KVCache] = []
        # Built before the pool is sized: a draft model's weights then count in a GPU memory profile, and its own
        # KV pool (the target's block count, allocated with the target's) in the bytes each block costs.
        self.proposer: Proposer | ModelProposer | None = None
        if spec_config is not None:
            self.proposer = build_proposer(
                spec_config,
                self.model,
                self.attn_backend,
                self.block_size,
                self.dtype,
                model_config.max_model_len,
                self.generator,
                self.device,
            )
        self.spec_policy = SpecDecodePolicy(spec_config) if spec_config is not None else None
        # A block that leaves the pool (swap, a KV connector) takes the draft's block of the same id with it.
        swap = scheduler_config.preemption_mode == "swap"
        all_block_bytes = block_bytes + self._proposer_block_bytes()
        self.num_swap_blocks = cache_config.swap_space // all_block_bytes if swap else 0
        # Everything that decides what a block's bytes mean: KV saved under another one must never be loaded.
        layout_id = (
            f"{model_config.path}|{model_config.dtype}|{model_config.quantization}|"
            f"{self.attn_backend.describe(self.block_size)}|{self.attn_backend.kv_cache_shape(1, self.block_size)}"
            f"|layers={num_layers}|deterministic={self.deterministic == 'on'}"
        )
        if isinstance(self.proposer, ModelProposer):
            layout_id += f"|draft={self.proposer.layout_id()}"
        self.kv_connector_info = KVConnectorInfo(self.block_size, num_layers, all_block_bytes, layout_id)
        self._prefault_stop = threading.Event()
        self._prefault_thread: threading.Thread | None = None
        if allocate_kv_cache:
            self.initialize_kv_cache(self.determine_num_kv_blocks())

    def determine_num_kv_blocks(self) -> int:
        """Blocks this rank's share of the KV budget holds (the budget is the engine's, split over the ranks). On a
        GPU without an explicit budget: what a profiling run leaves of gpu_memory_utilization."""
        arch = self.model_config.arch
        cache = self.cache_config
        if self.on_gpu and cache.num_kv_blocks is None and cache.kv_cache_memory is None:
            return self._profile_num_kv_blocks()
        return num_blocks_for(
            cache, self.attn_backend, arch.num_hidden_layers, self.dtype, self.tp_size, self._proposer_block_bytes()
        )

    def _proposer_block_bytes(self) -> int:
        """What a model proposer's pool adds to each block (0 without one)."""
        return self.proposer.bytes_per_block() if isinstance(self.proposer, ModelProposer) else 0

    def _profile_num_kv_blocks(self) -> int:
        assert self._memory_baseline is not None
        sched = self.scheduler_config
        profile = profile_run(
            lambda: self.dummy_run(sched.max_num_batched_tokens, sched.max_num_seqs), self.device, self._memory_baseline
        )
        util = self.cache_config.gpu_memory_utilization
        per_block = (
            bytes_per_block(self.attn_backend, self.block_size, self.model_config.arch.num_hidden_layers, self.dtype)
            + self._proposer_block_bytes()
        )
        num_blocks = num_blocks_from_profile(profile, util, per_block)
        logger.info("GPU memory: %s", profile.describe(util))
        logger.info(
            "KV cache: %d blocks of %d tokens (%.2f GiB, %d tokens)",
            num_blocks,
            self.block_size,
            num_blocks * per_block / 2**30,
            num_blocks * self.block_size,
        )
        return num_blocks

    @torch.inference_mode()
    def dummy_run(self, num_tokens: int, num_reqs: int) -> None:
        """A forward of `num_tokens` prompt tokens over min(num_reqs, num_tokens) fresh requests, then logits and a
        top-k/top-p draw for one row per request: the largest step the scheduler can form, for memory profiling.
        Nothing is written to or read from the real KV cache (slots are -1, every block id is 0 of a one-block
        dummy cache)."""
        inputs = dummy_attention_inputs(num_tokens, num_reqs, self.block_size)
        num_layers = self.model_config.arch.num_hidden_layers
        dummy_cache = allocate_kv_cache(self.attn_backend, 1, self.block_size, num_layers, self.dtype, self.device)
        qsl = inputs.query_start_loc
        positions = np.arange(num_tokens) - np.repeat(qsl[:-1], np.diff(qsl))
        hidden = self.model(
            self._to_device(np.zeros(num_tokens, dtype=np.int64)),
            self._to_device(positions),
            dummy_cache,
            self.attn_backend.build_metadata(inputs),
        )
        logits = self.model.compute_logits(hidden[self._to_device(qsl[1:] - 1)])
        self.sampler(logits, dummy_sampling_metadata(len(qsl) - 1, self.device, self.generator))

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.kv_caches = allocate_kv_cache(
            self.attn_backend,
            num_blocks,
            self.block_size,
            self.model_config.arch.num_hidden_layers,
            self.dtype,
            self.device,
        )
        mirror_pools = []
        if isinstance(self.proposer, ModelProposer):
            self.proposer.allocate_kv_cache(num_blocks)
            mirror_pools.append(self.proposer.kv_caches)
        self.kv_transfer = KVTransfer(
            self.kv_caches, self.kv_connector_info, self.num_swap_blocks, self._kv_transfer_config, mirror_pools
        )
        if self.cache_config.kv_prefault != "off":
            self.prefault_kv_cache(background=self.cache_config.kv_prefault == "background")
        if (
            self.on_gpu
            and not self.model_config.enforce_eager
            and getattr(self.attn_backend, "supports_decode_graphs", False)
        ):
            self.graphs = self.build_decode_graphs(capture=True)
            self.graphs.capture()

    def build_decode_graphs(self, capture: bool) -> DecodeGraphRunner:
        """The decode-graph runner over this runner's model and KV cache (`capture=False`: the same padded,
        buffer-fed steps run eagerly; tests use it on the CPU)."""
        return DecodeGraphRunner(
            self.model,
            self.attn_backend,
            self.kv_caches,
            self.device,
            capture_sizes(self.scheduler_config.max_num_seqs),
            self.batch.block_table.shape[1],
            self.model_config.max_model_len,
            capture=capture,
        )

    def prefault_kv_cache(self, background: bool = False) -> None:
        """Fault the whole KV pool in now (benchmarks, before timing) or from a daemon thread (the server, which
        is idle at start-up). Safe while steps run: the pages' contents are not changed."""
        # The target's pool, then a model proposer's (its own mapping: prefault_kv_cache takes one at a time).
        pools = [self.kv_caches]
        if isinstance(self.proposer, ModelProposer):
            pools.append(self.proposer.kv_caches)

        def prefault_all(stop: threading.Event | None = None) -> None:
            for pool in pools:
                prefault_kv_cache(pool, stop)

        if not background:
            prefault_all()
            return
        self._prefault_thread = threading.Thread(
            target=prefault_all, args=(self._prefault_stop,), name="kv-prefault", daemon=True
        )
        self._prefault_thread.start()

    def shutdown(self) -> None:
        """Stop the background KV prefault (it ends within one 64 MiB chunk) and wait for it. The owner calls this
        when it shuts down. Idempotent; steps may still run afterwards (untouched pages fault in on first use)."""
        self._prefault_stop.set()
        if self.kv_transfer is not None:
            self.kv_transfer.shutdown()
        if self._prefault_thread is not None:
            self._prefault_thread.join()
            self._prefault_thread = None

    # ------------------------------------------------------------------ one step

    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        timer = self.timer
        assert self.kv_transfer is not None, "initialize_kv_cache comes first"
        with timer.phase("prepare_inputs"):
            self._apply_scheduler_output(so)
            num_scheduled = so.num_scheduled_tokens
            failed_loads = self.kv_transfer.before_forward(so)
            if failed_loads:
                # Their KV is not all there: they sit this step out (the scheduler sends them again in full).
                for req_id in failed_loads:
                    self._forget(req_id)
                num_scheduled = {r: n for r, n in num_scheduled.items() if r not in failed_loads}
            if not num_scheduled:
                return ModelRunnerOutput([], [], kv_connector_output=self.kv_transfer.after_forward(so))
            step = self._prepare_inputs(so, num_scheduled)
        with timer.phase("forward"):
            hidden = self._forward(step)
        batch = self.batch
        batch.num_computed_tokens[step.rows] = step.seq_lens
        sampled_lists: list[list[int]] = [[] for _ in step.req_ids]
        logprobs_lists: list = [None] * len(step.req_ids)
        if len(step.sample_idx):
            with timer.phase("logits"):
                num_logits = step.num_drafts[step.sample_idx] + 1
                ends = step.query_start_loc[1:][step.sample_idx]
                # The last k + 1 query tokens of each sampling request: its drafts' positions and the bonus.
                logits_idx = np.repeat(ends - num_logits, num_logits) + _ragged_arange(num_logits)
                logits = self.model.compute_logits(hidden[self._to_device(logits_idx)])
            with timer.phase("sample"):
                if so.grammar_bitmask is not None:
                    self._apply_grammar(so, step, num_logits, logits)
                self._sample(step, logits, num_logits, sampled_lists, logprobs_lists)
        spec_token_ids = None
        if self.proposer is not None:
            with timer.phase("propose"):
                spec_token_ids = self._propose(step, hidden, so.spec_draft_limits)
        # After the proposer: its mirror pass writes the draft's KV of this step's positions, which a connector
        # saves with the target's.
        kv_connector_output = self.kv_transfer.after_forward(so)
        has_logprobs = any(x is not None for x in logprobs_lists)
        return ModelRunnerOutput(
            step.req_ids, sampled_lists, logprobs_lists if has_logprobs else None, spec_token_ids, kv_connector_output
        )

    @torch.inference_mode()
    def execute_model_async(self, so: SchedulerOutput) -> ModelRunnerOutput | None:
        """Launch `so`'s step; return the output of the step launched before it (None if there was none). An
        empty `so` launches nothing and only returns that output. Without speculative decoding or a KV
        connector (the engine's options refuse them together)."""
        timer = self.timer
        assert self.kv_transfer is not None, "initialize_kv_cache comes first"
        assert self.proposer is None and self.kv_transfer.connector is None
        assert so.grammar_bitmask is None, "structured outputs are refused with async scheduling"
        with timer.phase("prepare_inputs"):
            self._apply_scheduler_output(so)
            self.kv_transfer.before_forward(so)  # swaps only: no connector, so no failed loads
            if so.is_empty:
                return self._finish_in_flight()
            step = self._prepare_inputs(so, so.num_scheduled_tokens)
            fill = self._in_flight_inputs(step)
        with timer.phase("forward"):
            hidden = self._forward(step, fill)
        self.batch.num_computed_tokens[step.rows] = step.seq_lens
        logits = None
        if len(step.sample_idx):
            with timer.phase("logits"):
                last = step.query_start_loc[1:][step.sample_idx] - 1
                logits = self.model.compute_logits(hidden[self._to_device(last)])
        with timer.phase("sample"):
            # Before this step's sampling inputs: the previous step's tokens count in its penalties and seeds.
            previous = self._finish_in_flight()
            self._in_flight = self._launch_sample(step, logits)
        return previous

    def _in_flight_inputs(self, step: _StepInputs) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(token indices, token ids on the device) for the step's inputs that the step in flight is sampling."""
        in_flight = self._in_flight
        if in_flight is None or in_flight.sampled is None:
            return None
        batch = self.batch
        src = batch.pending[step.token_rows]
        dst = np.flatnonzero((src >= 0) & (step.positions == batch.num_tokens[step.token_rows] - 1))
        if not len(dst):
            return None
        return self._to_device(dst), in_flight.sampled[self._to_device(src[dst])]

    def _launch_sample(self, step: _StepInputs, logits: torch.Tensor | None) -> _InFlight:
        """Queue the step's sampling and the copy of its tokens to the host; the tokens count in the rows now
        (num_tokens), their values arrive in _finish_in_flight."""
        batch = self.batch
        states = [step.states[i] for i in step.sample_idx]
        rows = step.rows[step.sample_idx]
        positions = batch.num_tokens[rows].copy()
        if logits is None:
            return _InFlight(step.req_ids, step.sample_idx, states, positions, None, None, None, None)
        metadata = build_sampling_metadata(states, batch, self.vocab_size, self.generator, device=self.device)
        out = self.sampler(logits, metadata)
        sampled, host, ready = out.sampled_token_ids, out.sampled_token_ids, None
        if self.on_gpu:
            host = torch.empty(sampled.shape, dtype=sampled.dtype, pin_memory=True)
            host.copy_(sampled, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record()
        batch.num_tokens[rows] += 1
        batch.pending[rows] = np.arange(len(rows))
        return _InFlight(step.req_ids, step.sample_idx, states, positions, sampled, host, ready, out)

    def _finish_in_flight(self) -> ModelRunnerOutput | None:
        """Wait for the launched step's tokens, write them into the rows still held by the same requests, and
        return its output."""
        in_flight, self._in_flight = self._in_flight, None
        if in_flight is None:
            return None
        sampled_lists: list[list[int]] = [[] for _ in in_flight.req_ids]
        logprobs_lists: list = [None] * len(in_flight.req_ids)
        if in_flight.host is not None:
            if in_flight.ready is not None:
                in_flight.ready.synchronize()
            tokens = in_flight.host.numpy().tolist()
            batch = self.batch
            for j, i in enumerate(in_flight.sample_idx.tolist()):
                state = in_flight.states[j]
                # A request finished or preempted since has left its row (maybe to another request).
                if batch.states.get(state.req_id) is state:
                    batch.token_ids[state.row, in_flight.positions[j]] = tokens[j]
                    batch.pending[state.row] = -1
                sampled_lists[i] = [tokens[j]]
            out = in_flight.out
            if out is not None and out.logprobs is not None:
                ones = np.ones(len(in_flight.states), dtype=np.int64)
                self._collect_logprobs(out, in_flight.sample_idx, in_flight.states, ones, ones, logprobs_lists)
        has_logprobs = any(x is not None for x in logprobs_lists)
        return ModelRunnerOutput(in_flight.req_ids, sampled_lists, logprobs_lists if has_logprobs else None)

    def _forward(self, step: _StepInputs, fill: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """The step's hidden states; `fill` = (token indices, ids on the device) overrides input ids."""
        if step.graph_size is not None:
            assert self.graphs is not None
            return self.graphs.run(step.input_ids, step.positions, step.attn_inputs, step.graph_size, fill)
        ids, positions = self._to_device(step.input_ids), self._to_device(step.positions)
        if fill is not None:
            ids[fill[0]] = fill[1]
        return self.model(ids, positions, self.kv_caches, step.attn_metadata)

    def _apply_grammar(self, so: SchedulerOutput, step: _StepInputs, num_logits: np.ndarray, logits) -> None:
        """Mask each constrained request's logits rows: one per draft it verifies and the last, each by its own
        bitmask row (the scheduler's order, 1 + drafts rows per request)."""
        last_row = np.cumsum(num_logits) - 1
        position = {step.req_ids[i]: j for j, i in enumerate(step.sample_idx.tolist())}
        rows, used, mask_row = [], [], 0
        for req_id in so.structured_output_request_ids:
            n = 1 + len(so.scheduled_spec_decode_tokens.get(req_id, ()))
            j = position.get(req_id)
            if j is not None:  # absent: it sat this step out (a failed KV load)
                assert int(num_logits[j]) == n
                rows += range(int(last_row[j]) - n + 1, int(last_row[j]) + 1)
                used += range(mask_row, mask_row + n)
            mask_row += n
        assert so.grammar_bitmask is not None
        apply_grammar_bitmask(logits, rows, used, so.grammar_bitmask, so.grammar_bitmask_words)

    def _sample(
        self, step: _StepInputs, logits: torch.Tensor, num_logits: np.ndarray, sampled_lists: list, logprobs_lists: list
    ) -> None:
        """Sample (or verify drafts), append the tokens to the batch rows, fill the per-request result lists."""
        batch = self.batch
        sample_states = [step.states[i] for i in step.sample_idx]
        sample_rows = step.rows[step.sample_idx]
        if int(num_logits.max()) == 1:
            metadata = build_sampling_metadata(
                sample_states, batch, self.vocab_size, self.generator, device=self.device
            )
            out = self.sampler(logits, metadata)
            tokens = out.sampled_token_ids.cpu().numpy()[:, None]  # [S, 1]
            num_out = np.ones(len(sample_rows), dtype=np.int64)
        else:
            # One sampling row per scored position; position j of a request sees its drafts before j as output.
            offsets = _ragged_arange(num_logits)
            row_states = [sample_states[i] for i in np.repeat(np.arange(len(sample_states)), num_logits)]
            metadata = build_sampling_metadata(
                row_states, batch, self.vocab_size, self.generator, offsets, device=self.device
            )
            num_drafts = num_logits - 1
            draft_ids = _draft_matrix(batch, sample_rows, num_drafts)
            draft_probs = None
            if isinstance(self.proposer, ModelProposer):
                draft_probs = self.proposer.draft_probs([s.req_id for s in sample_states], draft_ids, num_drafts)
            result = self.rejection_sampler(
                logits, metadata, DraftInputs(self._to_device(draft_ids), self._to_device(num_drafts), draft_probs)
            )
            out = result.row_output
            tokens = result.output_token_ids.cpu().numpy()
            num_out = result.num_output_tokens.cpu().numpy()
            # Only accepted positions' KV stays valid.
            batch.num_computed_tokens[sample_rows] -= num_drafts - (num_out - 1)
        starts = batch.num_tokens[sample_rows]
        for j, i in enumerate(step.sample_idx.tolist()):
            n = int(num_out[j])
            emitted = tokens[j, :n]
            batch.token_ids[sample_rows[j], starts[j] : starts[j] + n] = emitted
            sampled_lists[i] = emitted.tolist()
        batch.num_tokens[sample_rows] += num_out
        if out.logprobs is not None:
            self._collect_logprobs(out, step.sample_idx, sample_states, num_logits, num_out, logprobs_lists)

    def _propose(self, step: _StepInputs, hidden: torch.Tensor, limits: dict[str, int]) -> list[list[int]]:
        assert self.proposer is not None
        drafts: list[list[int]] = [[] for _ in step.req_ids]
        if isinstance(self.proposer, ModelProposer):
            assert self.spec_policy is not None
            # Runs even when no request samples: its KV must cover every position the target computed. The
            # draft steps are skipped when the scheduler's rule will verify no drafts at this batch size.
            drafting = self.spec_policy.draft_token_budget(len(step.sample_idx)) > 0
            drafted_idx = step.sample_idx if drafting else step.sample_idx[:0]
            k = self.proposer.k
            max_drafts = np.array([limits.get(step.req_ids[i], k) for i in drafted_idx.tolist()], dtype=np.int64)
            proposal = self.proposer.propose(
                DraftStepInputs(
                    self.batch,
                    step.states,
                    step.rows,
                    step.input_ids,
                    step.positions,
                    step.query_start_loc,
                    step.attn_inputs,
                    step.attn_metadata,
                    hidden,
                    drafted_idx,
                    max_drafts,
                )
            )
            for i, d in zip(drafted_idx.tolist(), proposal.drafts, strict=True):
                drafts[i] = d
        elif len(step.sample_idx):
            rows = step.rows[step.sample_idx]
            proposed = self.proposer.propose(self.batch.token_ids, self.batch.num_tokens, rows)
            for i, d in zip(step.sample_idx.tolist(), proposed, strict=True):
                drafts[i] = d
        return drafts

    def _forget(self, req_id: str) -> None:
        self.batch.remove(req_id)
        if isinstance(self.proposer, ModelProposer):
            self.proposer.forget(req_id)

    def _apply_scheduler_output(self, so: SchedulerOutput) -> None:
        batch = self.batch
        for req_id in so.finished_req_ids:
            self._forget(req_id)
        for new in so.scheduled_new_reqs:
            batch.add(new)
        for cached in so.scheduled_cached_reqs:
            batch.update(cached)
        for req_id, draft_ids in so.scheduled_spec_decode_tokens.items():
            # Drafts sit after the known tokens (num_tokens is unchanged) and are overwritten by the step's result.
            row = batch.states[req_id].row
            start = batch.num_tokens[row]
            batch.token_ids[row, start : start + len(draft_ids)] = draft_ids

    def _prepare_inputs(self, so: SchedulerOutput, num_scheduled: dict[str, int]) -> _StepInputs:
        """Token ids, positions, slot mapping and attention metadata for the step's `num_scheduled` (req_id ->
        tokens), by numpy indexing."""
        batch = self.batch
        # Single-token queries (decodes) first: the attention backend batches them.
        req_ids = sorted(num_scheduled, key=lambda r: num_scheduled[r] > 1)
        states = [batch.states[r] for r in req_ids]
        rows = np.fromiter((s.row for s in states), dtype=np.int64, count=len(states))
        q_lens = np.fromiter((num_scheduled[r] for r in req_ids), dtype=np.int64, count=len(states))

        start_pos = batch.num_computed_tokens[rows]
        query_start_loc = np.zeros(len(rows) + 1, dtype=np.int64)
        np.cumsum(q_lens, out=query_start_loc[1:])
        num_tokens = int(query_start_loc[-1])
        token_req = np.repeat(np.arange(len(rows)), q_lens)  # request index of each token
        positions = start_pos[token_req] + np.arange(num_tokens) - query_start_loc[token_req]
        token_rows = rows[token_req]
        block_ids = batch.block_table[token_rows, positions // self.block_size].astype(np.int64)
        seq_lens = start_pos + q_lens
        num_drafts = np.fromiter(
            (len(so.scheduled_spec_decode_tokens.get(r, ())) for r in req_ids), dtype=np.int64, count=len(req_ids)
        )
        attn_inputs = AttentionInputs(
            num_decodes=int(np.count_nonzero(q_lens == 1)),
            query_start_loc=query_start_loc,
            seq_lens=seq_lens,
            block_table=batch.block_table[rows],
            slot_mapping=block_ids * self.block_size + positions % self.block_size,
            block_size=self.block_size,
        )
        graph_size = self.graphs.padded_size(attn_inputs) if self.graphs is not None else None
        attn_metadata = self.attn_backend.build_metadata(attn_inputs) if graph_size is None else None
        return _StepInputs(
            req_ids=req_ids,
            states=states,
            rows=rows,
            input_ids=batch.token_ids[token_rows, positions],
            positions=positions,
            query_start_loc=query_start_loc,
            seq_lens=seq_lens,
            # Only requests whose known tokens are now all computed produce a token (not mid-prompt chunks).
            sample_idx=np.flatnonzero(seq_lens >= batch.num_tokens[rows] + num_drafts),
            num_drafts=num_drafts,
            attn_inputs=attn_inputs,
            attn_metadata=attn_metadata,
            graph_size=graph_size,
            token_rows=token_rows,
        )

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        """A numpy array as a tensor on the model's device (on the CPU, the same memory)."""
        t = torch.from_numpy(array)
        return t if not self.on_gpu else t.to(self.device, non_blocking=True)

    @staticmethod
    def _collect_logprobs(
        out: SamplerOutput,
        sample_idx: np.ndarray,
        states: list[RequestState],
        num_logits: np.ndarray,
        num_out: np.ndarray,
        dest: list,
    ) -> None:
        """`out` has one row per scored position; request j's emitted tokens are its first num_out[j] rows."""
        assert out.logprobs is not None and out.logprob_token_ids is not None and out.sampled_ranks is not None
        ids = out.logprob_token_ids.tolist()
        lps = out.logprobs.tolist()
        ranks = out.sampled_ranks.tolist()
        first_row = np.cumsum(num_logits) - num_logits
        for j, (i, state) in enumerate(zip(sample_idx.tolist(), states, strict=True)):
            n = state.sampling_params.logprobs
            if n is None:
                continue
            r0 = int(first_row[j])
            dest[i] = [(ids[r][: n + 1], lps[r][: n + 1], ranks[r]) for r in range(r0, r0 + int(num_out[j]))]


def _ragged_arange(counts: np.ndarray) -> np.ndarray:
    """[3, 1, 2] -> [0, 1, 2, 0, 0, 1]."""
    total = int(counts.sum())
    starts = np.repeat(np.cumsum(counts) - counts, counts)
    return np.arange(total) - starts


def _draft_matrix(batch: InputBatch, rows: np.ndarray, num_drafts: np.ndarray) -> np.ndarray:
    """[S, K] int64: each row's scheduled drafts (stored after its known tokens), zero-padded."""
    k = int(num_drafts.max())
    cols = batch.num_tokens[rows][:, None] + np.arange(k)[None, :]
    valid = np.arange(k)[None, :] < num_drafts[:, None]
    cols = np.where(valid, cols, 0)
    return np.where(valid, batch.token_ids[rows[:, None], cols], 0).astype(np.int64)

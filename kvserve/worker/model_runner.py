"""ModelRunner: SchedulerOutput -> model inputs -> forward -> sample -> ModelRunnerOutput.

Holds the model, the KV cache tensors and its own per-request state (InputBatch); never sees scheduler objects.

Devices: the CPU (numpy inputs used in place, no copies) or a GPU ("cuda"): inputs are built in numpy as on the CPU
and copied over once per step; the KV pool is sized by profiling (worker/gpu_memory.py) and decode-only steps
replay captured CUDA graphs (worker/cuda_graph.py) unless enforce_eager. Sampling runs where the logits are.

One execute path. A step is launched (inputs, forward pass, logits, and its sampling queued on the device) and
then finished (its tokens read on the host, written into the batch rows, drafts proposed, the KV connector's
report taken). Synchronous scheduling finishes each step before returning it. Async scheduling
(`scheduler_config.async_scheduling`) is the one difference: `execute_model(N+1)` launches N+1 with the tokens N
is still sampling taken from the device (InputBatch.pending), finishes N only after N+1's forward pass is queued,
and returns N's output; N+1's sampling inputs (penalties, seeds) are built after N's tokens are in the rows. On a
GPU the host thus prepares and launches N+1 while N runs; on the CPU every call is synchronous and only the order
changes.

Speculative decoding: a request scheduled with k draft tokens has them written after its known tokens in its
InputBatch row, so they are fed like any other token; the last k + 1 positions are scored and the rejection
sampler keeps the accepted drafts plus one token. The proposer (spec_decode/base.py) then drafts the next step's
tokens for every request that produced tokens; a model proposer also sees the step's layout and the target's
last hidden states, and hands its draft distributions q to the next verification.
"""

from __future__ import annotations

import logging
import os
import threading
import time

import numpy as np
import torch

from kvserve.attention import key_centering
from kvserve.attention.base import KVCache
from kvserve.attention.kv_dtype import kv_cache_torch_dtype
from kvserve.attention.selector import get_attn_backend
from kvserve.attention.spec import AttentionSpec
from kvserve.config import CacheConfig, KVTransferConfig, ModelConfig, SchedulerConfig, SpeculativeConfig
from kvserve.core.sched_output import SchedulerOutput
from kvserve.device_copy import to_device
from kvserve.distributed.parallel_state import get_tp_group
from kvserve.distributed.sharding import head_slice
from kvserve.kv_cache_spec import KVCacheSpec
from kvserve.layers.batch_invariant import resolve_deterministic
from kvserve.layers.linear import runs_on_amx
from kvserve.layers.quant.apply import model_weight_bytes
from kvserve.loader.model_loader import load_model
from kvserve.outputs import ModelRunnerOutput, SpecStepTiming
from kvserve.platform import startup_summary
from kvserve.profiling import StepTimer
from kvserve.sample.bitmask import apply_grammar_bitmask
from kvserve.sample.rejection_sampler import DraftInputs, RejectionSampler
from kvserve.sample.sampler import Sampler
from kvserve.spec_decode.base import DraftProposal, DraftStepInputs, Proposer
from kvserve.spec_decode.build import build_proposer
from kvserve.utils import cdiv
from kvserve.worker.cuda_graph import DecodeGraphRunner, capture_sizes
from kvserve.worker.gpu_memory import (
    MemorySnapshot,
    dummy_attention_inputs,
    dummy_sampling_metadata,
    num_blocks_from_profile,
    profile_run,
)
from kvserve.worker.input_batch import InputBatch
from kvserve.worker.kv_cache import allocate_kv_cache, bytes_per_block, num_blocks_for, prefault_kv_cache
from kvserve.worker.kv_io import KVIO
from kvserve.worker.launched_step import LaunchedStep, write_tokens
from kvserve.worker.sampling_inputs import build_sampling_metadata
from kvserve.worker.step_inputs import StepInputs, draft_matrix, prepare_step_inputs, ragged_arange
from kvserve.worker.tree_step import apply_tree_layout, draw_tree_targets, walk_trees, with_tree_keys

logger = logging.getLogger(__name__)


class ModelRunner:
    def __init__(
        self,
        model_config: ModelConfig,
        cache_config: CacheConfig,
        scheduler_config: SchedulerConfig,
        timer: StepTimer | None = None,
        spec_config: SpeculativeConfig | None = None,
        kv_transfer_config: KVTransferConfig | None = None,
    ) -> None:
        """Loads the model (and a proposer). The owner then sizes the pool (`determine_num_kv_blocks`, e.g. the
        minimum over tensor-parallel ranks) and calls `initialize_kv_cache`."""
        self.timer = timer or StepTimer()
        self.model_config = model_config
        self.cache_config = cache_config
        self.scheduler_config = scheduler_config
        self.async_scheduling = scheduler_config.async_scheduling
        self.block_size = cache_config.block_size
        self.dtype = getattr(torch, model_config.dtype)
        # What the KV cache holds: the model's dtype, or fp8 (CacheConfig.cache_dtype).
        self.kv_dtype = kv_cache_torch_dtype(cache_config.cache_dtype, self.dtype)
        self.device, self._memory_baseline = _claim_device(model_config.device)
        self.on_gpu = self.device.type == "cuda"
        self.tp = get_tp_group()
        self._load_model()
        self.vocab_size = model_config.arch.vocab_size
        self.sampler = Sampler(self.device)
        self.rejection_sampler = RejectionSampler(self.sampler)
        # NOTE: on the CPU whatever the device: it draws only the [B] noise keys of unseeded rows, so a seed gives
        # the same draws on any device.
        self.generator = torch.Generator().manual_seed(model_config.seed)
        self.batch = InputBatch(
            scheduler_config.max_num_seqs,
            model_config.max_model_len,
            cdiv(model_config.max_model_len, self.block_size),
        )
        # Built before the pool is sized: a draft model's weights then count in a GPU memory profile, and its own
        # KV pool (the target's block count, allocated with the target's) in the bytes each block costs.
        self.proposer: Proposer | None = None
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
        # Draft trees: each request's proposed tree's parents, until the step that verifies it (tree_step.py).
        self._tree_parents: dict[str, np.ndarray] = {}
        self._kv_transfer_config = kv_transfer_config
        self.kv_io: KVIO | None = None  # with the KV cache (initialize_kv_cache)
        self.num_blocks = 0
        self.kv_caches: list[KVCache] = []
        self.graphs: DecodeGraphRunner | None = None  # with the KV cache, on a GPU
        self._in_flight: LaunchedStep | None = None  # async scheduling: the last launched step
        self._prefault_stop = threading.Event()
        self._prefault_thread: threading.Thread | None = None

    def _load_model(self) -> None:
        """This rank's attention backend (it sees only this rank's heads) and the model on it; one start-up line."""
        config, arch = self.model_config, self.model_config.arch
        heads = head_slice(arch.num_attention_heads, arch.num_key_value_heads, self.tp.world_size, self.tp.rank)
        self.attn_backend = get_attn_backend(
            heads.num_heads,
            heads.num_kv_heads,
            arch.head_dim,
            self.dtype,
            self.device,
            config.attention_backend,
            config.deterministic,
            self.kv_dtype,
        )
        start = time.perf_counter()
        self.gemv_choices: dict = {}  # (N, K, dtype, bias[, "silu"]) -> the batch-1 GEMVs chosen, their timings
        self.model = load_model(config, self.attn_backend)
        logger.info("loaded %s in %.1fs", config.model, time.perf_counter() - start)
        # fp8 caches store each layer's keys minus their mean (attention/key_centering.py); the layout id says so.
        self.key_centering_tag: str | None = None
        if key_centering.key_centering_enabled(self.kv_dtype):
            ids = key_centering.calibration_ids(config.arch.vocab_size, config.max_model_len)
            key_centering.set_key_offsets(self.model, key_centering.calibrate_key_offsets(self.model, ids, self.dtype))
            self.key_centering_tag = key_centering.layout_tag(ids)
        half = self.dtype in (torch.bfloat16, torch.float16)
        if self.on_gpu and half and os.environ.get("KVSERVE_TRITON_GEMV") != "0":
            # Batch-1 linears: a Triton GEMV where it measured faster than cuBLAS on this card (the decode graph
            # of batch 1 then captures it). KVSERVE_TRITON_GEMV=0 keeps cuBLAS everywhere (A/B runs).
            from kvserve.kernels.triton_gemv import assign_gemv

            self.gemv_choices = assign_gemv(self.model)
        # "on" or "off (why)"; raises if deterministic=True cannot hold here.
        self.deterministic = resolve_deterministic(config.deterministic, self.model, self.attn_backend, self.block_size)
        self.weight_bytes = model_weight_bytes(self.model)
        weights = f"{config.quantization or config.dtype} weights {self.weight_bytes / 2**20:.0f} MiB"
        if runs_on_amx(self.model):
            weights += ", AMX tiles"
        # Its own logger, which the CLI shows even without -v: what the platform chose is worth one line always.
        logging.getLogger("kvserve.startup").info(
            startup_summary(
                f"{config.dtype} ({weights})",
                torch.get_num_threads(),
                self.attn_backend.describe(self.block_size),
                config.device,
                self.deterministic,
            )
        )

    # ------------------------------------------------------------------ the KV cache

    def _target_block_bytes(self) -> int:
        arch = self.model_config.arch
        return bytes_per_block(self.attn_backend, self.block_size, arch.num_hidden_layers, self.kv_dtype)

    def kv_cache_spec(self) -> KVCacheSpec:
        """This rank's KV cache (kvserve/kv_cache_spec.py). The layout id names everything that decides what a
        block's bytes mean, and nothing rank-specific: ranks of one engine agree on it."""
        config, arch = self.model_config, self.model_config.arch
        layout = (
            f"{config.fingerprint or config.path}|{config.dtype}|{config.quantization}"
            f"|{self.attn_backend.kv_layout(self.block_size)}|kv_dtype={self.cache_config.cache_dtype}"
            f"{'|' + self.key_centering_tag if self.key_centering_tag else ''}"
            f"|kv_heads={arch.num_key_value_heads}|head_dim={arch.head_dim}|block={self.block_size}"
            f"|layers={arch.num_hidden_layers}|tp={self.tp.world_size}"
            # Blocks computed by a path that is not batch-invariant would break a deterministic reader's promise.
            f"|deterministic={self.deterministic == 'on'}"
        )
        draft = self.proposer.layout_id() if self.proposer is not None else None
        if draft is not None:
            layout += f"|draft={draft}"
        kv_dtype = str(self.kv_dtype).removeprefix("torch.")
        layers = tuple(
            AttentionSpec(kv_dtype, arch.sliding_window(i), arch.alibi) for i in range(arch.num_hidden_layers)
        )
        block_bytes = self._target_block_bytes() + self._proposer_block_bytes()
        return KVCacheSpec(self.block_size, layers, (block_bytes,), layout)

    def determine_num_kv_blocks(self) -> int:
        """Blocks this rank's share of the KV budget holds (the budget is the engine's, split over the ranks). On a
        GPU without an explicit budget: what a profiling run leaves of gpu_memory_utilization."""
        arch = self.model_config.arch
        cache = self.cache_config
        if self.on_gpu and cache.num_kv_blocks is None and cache.kv_cache_memory is None:
            return self._profile_num_kv_blocks()
        return num_blocks_for(
            cache,
            self.attn_backend,
            arch.num_hidden_layers,
            self.kv_dtype,
            self.tp.world_size,
            self._proposer_block_bytes(),
        )

    def _proposer_block_bytes(self) -> int:
        return self.proposer.bytes_per_block() if self.proposer is not None else 0

    def _profile_num_kv_blocks(self) -> int:
        assert self._memory_baseline is not None
        sched = self.scheduler_config
        profile = profile_run(
            lambda: self.dummy_run(sched.max_num_batched_tokens, sched.max_num_seqs), self.device, self._memory_baseline
        )
        util = self.cache_config.gpu_memory_utilization
        per_block = self._target_block_bytes() + self._proposer_block_bytes()
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
        dummy_cache = allocate_kv_cache(self.attn_backend, 1, self.block_size, num_layers, self.kv_dtype, self.device)
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

    def initialize_kv_cache(self, num_blocks: int, num_swap_blocks: int = 0, spec: KVCacheSpec | None = None) -> None:
        """Allocate the pool (and a proposer's), the swap space and the KV connector's worker side. `spec`: the
        engine's merged spec (every rank's block bytes), which the connector sizes its stores by; this rank's own
        when None."""
        self.num_blocks = num_blocks
        self.kv_caches = allocate_kv_cache(
            self.attn_backend,
            num_blocks,
            self.block_size,
            self.model_config.arch.num_hidden_layers,
            self.kv_dtype,
            self.device,
        )
        if self.proposer is not None:
            self.proposer.allocate_kv_cache(num_blocks)
        mirror_pools = [self.proposer.kv_caches] if self.proposer is not None and self.proposer.kv_caches else []
        self.kv_io = KVIO(
            self.kv_caches,
            spec or self.kv_cache_spec(),
            self.tp.rank if spec is not None else 0,
            num_swap_blocks,
            self._kv_transfer_config,
            mirror_pools,
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

    def handshake_metadata(self) -> dict | None:
        """What this rank's KV connector publishes for the scheduler side (None: nothing)."""
        return self.kv_io.handshake_metadata() if self.kv_io is not None else None

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
        # The target's pool, then a proposer's (its own mapping: prefault_kv_cache takes one at a time).
        pools = [self.kv_caches]
        if self.proposer is not None and self.proposer.kv_caches:
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
        if self.kv_io is not None:
            self.kv_io.shutdown()
        if self._prefault_thread is not None:
            self._prefault_thread.join()
            self._prefault_thread = None

    # ------------------------------------------------------------------ one step

    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput | None:
        """Run `so`'s step and return its output; with async scheduling, launch it and return the output of the
        step launched before it (None when there was none). An empty `so` computes nothing: it still moves KV
        (swaps, connector loads and saves) and, async, returns the step in flight."""
        assert self.kv_io is not None, "initialize_kv_cache comes first"
        started = time.perf_counter()
        with self.timer.phase("prepare_inputs"):
            step = self._begin(so)
        if step is None:
            if self.async_scheduling:
                return self._finish(self._in_flight_take())
            return ModelRunnerOutput([], [], kv_connector_output=self.kv_io.after_forward(so))
        with self.timer.phase("forward"):
            hidden = self._forward(step, self._in_flight_inputs(step))
        self.batch.num_computed_tokens[step.rows] = step.seq_lens
        with self.timer.phase("logits"):
            logits, num_logits = self._logits(step, hidden)
            if so.grammar_bitmask is not None and logits is not None:
                # Before a tree's walk, which draws on its rows: every row in the scheduler's layout (1 + drafts).
                self._apply_grammar(so, step, num_logits, logits)
            if step.trees and logits is not None:
                # From here on the step is the chain of each tree's accepted path (worker/tree_step.py).
                targets, keys = draw_tree_targets(
                    step, logits, num_logits, self.batch, self.rejection_sampler, self.vocab_size, self.generator
                )
                logits, num_logits, step, hidden = walk_trees(
                    step, logits, num_logits, hidden, self.batch, self.kv_caches, self.attn_backend, targets, keys
                )
        # Async: the step in flight's tokens reach the rows before this step's sampling inputs are built from them.
        previous = self._finish(self._in_flight_take())
        with self.timer.phase("sample"):
            launched = self._launch_sample(so, step, hidden, logits, num_logits)
        launched.started = started
        if self.async_scheduling:
            self._in_flight = launched
            return previous
        return self._finish(launched)

    def _begin(self, so: SchedulerOutput) -> StepInputs | None:
        """Apply `so` to the batch and move its KV (swaps, connector loads); the step's inputs, or None when it
        computes nothing."""
        assert self.kv_io is not None
        self._apply_scheduler_output(so)
        num_scheduled = so.num_scheduled_tokens
        failed_loads = self.kv_io.before_forward(so)
        if failed_loads:
            # Their KV is not all there: they sit this step out (the scheduler sends them again in full).
            for req_id in failed_loads:
                self._forget(req_id)
            num_scheduled = {r: n for r, n in num_scheduled.items() if r not in failed_loads}
        if not num_scheduled:
            return None
        step = prepare_step_inputs(self.batch, so, num_scheduled, self.block_size, self.attn_backend, self.graphs)
        if self._tree_parents:
            step = apply_tree_layout(step, self._tree_parents, self.attn_backend)
        return step

    def _forward(self, step: StepInputs, fill: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """The step's hidden states; `fill` = (token indices, ids on the device) overrides input ids. A KV
        connector's per-layer calls run inside the layer loop when the step is eager, around a graph replay."""
        assert self.kv_io is not None
        if step.graph_size is not None:
            assert self.graphs is not None
            self.kv_io.wait_all_layers()
            hidden = self.graphs.run(step.input_ids, step.positions, step.attn_inputs, step.graph_size, fill)
            self.kv_io.save_all_layers()
            return hidden
        model_positions = step.positions if step.model_positions is None else step.model_positions
        ids, positions = self._to_device(step.input_ids), self._to_device(model_positions)
        if fill is not None:
            ids[fill[0]] = fill[1]
        return self.model(ids, positions, self.kv_caches, step.attn_metadata, self.kv_io.layer_hooks())

    def _logits(self, step: StepInputs, hidden: torch.Tensor) -> tuple[torch.Tensor | None, np.ndarray]:
        """Logits of the positions that are scored: the last k + 1 query tokens of each sampling request (its
        drafts' positions and the bonus); [sum(num_logits), V] with num_logits [S]."""
        num_logits = step.num_drafts[step.sample_idx] + 1
        if not len(step.sample_idx):
            return None, num_logits
        ends = step.query_start_loc[1:][step.sample_idx]
        logits_idx = np.repeat(ends - num_logits, num_logits) + ragged_arange(num_logits)
        return self.model.compute_logits(self._rows(hidden, logits_idx)), num_logits

    def _launch_sample(
        self,
        so: SchedulerOutput,
        step: StepInputs,
        hidden: torch.Tensor,
        logits: torch.Tensor | None,
        num_logits: np.ndarray,
    ) -> LaunchedStep:
        """Queue the step's sampling (or draft verification) and the copy of its tokens to the host. A plain
        sampling step's tokens count in their rows at once (num_tokens; their values arrive in _finish), so that
        the next step can be prepared before they are read."""
        batch = self.batch
        states = [step.states[i] for i in step.sample_idx]
        rows = step.rows[step.sample_idx]
        if logits is None:
            return LaunchedStep(so, step, hidden, states, num_logits, None, None, None, None, None, None)
        if int(num_logits.max()) == 1:
            metadata = build_sampling_metadata(states, batch, self.vocab_size, self.generator, device=self.device)
            out = self.sampler(logits, metadata)
            tokens, num_out = out.sampled_token_ids, None
            positions = batch.num_tokens[rows].copy()
            batch.num_tokens[rows] += 1
            batch.pending[rows] = np.arange(len(rows))
        else:
            # One sampling row per scored position; position j of a request sees its drafts before j as output.
            offsets = ragged_arange(num_logits)
            row_states = [states[i] for i in np.repeat(np.arange(len(states)), num_logits)]
            metadata = build_sampling_metadata(
                row_states, batch, self.vocab_size, self.generator, offsets, device=self.device
            )
            if step.tree_keys is not None:
                metadata = with_tree_keys(metadata, len(row_states), step.tree_keys)
            num_drafts = num_logits - 1
            draft_ids = draft_matrix(batch, rows, num_drafts)
            draft_probs = None
            if self.proposer is not None:
                draft_probs = self.proposer.draft_probs([s.req_id for s in states], draft_ids, num_drafts)
            result = self.rejection_sampler(
                logits, metadata, DraftInputs(self._to_device(draft_ids), self._to_device(num_drafts), draft_probs)
            )
            out, tokens, num_out, positions = result.row_output, result.output_token_ids, result.num_output_tokens, None
        host, ready = tokens, None
        if self.on_gpu:
            host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            host.copy_(tokens, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record()
        return LaunchedStep(so, step, hidden, states, num_logits, positions, tokens, num_out, host, ready, out)

    def _in_flight_take(self) -> LaunchedStep | None:
        launched, self._in_flight = self._in_flight, None
        return launched

    def _finish(self, launched: LaunchedStep | None) -> ModelRunnerOutput | None:
        """Wait for a launched step's tokens, write them into the rows still held by the same requests, let the
        proposer draft, take the KV connector's report, and return the step's output."""
        if launched is None:
            return None
        assert self.kv_io is not None
        step = launched.step
        sampled_lists: list[list[int]] = [[] for _ in step.req_ids]
        logprobs_lists: list = [None] * len(step.req_ids)
        if launched.host is not None:
            with self.timer.phase("sample"):
                write_tokens(launched, self.batch, sampled_lists, logprobs_lists)
        spec_token_ids, spec_timing = None, None
        if self.proposer is not None:
            # NOTE: the policy's cost model wants this step's own seconds; on a GPU the tokens are on the host
            # by now, so the wall time covers the device's work too (spec decoding runs synchronous steps only).
            step_seconds = time.perf_counter() - launched.started
            started = time.perf_counter()
            with self.timer.phase("propose"):
                so = launched.so
                spec_token_ids, proposal = self._propose(
                    step, launched.hidden, so.spec_draft_limits, so.spec_tree_depths
                )
            propose_seconds = time.perf_counter() - started
            spec_timing = SpecStepTiming(step_seconds)
            if proposal is not None:
                spec_timing.pass_seconds = max(0.0, propose_seconds - proposal.draft_seconds)
                spec_timing.num_pass_requests = proposal.num_pass_requests
                spec_timing.draft_seconds = proposal.draft_seconds
                spec_timing.num_draft_tokens = proposal.num_draft_tokens
        # After the proposer: its mirror pass writes the draft's KV of this step's positions, which a connector
        # saves with the target's.
        kv_connector_output = self.kv_io.after_forward(launched.so)
        has_logprobs = any(x is not None for x in logprobs_lists)
        spec_parents = None
        if spec_token_ids is not None and self._tree_parents:
            trees = self._tree_parents
            spec_parents = [
                trees[r].tolist() if d and r in trees else None
                for r, d in zip(step.req_ids, spec_token_ids, strict=True)
            ]
        return ModelRunnerOutput(
            step.req_ids,
            sampled_lists,
            logprobs_lists if has_logprobs else None,
            spec_token_ids,
            kv_connector_output,
            spec_timing,
            spec_parents,
        )

    def _in_flight_inputs(self, step: StepInputs) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(token indices, token ids on the device) for the step's inputs that the step in flight is sampling."""
        in_flight = self._in_flight
        if in_flight is None or in_flight.tokens is None or in_flight.positions is None:
            return None
        batch = self.batch
        src = batch.pending[step.token_rows]
        dst = np.flatnonzero((src >= 0) & (step.positions == batch.num_tokens[step.token_rows] - 1))
        if not len(dst):
            return None
        return self._to_device(dst), in_flight.tokens[self._to_device(src[dst])]

    def _apply_grammar(self, so: SchedulerOutput, step: StepInputs, num_logits: np.ndarray, logits) -> None:
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

    def _propose(
        self, step: StepInputs, hidden: torch.Tensor, limits: dict[str, int], depths: dict[str, int]
    ) -> tuple[list[list[int]], DraftProposal | None]:
        """Drafts for the step's sampling requests, each at most its limit (absent: K), a tree at most its depth
        (absent: tree_depth); a request at 0 is left out of the proposer (a model proposer still sees it, to catch
        up later). Also the proposal (its costs)."""
        proposer = self.proposer
        assert proposer is not None
        drafts: list[list[int]] = [[] for _ in step.req_ids]
        k = proposer.k
        drafted_idx = step.sample_idx
        # Nobody given drafts is the usual step where they do not pay: it builds as few arrays as can be.
        asleep = all(limits.get(req_id, k) == 0 for req_id in step.req_ids)
        if asleep:
            awake = np.zeros(len(step.req_ids), dtype=bool)
        else:
            awake = np.array([limits.get(req_id, k) > 0 for req_id in step.req_ids], dtype=bool)
        if not proposer.runs_model:
            # The n-gram proposer keeps no state: it searches for the requests given drafts only.
            drafted_idx = drafted_idx[awake[drafted_idx]] if not asleep else drafted_idx[:0]
            if not len(drafted_idx):
                return drafts, None
        if asleep:
            max_drafts = np.zeros(len(drafted_idx), dtype=np.int64)
        else:
            max_drafts = np.array([limits.get(step.req_ids[i], k) for i in drafted_idx.tolist()], dtype=np.int64)
        proposal = proposer.propose(
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
                awake,
                None if not depths else np.array([depths.get(step.req_ids[i], 0) for i in drafted_idx.tolist()]),
            )
        )
        for i, d in zip(drafted_idx.tolist(), proposal.drafts, strict=True):
            drafts[i] = d
        if proposal.parents is not None:
            for i, p in zip(drafted_idx.tolist(), proposal.parents, strict=True):
                if p:
                    self._tree_parents[step.req_ids[i]] = np.array(p, dtype=np.int64)
                else:
                    self._tree_parents.pop(step.req_ids[i], None)
        return drafts, proposal

    def _forget(self, req_id: str) -> None:
        self.batch.remove(req_id)
        self._tree_parents.pop(req_id, None)
        if self.proposer is not None:
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

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        """A numpy array as a tensor on the model's device (on the CPU, the same memory), without waiting for the
        device (staged through pinned memory: device_copy.py)."""
        return to_device(array, self.device)

    def _rows(self, hidden: torch.Tensor, idx: np.ndarray) -> torch.Tensor:
        """hidden[idx]; a plain slice when idx is 0..n-1 (decode steps: no index copy, no gather)."""
        n = len(idx)
        if n and int(idx[-1]) == n - 1 and int(idx[0]) == 0 and bool((np.diff(idx) == 1).all()):
            return hidden[:n]
        return hidden[self._to_device(idx)]


def _claim_device(name: str) -> tuple[torch.device, MemorySnapshot | None]:
    """The runner's device, made current; on a GPU also the memory baseline taken before anything is loaded."""
    device = torch.device(name)
    if device.type != "cuda":
        return device, None
    if device.index is None:  # "cuda": the current GPU, named by index (set_device needs one)
        device = torch.device("cuda", torch.cuda.current_device())
    torch.cuda.set_device(device)
    return device, MemorySnapshot.take(device)

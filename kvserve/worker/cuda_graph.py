"""CUDA graphs for decode batches: the model's forward captured once per padded batch size, replayed for every
decode-only step (each request one query token) whose batch fits the ladder. Prefill, mixed and speculative steps
run eagerly.

A replay reads persistent buffers only: token ids and positions here, the attention metadata in the backend's
DecodeGraphBuffers. A step of n requests runs the graph of the smallest captured size >= n; rows n.. are padding
(no KV write, no keys: their outputs are ignored). Graphs are captured largest first and share one memory pool.

`capture=False` runs the same padded, buffer-fed forward eagerly: on the CPU (the Triton interpreter), tests
check with it everything a replay depends on except the capture itself.
"""

from __future__ import annotations

import bisect
import logging
import time

import numpy as np
import torch

from kvserve.attention.base import AttentionBackend, AttentionInputs, KVCache

logger = logging.getLogger(__name__)

# The largest batch captured (vLLM's default too): beyond it, launches are a small share of a step.
MAX_CAPTURE_SIZE = 512


def capture_sizes(max_num_seqs: int, largest: int = MAX_CAPTURE_SIZE) -> list[int]:
    """The ladder of padded batch sizes: 1, 2, 4, 8, then every multiple of 16, up to min(max_num_seqs, largest)
    (which is always on it, so that every batch the scheduler may form below that bound has a graph)."""
    cap = min(max_num_seqs, largest)
    ladder = [1, 2, 4, 8, *range(16, largest + 1, 16)]
    sizes = [s for s in ladder if s < cap]
    return [*sizes, cap] if cap >= 1 else []


def padded_size(num_reqs: int, sizes: list[int]) -> int | None:
    """The smallest captured size >= num_reqs, or None when the batch is larger than every graph."""
    i = bisect.bisect_left(sizes, num_reqs)
    return sizes[i] if i < len(sizes) else None


class DecodeGraphRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        backend: AttentionBackend,
        kv_caches: list[KVCache],
        device: torch.device,
        sizes: list[int],
        max_blocks_per_req: int,
        max_model_len: int,
        capture: bool = True,
    ) -> None:
        if not sizes:
            raise ValueError("no batch sizes to capture")
        self.model = model
        self.backend = backend
        self.kv_caches = kv_caches
        self.device = device
        self.sizes = sizes
        self.max_model_len = max_model_len
        self.use_graphs = capture
        max_size = sizes[-1]
        block_size, num_kv_blocks = kv_caches[0][0].shape[1], kv_caches[0][0].shape[0]
        self.buffers = backend.alloc_decode_buffers(max_size, max_blocks_per_req, block_size, num_kv_blocks)
        # Token ids and positions: staged in (pinned) host memory, then one copy each.
        pin = device.type == "cuda"
        self.host_tokens = torch.zeros(2, max_size, dtype=torch.int64, pin_memory=pin)
        self.tokens = torch.zeros(2, max_size, dtype=torch.int64, device=device)  # [0]: ids, [1]: positions
        self.metadata = {n: backend.decode_graph_metadata(self.buffers, n, max_model_len) for n in sizes}
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        # Recorded after the last step's copies out of the pinned staging buffers. With async scheduling the host
        # prepares step N+1 while those copies may still wait in the stream behind step N's work.
        self._staged: torch.cuda.Event | None = None

    def padded_size(self, inputs: AttentionInputs) -> int | None:
        """The graph size for this step, or None when it must run eagerly (not decode-only, or too large)."""
        num_reqs = len(inputs.seq_lens)
        if inputs.num_decodes != num_reqs:
            return None
        return padded_size(num_reqs, self.sizes)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every size, largest first (its pool then holds the smaller graphs' memory too). The buffers
        hold padding only (seq_len 0, slot -1) during capture: no KV is written or read."""
        if not self.use_graphs:
            return
        start = time.perf_counter()
        warmup = getattr(self.backend, "warmup", None)
        if warmup is not None:  # the eager steps' kernel variants too: compiled now, not while serving
            warmup(self.kv_caches[0])
        self._fill_padding()
        pool = None
        for n in reversed(self.sizes):
            ids, pos = self.tokens[0, :n], self.tokens[1, :n]
            for _ in range(2):  # compile the Triton kernels and settle the allocator outside the capture
                self.model(ids, pos, self.kv_caches, self.metadata[n])
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[n] = self.model(ids, pos, self.kv_caches, self.metadata[n])
            if pool is None:
                pool = graph.pool()
            self.graphs[n] = graph
        torch.cuda.synchronize(self.device)
        logger.info(
            "captured CUDA graphs for %d decode batch sizes (1..%d) in %.1fs",
            len(self.sizes),
            self.sizes[-1],
            time.perf_counter() - start,
        )

    def run(
        self,
        input_ids: np.ndarray,
        positions: np.ndarray,
        inputs: AttentionInputs,
        size: int,
        fill: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """The step's hidden states [n, hidden] (a view valid until the next run). `fill` = (indices, token ids
        on the device): input ids that the previous step is still producing (async scheduling)."""
        n = len(input_ids)
        if self._staged is not None:
            self._staged.synchronize()  # the staging buffers are free again
        host = self.host_tokens.numpy()
        host[0, :n] = input_ids
        host[1, :n] = positions
        # Padding rows keep whatever ids and positions they held: valid values whose outputs are ignored.
        for row in range(2):  # contiguous pieces, so that the copies from pinned memory stay asynchronous
            self.tokens[row, :n].copy_(self.host_tokens[row, :n], non_blocking=True)
        self.backend.fill_decode_buffers(self.buffers, inputs, size)
        if self.device.type == "cuda":
            self._staged = torch.cuda.Event()
            self._staged.record()
        if fill is not None:
            self.tokens[0][fill[0]] = fill[1]
        if self.use_graphs:
            self.graphs[size].replay()
            return self.outputs[size][:n]
        hidden = self.model(self.tokens[0, :size], self.tokens[1, :size], self.kv_caches, self.metadata[size])
        return hidden[:n]

    def _fill_padding(self) -> None:
        empty = AttentionInputs(
            num_decodes=0,
            query_start_loc=np.zeros(1, dtype=np.int64),
            seq_lens=np.zeros(0, dtype=np.int64),
            block_table=np.zeros((0, 1), dtype=np.int32),
            slot_mapping=np.zeros(0, dtype=np.int64),
            block_size=self.kv_caches[0][0].shape[1],
        )
        self.backend.fill_decode_buffers(self.buffers, empty, self.sizes[-1])

"""The Triton paged-attention backend: the GPU path (attention/triton_kernels.py), also runnable on the CPU in
Triton's interpreter for tests.

Per step, the host turns the runner's numpy description of the batch into a handful of int32 arrays (query
offsets, lengths, block table, slots, and the list of kernel programs), packs them into one buffer and copies it
to the device once. For CUDA graphs of decode batches the backend also keeps persistent buffers
(`DecodeGraphBuffers`): the captured kernels read them, and each replay only refills them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvserve.attention.base import AttentionBackend, AttentionInputs, KVCache
from kvserve.attention.triton_kernels import block_m_for, num_splits_for, paged_attention, write_kv
from kvserve.utils import cdiv

# Keys per inner-loop tile. A multiple or a fraction of the cache block size both work (each key finds its
# block through the table).
DEFAULT_TILE_N = 64


@dataclass
class TritonAttentionMetadata:
    query_start_loc: torch.Tensor  # [R + 1] int32
    seq_lens: torch.Tensor  # [R] int32, keys after this step
    block_table: torch.Tensor  # [R, W] int32
    slot_mapping: torch.Tensor  # [T] int32, -1 = do not write
    prog_req: torch.Tensor  # [P] int32, request of each kernel program
    prog_qstart: torch.Tensor  # [P] int32, the program's first query token within its request
    block_m: int  # rows per program (query tokens x GQA group)
    num_splits: int  # split-K factor (1: none)


@dataclass
class DecodeGraphBuffers:
    """Persistent inputs of captured decode graphs (one query token per request, at most `max_reqs` requests).

    Only `staging` (pinned host memory when the device is a GPU) is written per step, then its rows in use are
    copied into `packed`, of which seq_lens, slot_mapping and block_table are views; the other tensors never
    change.
    """

    max_reqs: int
    width: int  # block table columns (max_model_len / block_size)
    staging: torch.Tensor  # [max_reqs * (2 + width)] int32, host
    packed: torch.Tensor  # the same on the device
    seq_lens: torch.Tensor  # [max_reqs] int32 view of packed
    slot_mapping: torch.Tensor  # [max_reqs] int32 view of packed
    block_table: torch.Tensor  # [max_reqs, width] int32 view of packed
    query_start_loc: torch.Tensor  # [max_reqs + 1] int32: 0, 1, 2, ...
    prog_req: torch.Tensor  # [max_reqs] int32: 0, 1, 2, ...
    prog_qstart: torch.Tensor  # [max_reqs] int32: zeros


class TritonAttentionBackend(AttentionBackend):
    supports_decode_graphs = True

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        tile_n: int = DEFAULT_TILE_N,
        target_programs: int | None = None,
    ) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim)
        self.dtype = dtype
        self.device = torch.device(device)
        self.group = num_heads // num_kv_heads
        self.tile_n = tile_n
        if target_programs is None:
            # About two programs per multiprocessor before split-K stops paying; in the interpreter, a small
            # number so that tests take the split path.
            target_programs = 8
            if self.device.type == "cuda":
                target_programs = 2 * torch.cuda.get_device_properties(self.device).multi_processor_count
        self.target_programs = target_programs

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        return (num_blocks, block_size, self.num_kv_heads, self.head_dim)

    def describe(self, block_size: int) -> str:
        where = "" if self.device.type == "cuda" else " (interpreter)"
        return f"Triton paged attention{where}"

    # ------------------------------------------------------------------ eager steps

    def build_metadata(self, inputs: AttentionInputs) -> TritonAttentionMetadata:
        qsl, seq_lens = inputs.query_start_loc, inputs.seq_lens
        num_reqs = len(seq_lens)
        q_lens = np.diff(qsl)
        max_q = int(q_lens.max())
        block_m = block_m_for(self.group, max_q)
        block_q = block_m // self.group
        progs_per_req = -(-q_lens // block_q)
        prog_req = np.repeat(np.arange(num_reqs), progs_per_req)
        first_prog = np.cumsum(progs_per_req) - progs_per_req
        prog_qstart = (np.arange(len(prog_req)) - np.repeat(first_prog, progs_per_req)) * block_q
        max_len = int(seq_lens.max())
        width = cdiv(max_len, inputs.block_size)
        num_splits = 1
        if max_q <= block_q:  # one program per request (decodes): only then are the partial buffers small
            num_splits = num_splits_for(num_reqs * self.num_kv_heads, max_len, self.tile_n, self.target_programs)
        parts = [qsl, seq_lens, prog_req, prog_qstart, inputs.slot_mapping, inputs.block_table[:, :width].ravel()]
        host = np.concatenate([np.asarray(p, dtype=np.int32).ravel() for p in parts])
        # Not blocking: a blocking copy would first wait for the steps queued on the GPU (async scheduling
        # prepares a step while the one before runs). `host` is pageable and staged before the call returns.
        packed = torch.from_numpy(host).to(self.device, non_blocking=True)
        views, start = [], 0
        for p in parts:
            views.append(packed[start : start + p.size])
            start += p.size
        return TritonAttentionMetadata(
            query_start_loc=views[0],
            seq_lens=views[1],
            block_table=views[5].view(num_reqs, width),
            slot_mapping=views[4],
            prog_req=views[2],
            prog_qstart=views[3],
            block_m=block_m,
            num_splits=num_splits,
        )

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: KVCache,
        metadata: TritonAttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        key_cache, value_cache = kv_cache
        # Every write before any read (see AttentionBackend.forward). Reads are masked to each request's own
        # keys, so a reused block's stale contents (even NaN) are never loaded.
        write_kv(k, v, key_cache, value_cache, metadata.slot_mapping)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        paged_attention(
            q,
            key_cache,
            value_cache,
            out,
            metadata.block_table,
            metadata.seq_lens,
            metadata.query_start_loc,
            metadata.prog_req,
            metadata.prog_qstart,
            scale,
            metadata.block_m,
            self.tile_n,
            metadata.num_splits,
        )
        return out.view(q.shape[0], -1)

    # ------------------------------------------------------------------ captured decode graphs

    def alloc_decode_buffers(self, max_reqs: int, width: int) -> DecodeGraphBuffers:
        n = max_reqs * (2 + width)
        pin = self.device.type == "cuda"
        staging = torch.zeros(n, dtype=torch.int32, pin_memory=pin)
        packed = torch.zeros(n, dtype=torch.int32, device=self.device)
        steps = torch.arange(max_reqs + 1, dtype=torch.int32, device=self.device)
        return DecodeGraphBuffers(
            max_reqs=max_reqs,
            width=width,
            staging=staging,
            packed=packed,
            seq_lens=packed[:max_reqs],
            slot_mapping=packed[max_reqs : 2 * max_reqs],
            block_table=packed[2 * max_reqs :].view(max_reqs, width),
            query_start_loc=steps,
            prog_req=steps[:max_reqs],
            prog_qstart=torch.zeros(max_reqs, dtype=torch.int32, device=self.device),
        )

    def decode_graph_metadata(self, buffers: DecodeGraphBuffers, num_reqs: int, max_model_len: int):
        """Metadata over the first `num_reqs` rows of the buffers, fixed for every replay of that batch size: the
        launch shapes cannot depend on a step's lengths, so split-K is chosen for the longest allowed context
        (each program still computes its own segment from its request's length)."""
        return TritonAttentionMetadata(
            query_start_loc=buffers.query_start_loc[: num_reqs + 1],
            seq_lens=buffers.seq_lens[:num_reqs],
            block_table=buffers.block_table[:num_reqs],
            slot_mapping=buffers.slot_mapping[:num_reqs],
            prog_req=buffers.prog_req[:num_reqs],
            prog_qstart=buffers.prog_qstart[:num_reqs],
            block_m=block_m_for(self.group, 1),
            num_splits=num_splits_for(num_reqs * self.num_kv_heads, max_model_len, self.tile_n, self.target_programs),
        )

    def fill_decode_buffers(self, buffers: DecodeGraphBuffers, inputs: AttentionInputs, num_padded: int) -> None:
        """Write a decode-only step (every request one query token) into the buffers; rows from the step's
        requests up to `num_padded` become padding: no keys (seq_len 0, so their output is 0) and no KV write."""
        num_reqs = len(inputs.seq_lens)
        m, w = buffers.max_reqs, buffers.width
        host = buffers.staging.numpy()
        host[:num_reqs] = inputs.seq_lens
        host[num_reqs:num_padded] = 0
        host[m : m + num_reqs] = inputs.slot_mapping
        host[m + num_reqs : m + num_padded] = -1
        table = host[2 * m :].reshape(m, w)
        cols = min(w, inputs.block_table.shape[1])
        table[:num_reqs, :cols] = inputs.block_table[:, :cols]
        # Only the rows in use travel (the rows past num_padded are never read by this batch size's graph).
        for lo, hi in ((0, num_padded), (m, m + num_padded), (2 * m, 2 * m + num_padded * w)):
            buffers.packed[lo:hi].copy_(buffers.staging[lo:hi], non_blocking=True)

"""The Triton paged-attention backend: the GPU path (attention/triton_kernels.py, attention/triton_decode.py),
also runnable on the CPU in Triton's interpreter for tests.

Decode rows (one query token; the runner puts them first) go through the segment kernel of triton_decode.py,
whose result for a row does not depend on the batch; the other rows (prefill chunks, draft-carrying decodes)
through triton_kernels.paged_attention. A mixed step launches both.

Per step, the host turns the runner's numpy description of the batch into a handful of int32 arrays (query
offsets, lengths, block table, slots, the prefill kernel's programs, the decode rows' first partial slots), packs them
into one buffer, each part starting on a 16-byte boundary (Triton compiles a kernel variant per pointer
alignment: unaligned views would make new variants, each a compile stall, as batch shapes vary), and copies it to
the device once. For CUDA graphs of decode batches the backend also keeps persistent buffers
(`DecodeGraphBuffers`): the captured kernels read them, and each replay only refills them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import torch

from kvserve.attention.base import AttentionBackend, AttentionInputs, KVCache
from kvserve.attention.common import tree_hidden_keys
from kvserve.attention.triton_decode import DecodeConfig, decode_attention, first_segments, segments_per_program
from kvserve.attention.triton_kernels import block_m_for, num_splits_for, paged_attention, rotary_write_kv, write_kv
from kvserve.device_copy import to_device
from kvserve.utils import cdiv

# Keys per inner-loop tile. A multiple or a fraction of the cache block size both work (each key finds its
# block through the table).
DEFAULT_TILE_N = 64


# Int32 elements per 16 bytes: every part of a packed metadata buffer starts at a multiple of it.
_ALIGN = 4


@dataclass
class TritonAttentionMetadata:
    query_start_loc: torch.Tensor  # [R + 1] int32
    seq_lens: torch.Tensor  # [R] int32, keys after this step
    block_table: torch.Tensor  # [R, W] int32
    slot_mapping: torch.Tensor  # [T] int32, -1 = do not write
    prog_req: torch.Tensor  # [P] int32, request of each prefill-kernel program (none for decode rows)
    prog_qstart: torch.Tensor  # [P] int32, the program's first query token within its request
    block_m: int  # rows per prefill-kernel program (query tokens x GQA group)
    num_splits: int  # the prefill kernel's split-K factor (1: none)
    # The decode rows (the first num_decodes requests), for the segment kernel (triton_decode.py).
    num_decodes: int = 0
    first_seg: torch.Tensor | None = None  # [num_decodes] int32, each row's first partial slot
    num_slots: int = 0  # partial slots (>= the step's segments)
    max_segments: int = 0  # segments of the longest context the launch allows for
    segs_per_program: int = 1
    # Tree attention (draft trees): per query token, the keys among its last 64 it may not see
    # (common.tree_hidden_keys); read by the prefill kernel, which takes every multi-token request. None: no tree.
    hidden_keys: torch.Tensor | None = None  # [T] int64


@dataclass
class DecodeGraphBuffers:
    """Persistent inputs of captured decode graphs (one query token per request, at most `max_reqs` requests).

    Only `staging` (pinned host memory when the device is a GPU) is written per step, then its rows in use are
    copied into `packed`, of which seq_lens, slot_mapping and block_table are views; the other tensors never
    change.
    """

    max_reqs: int
    width: int  # block table columns (max_model_len / block_size)
    max_slots: int  # the most segments a decode step can have (partial slots)
    offsets: dict[str, int]  # where each part starts in `packed` (int32 elements, 16-byte aligned)
    staging: torch.Tensor  # [size] int32, host
    packed: torch.Tensor  # the same on the device
    seq_lens: torch.Tensor  # [max_reqs] int32 view of packed
    slot_mapping: torch.Tensor  # [max_reqs] int32 view of packed
    block_table: torch.Tensor  # [max_reqs, width] int32 view of packed
    first_seg: torch.Tensor  # [max_reqs] int32 view of packed
    query_start_loc: torch.Tensor  # [max_reqs + 1] int32: 0, 1, 2, ...
    prog_req: torch.Tensor  # [0] int32: no prefill-kernel programs
    prog_qstart: torch.Tensor  # [0] int32


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
        decode_config: DecodeConfig | None = None,
        kv_cache_dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim, kv_cache_dtype or dtype)
        self.dtype = dtype
        self.device = torch.device(device)
        self.group = num_heads // num_kv_heads
        self.tile_n = tile_n
        on_gpu = self.device.type == "cuda"
        num_sms = torch.cuda.get_device_properties(self.device).multi_processor_count if on_gpu else 4
        if target_programs is None:
            # About two programs per multiprocessor before split-K stops paying; in the interpreter, a small
            # number so that tests take the split path.
            target_programs = 2 * num_sms if on_gpu else 8
        self.target_programs = target_programs
        # The segment kernel for decode rows. In the interpreter, short segments, so that tests cross them.
        # On a GPU, KVSERVE_DECODE_SEGMENT / KVSERVE_DECODE_MERGE_SEGS override the defaults for A/B runs
        # (gpu_suite.py's roofline and throughput variants).
        gpu_config = DecodeConfig(
            segment=int(os.environ.get("KVSERVE_DECODE_SEGMENT", DecodeConfig.segment)),
            merge_segs=int(os.environ.get("KVSERVE_DECODE_MERGE_SEGS", DecodeConfig.merge_segs)),
        )
        self.decode_config = decode_config or (gpu_config if on_gpu else DecodeConfig(segment=32, tile_n=16))
        # Programs the segment kernel aims for before a program runs several segments: ~4 per SM.
        self.decode_target_programs = 4 * num_sms
        # False: decode rows go through the prefill kernel as before the segment kernel (benchmarks compare).
        self.segment_decode = True
        # The segment kernel's per-(request, KV head) counts, zero between launches; every layer's launch reuses
        # them (launches on one stream run one after the other). The decode graphs' buffers size them for their
        # largest batch before capture; a larger eager batch gets a larger tensor, and the captured graphs keep
        # the one they hold (`_arrived_kept`: never freed under them).
        self._arrived = torch.zeros(0, dtype=torch.int32, device=self.device)
        self._arrived_kept: list[torch.Tensor] = []
        # rotate_and_write on the GPU: rotary and the KV write in one launch (False: two, as before; A/B runs).
        self.fuse_rotary_write = os.environ.get("KVSERVE_FUSE_ROTARY_WRITE") != "0"

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        return (num_blocks, block_size, self.num_kv_heads, self.head_dim)

    def describe(self, block_size: int) -> str:
        where = "" if self.device.type == "cuda" else " (interpreter)"
        return f"Triton paged attention{where}"

    # ------------------------------------------------------------------ eager steps

    def build_metadata(self, inputs: AttentionInputs) -> TritonAttentionMetadata:
        qsl, seq_lens = inputs.query_start_loc, inputs.seq_lens
        num_reqs = len(seq_lens)
        num_decodes = inputs.num_decodes if self.segment_decode else 0
        hidden = tree_hidden_keys(inputs)
        if hidden is not None and hidden[: int(qsl[num_decodes])].any():
            num_decodes = 0  # a one-token "tree" that hides its own key: the segment kernel has no masks
        q_lens = np.diff(qsl)
        # The prefill kernel's programs: every request past the decode rows.
        rest = np.arange(num_decodes, num_reqs)
        max_q = int(q_lens[num_decodes:].max()) if len(rest) else 1
        block_m = block_m_for(self.group, max_q)
        block_q = block_m // self.group
        progs_per_req = -(-q_lens[num_decodes:] // block_q)
        prog_req = np.repeat(rest, progs_per_req)
        first_prog = np.cumsum(progs_per_req) - progs_per_req
        prog_qstart = (np.arange(len(prog_req)) - np.repeat(first_prog, progs_per_req)) * block_q
        max_len = int(seq_lens.max())
        width = cdiv(max_len, inputs.block_size)
        num_splits = 1
        # Split-K only without decode rows, when each request is one program (draft-carrying decodes, the case it
        # was made for): a mixed step never splits, so serving meets no split variant to compile mid-run.
        if len(rest) and num_decodes == 0 and max_q <= block_q:
            rest_len = int(seq_lens[num_decodes:].max())
            num_splits = num_splits_for(len(rest) * self.num_kv_heads, rest_len, self.tile_n, self.target_programs)
        seg = self.decode_config.segment
        decode_lens = seq_lens[:num_decodes]
        first_seg = first_segments(decode_lens, seg)
        num_slots = int(-(-decode_lens // seg).sum()) if num_decodes else 0
        max_segments = cdiv(int(decode_lens.max()), seg) if num_decodes else 0
        parts = {
            "qsl": qsl,
            "seq_lens": seq_lens,
            "prog_req": prog_req,
            "prog_qstart": prog_qstart,
            "slots": inputs.slot_mapping,
            "first_seg": first_seg,
            "block_table": inputs.block_table[:, :width],
        }
        offsets, size = _aligned_offsets({k: np.size(v) for k, v in parts.items()})
        host = np.zeros(size, dtype=np.int32)
        for name, part in parts.items():
            host[offsets[name] : offsets[name] + np.size(part)] = np.asarray(part).ravel()
        # Not blocking: async scheduling prepares a step while the one before runs.
        packed = to_device(host, self.device)

        def view(name: str) -> torch.Tensor:
            return packed[offsets[name] : offsets[name] + np.size(parts[name])]

        return TritonAttentionMetadata(
            query_start_loc=view("qsl"),
            seq_lens=view("seq_lens"),
            block_table=view("block_table").view(num_reqs, width),
            slot_mapping=view("slots"),
            prog_req=view("prog_req"),
            prog_qstart=view("prog_qstart"),
            block_m=block_m,
            num_splits=num_splits,
            num_decodes=num_decodes,
            first_seg=view("first_seg"),
            num_slots=num_slots,
            max_segments=max_segments,
            segs_per_program=segments_per_program(
                num_decodes, max_segments, self.num_kv_heads, self.decode_target_programs
            ),
            hidden_keys=None if hidden is None or not hidden.any() else to_device(hidden, self.device),
        )

    def rotate_and_write(self, rotary, positions, qkv, num_heads, num_kv_heads, kv_cache, metadata) -> bool:
        # On the GPU, half types (fp32 keeps torch's rotary for HF parity, an fp8 cache the write's conversion);
        # the CPU keeps its C++ rotary.
        key_cache, value_cache = kv_cache
        if not (qkv.is_cuda and self.fuse_rotary_write and qkv.dtype != torch.float32 and key_cache.dtype == qkv.dtype):
            return False
        if qkv.stride(1) != 1:
            return False
        rotary_write_kv(
            positions,
            qkv,
            rotary.cos,
            rotary.sin,
            num_heads,
            num_kv_heads,
            key_cache,
            value_cache,
            metadata.slot_mapping,
        )
        return True

    def warmup(self, kv_cache: KVCache) -> None:
        """Compile, before serving starts, the kernel variants a step may need: the KV write, the decode kernel,
        and the prefill kernel for each rows-per-program size (16, 32, 64). Each compiles on its first launch, a
        stall of every stream the first time a step needs it. Writes nothing (slot -1) and reads block 0."""
        dev, dt, dim = self.device, self.dtype, self.head_dim
        block_size = kv_cache[0].shape[1]
        for block_m in sorted({block_m_for(self.group, n) for n in (1, 8, 16, 64)}):
            q_len = max(2, block_m // self.group)
            lens = np.array([1, q_len])
            inputs = AttentionInputs(
                num_decodes=1,
                query_start_loc=np.array([0, 1, 1 + q_len]),
                seq_lens=lens,
                block_table=np.zeros((2, cdiv(q_len, block_size)), dtype=np.int32),
                slot_mapping=np.full(1 + q_len, -1),
                block_size=block_size,
            )
            t = 1 + q_len
            q = torch.zeros(t, self.num_heads, dim, dtype=dt, device=dev)
            kv = torch.zeros(t, self.num_kv_heads, dim, dtype=dt, device=dev)
            self.forward(q, kv, kv, kv_cache, self.build_metadata(inputs), dim**-0.5)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: KVCache,
        metadata: TritonAttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
        alibi_slopes: torch.Tensor | None = None,
        kv_written: bool = False,  # rotate_and_write did it
    ) -> torch.Tensor:
        window = sliding_window or 0  # the kernels' "no window"
        key_cache, value_cache = kv_cache
        # Every write before any read (see AttentionBackend.forward). Reads are masked to each request's own
        # keys, so a reused block's stale contents (even NaN) are never loaded.
        if not kv_written:
            write_kv(k, v, key_cache, value_cache, metadata.slot_mapping)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        nd = metadata.num_decodes
        if nd:
            assert metadata.first_seg is not None
            decode_attention(
                q[:nd],
                key_cache,
                value_cache,
                out[:nd],
                metadata.block_table[:nd],
                metadata.seq_lens[:nd],
                metadata.first_seg,
                metadata.num_slots,
                metadata.max_segments,
                metadata.segs_per_program,
                scale,
                self.decode_config,
                window,
                alibi_slopes,
                self._arrived_for(nd),
            )
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
            first_token=nd,  # the decode rows' tokens (one each, first) are written above
            window=window,
            alibi_slopes=alibi_slopes,
            hidden_keys=metadata.hidden_keys,
        )
        return out.view(q.shape[0], -1)

    def _arrived_for(self, num_reqs: int) -> torch.Tensor:
        need = num_reqs * self.num_kv_heads
        if self._arrived.numel() < need:
            self._arrived_kept.append(self._arrived)
            self._arrived = torch.zeros(max(need, 2 * self._arrived.numel()), dtype=torch.int32, device=self.device)
        return self._arrived

    # ------------------------------------------------------------------ captured decode graphs

    def alloc_decode_buffers(
        self, max_reqs: int, width: int, block_size: int, num_kv_blocks: int | None = None
    ) -> DecodeGraphBuffers:
        """Buffers for decode batches of up to `max_reqs` requests of up to `width` blocks of `block_size` each.
        The decode kernel's partial slots are sized for the most segments a step can have: every request at full
        length, or the whole pool of `num_kv_blocks` (when given) spread over the requests (each request's last
        segment may be partial), whichever is less."""
        seg = self.decode_config.segment
        max_slots = max_reqs * cdiv(width * block_size, seg)
        if num_kv_blocks is not None:
            max_slots = min(max_slots, max_reqs + num_kv_blocks * block_size // seg + 1)
        sizes = {
            "seq_lens": max_reqs,
            "slots": max_reqs,
            "first_seg": max_reqs,
            "block_table": max_reqs * width,
        }
        offsets, size = _aligned_offsets(sizes)
        self._arrived_for(max_reqs)
        pin = self.device.type == "cuda"
        staging = torch.zeros(size, dtype=torch.int32, pin_memory=pin)
        packed = torch.zeros(size, dtype=torch.int32, device=self.device)

        def view(name: str) -> torch.Tensor:
            return packed[offsets[name] : offsets[name] + sizes[name]]

        steps = torch.arange(max_reqs + 1, dtype=torch.int32, device=self.device)
        return DecodeGraphBuffers(
            max_reqs=max_reqs,
            width=width,
            max_slots=max_slots,
            offsets=offsets,
            staging=staging,
            packed=packed,
            seq_lens=view("seq_lens"),
            slot_mapping=view("slots"),
            block_table=view("block_table").view(max_reqs, width),
            first_seg=view("first_seg"),
            query_start_loc=steps,
            prog_req=steps[:0],
            prog_qstart=steps[:0],
        )

    def decode_graph_metadata(self, buffers: DecodeGraphBuffers, num_reqs: int, max_model_len: int):
        """Metadata over the first `num_reqs` rows of the buffers, fixed for every replay of that batch size: the
        launch shapes cannot depend on a step's lengths, so the segment kernel's grid is sized for the longest
        context allowed (programs past a request's last segment return at once)."""
        max_segments = cdiv(max_model_len, self.decode_config.segment)
        return TritonAttentionMetadata(
            query_start_loc=buffers.query_start_loc[: num_reqs + 1],
            seq_lens=buffers.seq_lens[:num_reqs],
            block_table=buffers.block_table[:num_reqs],
            slot_mapping=buffers.slot_mapping[:num_reqs],
            prog_req=buffers.prog_req,
            prog_qstart=buffers.prog_qstart,
            block_m=block_m_for(self.group, 1),
            num_splits=1,
            num_decodes=num_reqs,
            first_seg=buffers.first_seg[:num_reqs],
            num_slots=min(buffers.max_slots, num_reqs * max_segments),
            max_segments=max_segments,
            segs_per_program=segments_per_program(
                num_reqs, max_segments, self.num_kv_heads, self.decode_target_programs
            ),
        )

    def fill_decode_buffers(self, buffers: DecodeGraphBuffers, inputs: AttentionInputs, num_padded: int) -> None:
        """Write a decode-only step (every request one query token) into the buffers; rows from the step's
        requests up to `num_padded` become padding: no keys (seq_len 0, so no segment and output 0) and no KV
        write."""
        num_reqs = len(inputs.seq_lens)
        w, off = buffers.width, buffers.offsets
        host = buffers.staging.numpy()
        seq = host[off["seq_lens"] :]
        seq[:num_reqs] = inputs.seq_lens
        seq[num_reqs:num_padded] = 0
        slots = host[off["slots"] :]
        slots[:num_reqs] = inputs.slot_mapping
        slots[num_reqs:num_padded] = -1
        table = host[off["block_table"] : off["block_table"] + buffers.max_reqs * w].reshape(buffers.max_reqs, w)
        cols = min(w, inputs.block_table.shape[1])
        table[:num_reqs, :cols] = inputs.block_table[:, :cols]
        seg = self.decode_config.segment
        num_segs = int(-(-np.asarray(inputs.seq_lens) // seg).sum())
        assert num_segs <= buffers.max_slots, f"{num_segs} decode segments > {buffers.max_slots} slots"
        first = host[off["first_seg"] :]
        first[:num_reqs] = first_segments(inputs.seq_lens, seg)
        first[num_reqs:num_padded] = num_segs  # padding rows: no segment (never read)
        # Only the rows in use travel (the rows past num_padded are never read by this batch size's graph).
        ranges = [(off[k], off[k] + num_padded) for k in ("seq_lens", "slots", "first_seg")]
        ranges.append((off["block_table"], off["block_table"] + num_padded * w))
        for lo, hi in ranges:
            if hi > lo:
                buffers.packed[lo:hi].copy_(buffers.staging[lo:hi], non_blocking=True)


def _aligned_offsets(sizes: dict[str, int]) -> tuple[dict[str, int], int]:
    """Offsets (int32 elements) of parts laid out in order, each on a 16-byte boundary, and the total size."""
    offsets, pos = {}, 0
    for name, n in sizes.items():
        offsets[name] = pos
        pos += cdiv(max(int(n), 1), _ALIGN) * _ALIGN
    return offsets, pos

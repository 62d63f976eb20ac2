"""Paged attention with the C++ CPU kernels (kernels/csrc/paged_attention*.cpp).

Every decode token and every token of a prefill chunk is one row of a single kernel call that reads K/V through
its request's block table up to the token's own position (so causality needs no mask): one call per layer, no
gathered context, no per-request loop. A draft tree's query tokens (tree attention, AttentionInputs.query_masks)
are rows too: each carries a 64-bit word of the tree keys it may not see (common.tree_hidden_keys), which the
kernels mask; ordinary rows carry none. A row walks its context block by block from position 0 in the same steps
whatever else is in the call, so its output depends on its query and its context alone: the backend is
batch-invariant (deterministic inference, kvserve/layers/batch_invariant.py).

The one exception is opt-in: with `deterministic=False` and the standard cache layout, big chunks (more than
1024 x 1024 query-key pairs) go to SDPA, one request at a time, as in the torch reference (attention/torch_ref.py),
where SDPA is faster than the kernel in fp32, and the other chunks of at least _TILE_MIN_ROWS tokens take the
kernel's tile path (kernels/csrc/paged_attention_chunk.cpp: a tile of query tokens shares each K/V row it reads,
2.3x the row walk in fp32 with AVX-512, 1.35x with AVX2); both sum in an order that depends on the chunk, so a
token's output then depends on how its prompt was cut.

With a bf16 cache on a CPU with AVX512-BF16, the cache blocks hold the pair-packed layout of
kernels/csrc/kv_layout.h (same block size and place, another order inside), which the packed kernel reads with
about half the instructions per cached token, and which is faster than SDPA for chunks of every size. An fp8 cache
of a bf16 model holds the same tiles at one byte an element where the CPU also has AVX512-VBMI (widened exactly to
bf16 as they are read, kernels/csrc/packed_decode.h), else the standard layout.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from types import ModuleType

import numpy as np
import torch

from kvserve.attention.base import AttentionBackend, AttentionInputs, KVCache, blocks_view
from kvserve.attention.common import PrefillSpan, prefill_span, sdpa_prefill_spans, tree_hidden_keys
from kvserve.attention.kv_dtype import is_fp8, quantize_kv
from kvserve.kernels.cpu import kernel_isa, load_cpu_kernels
from kvserve.utils import cdiv


def _fp8_tile_offsets(block_size: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Where element (t, d) of one kv head sits in its fp8 K and V tiles (kv_layout.h), as flat [B * D] indices."""
    t, d = np.arange(block_size)[:, None], np.arange(head_dim)[None, :]

    def chunk_byte(u, w):  # element w of vector u within a 64-byte chunk
        return (w // 8) * 16 + u * 8 + w % 8

    k = ((d // 4) * (block_size // 16) + t // 16) * 64 + chunk_byte((d // 2) % 2, (t % 16) * 2 + d % 2)
    v = ((t // 2) * (head_dim // 32) + d // 32) * 64 + chunk_byte((d // 16) % 2, (d % 16) * 2 + t % 2)
    return torch.from_numpy(k.reshape(-1)), torch.from_numpy(v.reshape(-1))


def pack_kv_blocks(key_cache: torch.Tensor, value_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Standard [N, B, Hkv, D] blocks -> the pair-packed order (kv_layout.h), same shape: K tiles [Hkv][D/2][B][2],
    V tiles [Hkv][B/2][D][2]; an fp8 cache in its 64-byte chunks of two such vectors."""
    return _pack(key_cache, value_cache, is_fp8(key_cache.dtype))


def _pack(key_cache: torch.Tensor, value_cache: torch.Tensor, fp8: bool) -> tuple[torch.Tensor, torch.Tensor]:
    n, b, h, d = key_cache.shape
    if fp8:
        packed = []
        for cache, offsets in zip((key_cache, value_cache), _fp8_tile_offsets(b, d), strict=True):
            out = torch.empty_like(cache).view(n, h, b * d)
            out[:, :, offsets] = cache.permute(0, 2, 1, 3).reshape(n, h, b * d)
            packed.append(out.view(n, b, h, d))
        return packed[0], packed[1]
    k = key_cache.view(n, b, h, d // 2, 2).permute(0, 2, 3, 1, 4)
    v = value_cache.view(n, b // 2, 2, h, d).permute(0, 3, 1, 4, 2)
    return k.contiguous().view(n, b, h, d), v.contiguous().view(n, b, h, d)


def unpack_kv_blocks(key_cache: torch.Tensor, value_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of pack_kv_blocks."""
    n, b, h, d = key_cache.shape
    if is_fp8(key_cache.dtype):
        unpacked = []
        for cache, offsets in zip((key_cache, value_cache), _fp8_tile_offsets(b, d), strict=True):
            tiles = cache.reshape(n, h, b * d)[:, :, offsets].view(n, h, b, d)
            unpacked.append(tiles.permute(0, 2, 1, 3).contiguous())
        return unpacked[0], unpacked[1]
    k = key_cache.view(n, h, d // 2, b, 2).permute(0, 3, 1, 2, 4)
    v = value_cache.view(n, h, b // 2, d, 2).permute(0, 2, 4, 1, 3)
    return k.reshape(n, b, h, d), v.reshape(n, b, h, d)


@functools.cache
def _packed_token_offsets(block_size: int, num_kv_heads: int, head_dim: int, fp8: bool) -> torch.Tensor:
    """[2, B, Hkv * D] int64: where each element of the token in slot t of a block sits inside the packed block,
    for K (0) and V (1). Packs a block of element numbers and inverts the permutation."""
    numel = block_size * num_kv_heads * head_dim
    numbers = torch.arange(numel, dtype=torch.int64).view(1, block_size, num_kv_heads, head_dim)
    out = torch.empty(2, numel, dtype=torch.int64)
    for i, packed in enumerate(_pack(numbers, numbers, fp8)):
        out[i, packed.reshape(-1)] = torch.arange(numel)
    return out.view(2, block_size, num_kv_heads * head_dim)


# With deterministic=False and the standard layout, a chunk goes to the kernel if query tokens x context tokens is
# at most this, to SDPA if more. In fp32 the kernel costs about the same per (query, key) pair whatever the shape,
# while SDPA's cost per pair falls as the chunk grows (SmolLM2's shape on kind A, one layer of a 2048-token chunk:
# kernel 58 ms, SDPA 42). In a step, SDPA also pays for the gather of a cached context, the output scatter and a call
# per request, so the switch is set above the isolated crossover. The pair-packed bf16 kernel is faster than SDPA
# at every size (the same chunk: 20 ms against SDPA's 45 in bf16), so that layout never uses SDPA.
_KERNEL_MAX_WORK = 1024 * 1024

# With deterministic=False, a request's chunk of at least this many query tokens takes the kernel's tile path (fp32,
# the standard layout; the kernel falls back to rows where it does not apply). Shorter ones (decodes, speculative
# verification rows) stay rows: a tile holds 8-10 tokens of a GQA-3 model, and fewer would leave its lanes idle.
_TILE_MIN_ROWS = 16


@dataclass
class CpuKernelMetadata:
    slot_mapping: torch.Tensor  # [T] int64
    # One kernel row per query token it takes (decodes and short prefill chunks alike).
    kernel_rows: torch.Tensor | None  # [N] int64 token indices; None = every token of the step
    token_block_table: torch.Tensor | None  # [N, max_blocks] int32, the token's request's blocks; None if N = 0
    token_seq_lens: torch.Tensor | None  # [N] int64, keys the token sees (its position + 1)
    # Tree attention: the keys among its last 64 each row may not see (common.tree_hidden_keys); None = no tree.
    token_hidden_keys: torch.Tensor | None  # [N] int64
    # The tile path (deterministic=False): runs of kernel rows that are one request's chunk, [C, 2] int64 (first
    # row, rows); None = every row by itself.
    token_chunks: torch.Tensor | None
    prefills: list[PrefillSpan]  # the big chunks, through SDPA (only with deterministic=False)
    packed: bool  # the cache holds the pair-packed layout


class CpuKernelAttentionBackend(AttentionBackend):
    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        kernels: ModuleType | None = None,
        deterministic: bool = True,
        kv_cache_dtype: torch.dtype | None = None,
    ) -> None:
        """`deterministic=False` lets big chunks go to SDPA where it is faster (the standard layout; see the module
        docstring); a query's output then depends on its chunk. `kv_cache_dtype`: the model's dtype (None) or fp8,
        which the kernels convert to on write and widen from on read (pair-packed with a bf16 model where the CPU
        allows, see uses_packed_layout)."""
        super().__init__(num_heads, num_kv_heads, head_dim, kv_cache_dtype or dtype)
        self.dtype = dtype
        self.group = num_heads // num_kv_heads
        kernels = kernels if kernels is not None else load_cpu_kernels()
        if kernels is None:
            raise RuntimeError("the C++ CPU kernels are not available: use TorchRefAttentionBackend")
        self.kernels = kernels
        self.deterministic = deterministic
        self._packed_layout: dict[int, bool] = {}  # block size -> uses_packed_layout

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        # NOTE: the pair-packed layout keeps this shape and each token's block; only the order inside a block differs.
        return (num_blocks, block_size, self.num_kv_heads, self.head_dim)

    def uses_packed_layout(self, block_size: int) -> bool:
        """Whether caches of this block size hold the pair-packed layout (fixed for a cache's whole life): a bf16
        model with a bf16 cache, or with an fp8 cache where the CPU has AVX512-VBMI too."""
        # Asked on every step's metadata: the answer is fixed per block size, so it is kept.
        known = self._packed_layout.get(block_size)
        if known is None:
            fp8 = is_fp8(self.kv_cache_dtype)
            known = (self.dtype == torch.bfloat16 and (fp8 or self.kv_cache_dtype == self.dtype)) and bool(
                self.kernels.packed_kv_supported(self.head_dim, self.group, block_size, fp8)
            )
            self._packed_layout[block_size] = known
        return known

    def kv_layout(self, block_size: int) -> str:
        if not self.uses_packed_layout(block_size):
            return "standard"
        return "fp8-pair-packed" if is_fp8(self.kv_cache_dtype) else "bf16-pair-packed"

    def describe(self, block_size: int) -> str:
        """Which kernels run attention (and the elementwise ops and sampling, which share the build)."""
        packed = "pair-packed " if self.uses_packed_layout(block_size) else ""
        layout = f", {packed}bf16 KV" if packed else ""
        if is_fp8(self.kv_cache_dtype):
            layout = f", {packed}{str(self.kv_cache_dtype).removeprefix('torch.')} KV"
        sdpa = "" if self.batch_invariant(block_size) else ", big chunks via SDPA"
        if sdpa and self.dtype == torch.float32 and self.kernels.vector_isa() in ("avx2", "avx512"):
            sdpa = ", prompt chunks in tiles, big ones via SDPA"  # paged_attention_chunk.cpp's levels
        return f"C++ {kernel_isa()}{layout}{sdpa}"

    def batch_invariant(self, block_size: int) -> bool:
        return self.deterministic or self.uses_packed_layout(block_size)

    def move_kv_slots(self, kv_caches: list[KVCache], src: np.ndarray, dst: np.ndarray, block_size: int) -> None:
        if not self.uses_packed_layout(block_size):
            return super().move_kv_slots(kv_caches, src, dst, block_size)
        if not len(src):
            return
        # A token's K and V are spread over its block's tiles: gather every element of the source tokens, in every
        # layer, with one index and scatter them with another (the pool is one buffer, blocks_view). Gathering all
        # sources first is safe: a request's sources lie past all its earlier destinations.
        pool = blocks_view(kv_caches)  # [N, 2 * layers, B, H, D]
        n, num_tensors = pool.shape[:2]
        per_block = pool[0, 0].numel()
        offsets = _packed_token_offsets(block_size, *pool.shape[3:], is_fp8(pool.dtype))  # [2, B, H * D]
        # Element e of token slot s in tensor i (K of layer l at 2l, V at 2l + 1): i * numel + block * per_block
        # + offsets[i % 2, s % block_size, e], the tensors being back to back (allocate_kv_cache).
        tensor_base = torch.arange(num_tensors, dtype=torch.int64) * (n * per_block)
        parity = torch.arange(num_tensors) % 2

        def elements(slots: np.ndarray) -> torch.Tensor:
            slots_t = torch.from_numpy(slots.astype(np.int64))
            within = offsets[parity[:, None], (slots_t % block_size)[None, :]]  # [2L, M, H * D]
            return (tensor_base[:, None, None] + (slots_t // block_size * per_block)[None, :, None] + within).view(-1)

        first = kv_caches[0][0]
        bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[first.element_size()]
        flat = torch.as_strided(first, (num_tensors * first.numel(),), (1,), first.storage_offset()).view(bits)
        flat[elements(dst)] = flat[elements(src)]

    def fused_layer(self):
        return self.kernels.llama_decoder_layer

    def fused_layer_args(self, metadata: CpuKernelMetadata) -> tuple | None:
        # Only steps whose every query row goes through the kernel (no SDPA spans).
        if metadata.kernel_rows is not None or metadata.token_block_table is None:
            return None
        return (
            metadata.slot_mapping,
            metadata.token_block_table,
            metadata.token_seq_lens,
            metadata.packed,
            metadata.token_hidden_keys,
            metadata.token_chunks,
        )

    def build_metadata(self, inputs: AttentionInputs) -> CpuKernelMetadata:
        qsl, seq_lens = inputs.query_start_loc, inputs.seq_lens
        num_tokens = int(qsl[-1])
        # Every token is a kernel row, except, with deterministic=False and the standard layout, the tokens of big
        # chunks: they go to SDPA, whose tiles reuse each K/V row across many queries (faster in fp32, see
        # _KERNEL_MAX_WORK).
        if self.batch_invariant(inputs.block_size):
            by_kernel = np.ones(len(seq_lens), dtype=bool)
        else:
            by_kernel = np.diff(qsl) * seq_lens <= _KERNEL_MAX_WORK
        # Tree attention: the kernels hide each row's masked tree keys (big tree chunks through SDPA take the mask
        # as a whole, prefill_span).
        hidden = tree_hidden_keys(inputs)
        prefills = [prefill_span(inputs, i) for i in np.flatnonzero(~by_kernel)]
        req = np.repeat(np.arange(len(seq_lens)), np.diff(qsl))  # request of each token
        rows = None
        if prefills:
            rows_np = np.flatnonzero(by_kernel[req])
            req = req[rows_np]
            rows = torch.from_numpy(rows_np)
            tokens = rows_np
        else:
            tokens = np.arange(num_tokens)
        table = seq_lens_t = hidden_t = chunks_t = None
        if hidden is not None and hidden[tokens].any():
            hidden_t = torch.from_numpy(np.ascontiguousarray(hidden[tokens]))
        elif not self.batch_invariant(inputs.block_size):
            chunks_t = self._tile_chunks(qsl, by_kernel)
        if len(req):
            # A request's query tokens are its last q_len positions: token t sees seq_len - (end - 1 - t) keys.
            token_seq_lens = seq_lens[req] - (qsl[req + 1] - 1 - tokens)
            num_blocks = cdiv(int(seq_lens[req].max()), inputs.block_size)
            table = torch.from_numpy(np.ascontiguousarray(inputs.block_table[req, :num_blocks]))
            seq_lens_t = torch.from_numpy(token_seq_lens.astype(np.int64))
        return CpuKernelMetadata(
            slot_mapping=torch.from_numpy(inputs.slot_mapping),
            kernel_rows=rows,
            token_block_table=table,
            token_seq_lens=seq_lens_t,
            token_hidden_keys=hidden_t,
            token_chunks=chunks_t,
            prefills=prefills,
            packed=self.uses_packed_layout(inputs.block_size),
        )

    @staticmethod
    def _tile_chunks(qsl: np.ndarray, by_kernel: np.ndarray) -> torch.Tensor | None:
        """The requests' chunks of at least _TILE_MIN_ROWS kernel rows, as (first row, rows) among the kernel rows
        (the tokens of SDPA's requests are not rows)."""
        q_lens = np.diff(qsl)
        firsts = np.cumsum(np.where(by_kernel, q_lens, 0)) - np.where(by_kernel, q_lens, 0)
        take = by_kernel & (q_lens >= _TILE_MIN_ROWS)
        if not take.any():
            return None
        return torch.from_numpy(np.stack([firsts[take], q_lens[take]], axis=1).astype(np.int64))

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: KVCache,
        metadata: CpuKernelMetadata,
        scale: float,
        sliding_window: int | None = None,
        alibi_slopes: torch.Tensor | None = None,
    ) -> torch.Tensor:
        key_cache, value_cache = kv_cache
        num_tokens = q.shape[0]
        hkv, hd = self.num_kv_heads, self.head_dim
        # Every write before any read (see AttentionBackend.forward). The kernel replaces non-finite values as it
        # writes: the packed kernel's tiles read past a context's end, and a masked weight of 0 times a stale NaN
        # is still NaN, so one broken request must not poison the requests that reuse its blocks later.
        self.kernels.write_kv(
            k.reshape(num_tokens, hkv * hd),
            v.reshape(num_tokens, hkv * hd),
            key_cache,
            value_cache,
            metadata.slot_mapping,
            metadata.packed,
        )
        attend = self.kernels.paged_attention_packed if metadata.packed else self.kernels.paged_attention_decode
        # The tile path's chunks: the standard layout's kernel only (the packed layout is batch-invariant: no chunks).
        chunks = () if metadata.packed else (metadata.token_chunks,)
        window = sliding_window or 0  # the kernels' "no window"
        if metadata.kernel_rows is None:  # the common step: every token by the kernel, no copies
            out = attend(
                q.contiguous(),
                key_cache,
                value_cache,
                metadata.token_block_table,
                metadata.token_seq_lens,
                scale,
                window,
                alibi_slopes,
                metadata.token_hidden_keys,
                *chunks,
            )
            return out.view(num_tokens, -1)
        out = torch.empty(num_tokens, self.num_heads, hd, dtype=q.dtype)
        if len(metadata.kernel_rows):
            out[metadata.kernel_rows] = attend(
                q[metadata.kernel_rows],
                key_cache,
                value_cache,
                metadata.token_block_table,
                metadata.token_seq_lens,
                scale,
                window,
                alibi_slopes,
                metadata.token_hidden_keys,
                *chunks,
            )
        assert not metadata.packed, "the pair-packed layout never sends chunks to SDPA"
        if is_fp8(key_cache.dtype):  # a chunk's fresh K/V as the cache holds them, as the kernel reads them
            k, v = quantize_kv(k, key_cache.dtype).to(q.dtype), quantize_kv(v, key_cache.dtype).to(q.dtype)
        sdpa_prefill_spans(q, k, v, kv_cache, metadata.prefills, scale, out, sliding_window, alibi_slopes)
        return out.view(num_tokens, -1)

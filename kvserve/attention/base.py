"""The attention backend interface.

The runner describes a step's batch once (`AttentionInputs`, numpy); the backend turns that into its own
metadata once per step, and every layer calls `forward` with that metadata and its own KV cache. Nothing is
stored globally: the metadata object is passed explicitly through the model.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

# One layer's cache: (key_cache, value_cache), each of the backend's `kv_cache_shape`.
KVCache = tuple[torch.Tensor, torch.Tensor]


def blocks_view(kv_caches: list[KVCache]) -> torch.Tensor:
    """The pool as one `[num_blocks, 2 * num_layers, *block_shape]` view (K then V of each layer, in layer order):
    a whole block, every layer, is then one strided copy rather than one per layer, which is what moving blocks
    in and out of the pool (swap, KV offload) and a draft tree's K/V moves cost per step. Requires the layout
    worker/kv_cache.py's allocate_kv_cache makes: every K and V tensor back to back in one buffer, in that order."""
    tensors = [t for kv in kv_caches for t in kv]
    first = tensors[0]
    numel = first.numel()
    for i, t in enumerate(tensors):
        if not (
            t.is_contiguous()
            and t.shape == first.shape
            and t.dtype == first.dtype
            and t.data_ptr() == first.data_ptr() + i * numel * first.element_size()
        ):
            raise ValueError("the KV pool's K and V tensors must lie back to back in one buffer (allocate_kv_cache)")
    stacked = torch.as_strided(first, (len(tensors), *first.shape), (numel, *first.stride()), first.storage_offset())
    return stacked.transpose(0, 1)


@dataclass
class AttentionInputs:
    """A step's batch as the runner lays it out. Requests with a single query token ("decodes") come first.

    Every array is indexed by request (R of them) except slot_mapping, which is per token (T).
    """

    num_decodes: int
    query_start_loc: np.ndarray  # [R + 1] int64, offsets of each request's query tokens
    seq_lens: np.ndarray  # [R] int64, context length after this step (cached + new tokens)
    block_table: np.ndarray  # [R, max_blocks] int32, padded with 0 past each request's blocks
    slot_mapping: np.ndarray  # [T] int64, where each new token's K/V is written
    block_size: int
    # Tree attention (speculative draft trees, kvserve/spec_decode/tree.py): request index -> [q_len, q_len] bool,
    # True where query token j may see query token i of the same request (ancestors and itself). It replaces the
    # causal mask among that request's query tokens only; the cached context stays wholly visible. None: causal.
    # A token may see only itself and earlier query tokens (topological order), and the kernels take trees of at
    # most 64 query tokens (attention/common.py: tree_hidden_keys, the per-token bits the C++ and Triton kernels read).
    query_masks: dict[int, np.ndarray] | None = None


class AttentionBackend(ABC):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, kv_cache_dtype: torch.dtype) -> None:
        """`kv_cache_dtype`: what the cache tensors hold (the model's dtype, or fp8: attention/kv_dtype.py); the
        pool is allocated in it, and every write converts to it."""
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.kv_cache_dtype = kv_cache_dtype

    @abstractmethod
    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        """The shape of each of a layer's K and V cache tensors (vLLM's get_kv_cache_shape). The allocator gives
        every layer a zeroed K and V of this shape; the backend alone knows the order of the elements inside."""

    def describe(self, block_size: int) -> str:
        """The kernels this backend runs, for the start-up summary."""
        return type(self).__name__

    def kv_layout(self, block_size: int) -> str:
        """The order of the elements inside a block of caches of this block size (part of the KV layout id:
        blocks stored under another layout are never loaded). Backends that read the same standard layout
        (`[num_blocks, block_size, num_kv_heads, head_dim]`, row-major) can read each other's blocks."""
        return "standard"

    def move_kv_slots(self, kv_caches: list[KVCache], src: np.ndarray, dst: np.ndarray, block_size: int) -> None:
        """cache[dst[i]] = cache[src[i]] for every layer's K and V, token slots as in slot_mapping (a draft tree's
        accepted path moved into chain order). A request's sources lie past all its earlier destinations, so the
        moves may run at once. Backends with their own order inside a block override it."""
        if not len(src):
            return
        src_t, dst_t = torch.from_numpy(src.astype(np.int64)), torch.from_numpy(dst.astype(np.int64))
        for key_cache, value_cache in kv_caches:
            for cache in (key_cache, value_cache):
                flat = cache.view(-1, *cache.shape[2:])
                flat[dst_t.to(flat.device)] = flat[src_t.to(flat.device)]

    def batch_invariant(self, block_size: int) -> bool:
        """Whether each query token's output is a function of its query and its context's keys and values alone:
        bitwise the same whatever else is in the step, however its prompt was chunked, and whichever blocks came
        from the prefix cache, swap or a KV connector (kvserve/layers/batch_invariant.py). False unless a backend
        guarantees it."""
        return False

    @abstractmethod
    def build_metadata(self, inputs: AttentionInputs) -> Any:
        """Called once per step; the result is handed to every layer."""

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # [T, num_heads, head_dim]
        k: torch.Tensor,  # [T, num_kv_heads, head_dim]
        v: torch.Tensor,  # [T, num_kv_heads, head_dim]
        kv_cache: KVCache,
        metadata: Any,
        scale: float,
        sliding_window: int | None = None,
        alibi_slopes: torch.Tensor | None = None,  # [num_heads] fp32, this rank's query heads
    ) -> torch.Tensor:
        """Write k/v of the new tokens into the cache, then attend over each request's whole context, or with a
        `sliding_window` (this layer's AttentionSpec) over each query's last `sliding_window` keys, itself
        included. A windowed read never touches a block that lies wholly before its query's window: the scheduler
        may have freed such blocks (kvserve/core/kv_cache_manager.py) and given them to other requests.
        With `alibi_slopes` (ALiBi, kvserve/layers/alibi.py), head h's score of a key at position k for a query at
        position p gets slope[h] * (k - p) added after the scale.

        All writes of the step happen before any read, so a request may read blocks that another request of
        the same step is filling (prefix-cache hits on blocks scheduled in that step). Returns
        [T, num_heads * head_dim].
        """

    def rotate_and_write(
        self,
        rotary: Any,  # layers.rotary.RotaryEmbedding
        positions: torch.Tensor,
        qkv: torch.Tensor,  # [T, (num_heads + 2 * num_kv_heads) * head_dim]: q, k, v heads
        num_heads: int,
        num_kv_heads: int,
        kv_cache: KVCache,
        metadata: Any,
    ) -> bool:
        """Rotate the q and k heads of `qkv` in place and write the new k and v into the cache in one pass, where
        this backend can (then `forward` gets kv_written=True); False (the default): nothing was done, the caller
        rotates and `forward` writes."""
        return False

    def fused_layer(self) -> Any:
        """A C++ function that runs a whole decoder layer with this backend's attention, or None (the default):
        see kernels/csrc/decoder_layer.cpp. Used only where `fused_layer_args` gives arguments for the step."""
        return None

    def fused_layer_args(self, metadata: Any) -> tuple | None:
        """The step's attention arguments for `fused_layer`, or None when the step needs the module path."""
        return None

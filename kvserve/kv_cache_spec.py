"""KVCacheSpec: what the KV cache is, as one frozen value made by the workers and gathered by the executor.

Each worker (tensor-parallel rank) describes its own cache with its attention backend: block size, one
AttentionSpec per layer, the bytes of one block (K and V of every layer, plus the same block of every pool that
mirrors the pool's block ids: a draft model's), and a layout id. The executor gathers the ranks' specs
(`KVCacheSpec.merge`), which must agree on everything but the bytes (ranks may hold unequal shares of the KV
heads), and the engine core builds its scheduler, swap space and connectors from the merged value: nothing on the
engine side reaches into a runner.

Pure Python (no torch): the engine core and the connectors' scheduler sides import it.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.attention.spec import AttentionSpec


@dataclass(frozen=True)
class KVCacheSpec:
    block_size: int  # tokens per block
    layers: tuple[AttentionSpec, ...]  # one per layer of the target model
    # Bytes of one block on each rank, in rank order (one entry in a worker's own spec).
    rank_block_bytes: tuple[int, ...]
    # What the bytes of a block mean on every rank: model, dtype, quantization, backend and packing, KV heads, head
    # size, TP size, a draft's pool. Blocks stored under another layout id must never be loaded; rank r of an
    # engine holds its own slice of every block, so a store keeps one part per rank.
    layout_id: str

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def freeable_window(self) -> int | None:
        """The longest layer window when every layer has one: blocks wholly more than this many keys behind a
        request's next query are read by no layer again, so the scheduler may release them. None if any layer
        attends over the whole context."""
        windows = [layer.sliding_window for layer in self.layers]
        if not windows or any(w is None for w in windows):
            return None
        return max(w for w in windows if w is not None)

    @property
    def tp_size(self) -> int:
        return len(self.rank_block_bytes)

    @property
    def block_bytes(self) -> int:
        """One block over all ranks: what a byte budget (swap space, a RAM tier) pays per block."""
        return sum(self.rank_block_bytes)

    @classmethod
    def merge(cls, specs: list[KVCacheSpec]) -> KVCacheSpec:
        """The engine's spec from its ranks' (in rank order); ValueError names what the ranks disagree on."""
        if not specs:
            raise ValueError("no worker described its KV cache")
        first = specs[0]
        for rank, spec in enumerate(specs[1:], start=1):
            for name in ("block_size", "layers", "layout_id"):
                if getattr(spec, name) != getattr(first, name):
                    raise ValueError(
                        f"tensor-parallel ranks disagree on the KV cache's {name}: rank 0 has "
                        f"{getattr(first, name)!r}, rank {rank} {getattr(spec, name)!r}"
                    )
        return cls(first.block_size, first.layers, tuple(b for s in specs for b in s.rank_block_bytes), first.layout_id)

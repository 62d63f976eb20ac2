"""How a model's attention heads split over tensor-parallel ranks. Pure Python, so config validation can use it.

Heads are dealt out in whole GQA groups (a KV head and the query heads that read it), so attention stays local to
a rank:
- at least as many KV heads as ranks: rank r gets KV heads [r*K // tp, (r+1)*K // tp) and their query heads. When
  tp divides K this is the usual even split; otherwise ranks differ by one group (SmolLM2-135M's 3 KV heads over 2
  ranks: 1 and 2), and so do their attention work and KV-cache blocks;
- fewer KV heads than ranks: the query heads split evenly and each KV head is replicated on tp / K ranks (which
  must be whole).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class HeadSlice:
    first_head: int
    num_heads: int  # query heads on this rank
    first_kv_head: int
    num_kv_heads: int  # KV heads on this rank (replicas included)


def head_slice(num_heads: int, num_kv_heads: int, tp_size: int, rank: int) -> HeadSlice:
    """This rank's heads. Raises ValueError when the heads cannot be split."""
    if num_kv_heads < 1 or num_heads % num_kv_heads:
        raise ValueError(f"num_attention_heads ({num_heads}) is not a multiple of num_key_value_heads ({num_kv_heads})")
    group = num_heads // num_kv_heads
    if num_kv_heads >= tp_size:
        first_kv = rank * num_kv_heads // tp_size
        num_kv = (rank + 1) * num_kv_heads // tp_size - first_kv
        return HeadSlice(first_kv * group, num_kv * group, first_kv, num_kv)
    if tp_size % num_kv_heads or num_heads % tp_size:
        raise ValueError(
            f"tensor_parallel_size ({tp_size}) must be a multiple of num_key_value_heads ({num_kv_heads}) and divide "
            f"num_attention_heads ({num_heads}) to replicate the KV heads evenly"
        )
    per_rank = num_heads // tp_size
    replicas = tp_size // num_kv_heads
    return HeadSlice(rank * per_rank, per_rank, rank // replicas, 1)


def check_head_split(num_heads: int, num_kv_heads: int, tp_size: int) -> None:
    """Raises ValueError, naming the numbers, if some rank cannot get its heads."""
    for rank in range(tp_size):
        head_slice(num_heads, num_kv_heads, tp_size, rank)

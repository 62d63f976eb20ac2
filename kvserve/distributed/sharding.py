"""How a model's heads split over tensor-parallel ranks. Pure Python, so config validation can use it."""

from __future__ import annotations


def local_head_counts(num_heads: int, num_kv_heads: int, tp_size: int) -> tuple[int, int]:
    """(query heads, KV heads) on each rank. With fewer KV heads than ranks each KV head is replicated on
    tp_size / num_kv_heads ranks. Raises ValueError when the heads cannot be split evenly."""
    if num_heads % tp_size:
        raise ValueError(f"num_attention_heads ({num_heads}) is not divisible by tensor_parallel_size ({tp_size})")
    if num_kv_heads >= tp_size:
        if num_kv_heads % tp_size:
            raise ValueError(
                f"num_key_value_heads ({num_kv_heads}) is not divisible by tensor_parallel_size ({tp_size})"
            )
    elif tp_size % num_kv_heads:
        raise ValueError(
            f"tensor_parallel_size ({tp_size}) is not a multiple of num_key_value_heads ({num_kv_heads}), so the "
            "KV heads cannot be replicated evenly"
        )
    return num_heads // tp_size, max(1, num_kv_heads // tp_size)

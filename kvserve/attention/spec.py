"""What one layer's attention asks of the KV cache: the per-layer variant, as a plain value.

Pure Python (no torch), so the engine core, the scheduler and the connectors' scheduler sides may read it
(tests/test_layering.py allows this one module of attention/ there). The runner builds one per layer from the
model and its attention backend, and they travel inside the KVCacheSpec (kvserve/kv_cache_spec.py).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class AttentionSpec:
    # What a K/V element is stored as (torch's name): "float32" | "bfloat16" | "float16" | "float8_e4m3fn" |
    # "float8_e5m2".
    kv_dtype: str
    # Keys a query may see, itself included (HF's `sliding_window`); None: the whole context.
    sliding_window: int | None = None
    # ALiBi position biases (kvserve/layers/alibi.py): the layer passes its heads' slopes to the backend. The cached
    # K/V are the same as without (the biases are added to the scores), so this changes no block's bytes.
    alibi: bool = False

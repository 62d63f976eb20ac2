"""Engine-core bookkeeping in pure Python (no torch): block hashing, block pool, KV cache manager, scheduler."""

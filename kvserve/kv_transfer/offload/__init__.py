"""The offload connector: KV blocks kept, by their chained prefix-cache hashes, in a RAM tier and a disk tier
beyond the engine's pool, and loaded back on a prefix hit the pool no longer holds."""

"""Attention backends: paged KV writes through slot mappings, reads through block tables."""

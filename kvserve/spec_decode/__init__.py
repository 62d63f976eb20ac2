"""Draft proposers for speculative decoding (the verification is kvserve.sample.rejection_sampler)."""

"""Model execution: persistent per-request inputs, forward pass, sampling."""

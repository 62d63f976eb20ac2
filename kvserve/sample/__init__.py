"""Sampling from logits."""

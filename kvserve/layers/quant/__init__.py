"""Quantized layers (int8 weights on the CPU) and the pass that puts them into a loaded model."""

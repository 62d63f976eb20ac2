"""Benchmarks behind `kvserve bench`: datasets, offline throughput, serving load generator, rooflines, plots."""

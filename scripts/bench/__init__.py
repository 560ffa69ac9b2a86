"""Benchmarks and comparisons: they measure the pipeline (scripts/) and the decoder, and write reports."""

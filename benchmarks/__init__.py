"""Benchmarks: run with `make bench`; they print ratios measured side by side."""

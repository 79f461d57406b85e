"""Benchmark scripts (`make bench-engine`, `make bench-server`): ratios measured side by side."""

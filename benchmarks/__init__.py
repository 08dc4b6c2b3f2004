"""Benchmarks (run each module with `python -m benchmarks.<name>`)."""

"""Benchmark scripts (run as ``python benchmarks/<name>.py``) and what they share."""

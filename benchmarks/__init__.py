"""Benchmark scripts: each prints a table and writes its results under docs/ (not timed tests)."""

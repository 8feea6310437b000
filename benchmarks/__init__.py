"""Benchmark scripts: each prints a table and writes its results (committed runs live in docs/results/; not timed tests)."""

"""Benchmarks: run as modules (`python -m tests.bench.bench_queue`), never collected by pytest."""

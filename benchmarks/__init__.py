"""Benchmarks for jmp_lite: run ``python -m benchmarks.run --help``."""

"""Command-line tools; bench_common.py holds what the benchmark scripts share."""

"""Benchmarks (``make bench``, ``make bench-policy``); not part of the installed package."""

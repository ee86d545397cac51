"""Benchmarks run from the command line: ``ringtrain bench collectives ...`` and ``ringtrain bench train ...``."""

"""Benchmarks: training throughput and scaling (and, with ringtrain.comm, collectives)."""

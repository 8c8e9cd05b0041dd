"""Kernel benchmarks: single kernels and their knobs against cuBLAS or SDPA, static facts of compiled
kernels, the 12-bit format's statistics. Run as `python -m bench.kernels.<name>`."""

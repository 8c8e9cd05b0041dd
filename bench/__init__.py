"""Benchmark scripts, run from the checkout as `python -m bench.<subject>.<name>`.

Every script measures through `specpilot.bench.harness` (CUDA graphs and events, one results
schema with commit, device and versions inside) and takes its model shapes from `bench.shapes`.
"""

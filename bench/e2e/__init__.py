"""End-to-end and acceptance benchmarks over the zoo: tokens per second, τ, token forcing, trees,
reduced draft vocabularies. Run as `python -m bench.e2e.<name>`."""

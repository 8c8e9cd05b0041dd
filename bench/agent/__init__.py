"""Benchmarks of the search agent (specpilot.agent): what `specpilot tune` finds, how fast, and what
memory carries between deployments. Run as `python -m bench.agent.<name>`."""

"""Decode-step benchmarks at 8B shapes: step times beside the weight-read floor, A/B step comparisons,
HF peers, the cost model against measured steps. Run as `python -m bench.steps.<name>`."""

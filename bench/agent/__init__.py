"""Benchmarks of the search agent (specpilot.agent): what `specpilot tune` finds, how fast, and what
memory carries between deployments. Run as `python -m bench.agent.<name>`."""

from dataclasses import replace
from pathlib import Path

from specpilot.spec import PipelineSpec, load_spec


def bench_spec(path: str | Path, *, num_prompts: int | None = None, max_new_tokens: int | None = None,
               batch: int | None = None) -> PipelineSpec:
    """The pipeline file's spec with a benchmark's overrides: prompts measured, new tokens a prompt, and
    one served batch size (trials then time the batched engine against batched AR)."""
    spec = load_spec(path)
    if num_prompts:
        spec = replace(spec, benchmark=replace(spec.benchmark, num_prompts=num_prompts))
    if max_new_tokens:
        spec = replace(spec, serving=replace(spec.serving, max_new_tokens=max_new_tokens))
    if batch:
        spec = replace(spec, serving=replace(spec.serving, batch_sizes=(batch,)))
    return spec

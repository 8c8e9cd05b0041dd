"""The decode loop's terms: where one speculative step of a graphed engine spends its time.

    terms = loop_terms(engine, prompt_ids, context_tokens=64)
    terms.efficiency          # (t_draft + t_verify) / the loop's time a step

A graphed engine runs each step as one CUDA graph replay followed by one small status read on the
host. To split that time, a runner of the engine's own loop class is built over the engine's own
modules (the same weights, kernels and capacity bucket as its generations use), brought to a
realistic state by a generation of `context_tokens`, and its step is cut in parts
(graph_decode's `parts()`): each part is captured in its own CUDA graph and timed by CUDA events
(harness.time_graph, median of repeats), each including the restoring of the state it changed,
whose own time is subtracted. Then, per step:

  draft          the drafter's forward (a replay drafter's overwrite included: three small kernels)
  propose        trees only: top-k, the tree builder, the ancestor mask
  verify         the target's forward over the candidates
  accept_commit  the whole step's graph minus the parts above: acceptance, KV rollback or
                 compaction, the drafter's state, the output buffer
  launch_sync    a step's graph replayed with the loop's status read, timed by the wall clock,
                 minus its device time: graph launch and the host round trip
  host           the loop's measured time a step (its own clocks over the measured generations)
                 minus the above: Python bookkeeping between steps

The shares are each term over the loop's time a step, and the loop efficiency of the issue,
measured speedup / (τ · t_AR / (t_draft + t_verify)), equals (t_draft + t_verify) / (the loop's time
a step) when t_AR is the AR loop's own time a token (one step a token): `efficiency`. On a CPU the
graphs run uncaptured and the wall clock times them: a check that the code runs, never a figure.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ..backends import kernel_hooks
from ..runtime import graph_decode
from ..runtime.model import PardDrafter
from . import harness

TERMS = ("draft", "propose", "verify", "accept_commit", "launch_sync", "host")


@dataclass(frozen=True)
class LoopTerms:
    """Milliseconds a step, by term (module docstring), and the loop's own time a step."""

    ms: dict[str, float]
    loop_step_ms: float
    timing: str  # how the parts were timed ("cuda-graph", or "cpu-wall": a check only)

    @property
    def efficiency(self) -> float:
        return (self.ms["draft"] + self.ms["verify"]) / self.loop_step_ms

    def shares(self) -> dict[str, float]:
        return {k: v / self.loop_step_ms for k, v in self.ms.items()}

    def largest_overhead(self) -> str:
        """The term outside draft and verify that costs the most: what holds the loop back."""
        return max((t for t in TERMS if t not in ("draft", "verify")), key=lambda t: self.ms[t])


def make_runner(engine, needed: int):
    """A fresh runner of the loop class `engine.run_loop` uses for its program, over its modules,
    sized for `needed` tokens as its own runner would be."""
    program = engine.program
    propose = program.step.one("propose")[1]
    capacity = max(graph_decode.MIN_CAPACITY, 1 << (needed - 1).bit_length())
    common = dict(mask_token_id=engine.drafter.mask_token_id, eos_token_id=engine.eos_token_id)
    pard = engine.kind == "pard"
    drafter = engine.drafter.model if isinstance(engine.drafter, PardDrafter) else engine.drafter
    if propose["shape"] == "tree":
        tree = dict(budget=propose["budget"], topk=propose.get("topk", 4), build=kernel_hooks.tree_builder(engine.device))
        if pard:
            return graph_decode.GraphedTreePard(engine.target, drafter, capacity, engine.block_size, **tree, **common)
        return graph_decode.GraphedTreeDFlash(engine.target, drafter, capacity, engine.block_size, **tree, **common)
    if pard:
        return graph_decode.GraphedPard(engine.target, drafter, capacity, engine.block_size, **common)
    return graph_decode.GraphedDFlash(engine.target, drafter, capacity, engine.block_size, **common)


def _wall_step_with_sync(replay, status: torch.Tensor, repeats: int) -> float:
    """Milliseconds of one step replay followed by the loop's status read, by the wall clock (median)."""
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        replay()
        status.tolist()
        samples.append((time.perf_counter() - t0) * 1e3)
    samples.sort()
    return samples[len(samples) // 2]


def loop_terms(engine, prompt_ids: list[int], loop_step_ms: float, context_tokens: int = 64,
               max_new_tokens: int = 128, repeats: int = 30) -> LoopTerms:
    """The terms of a step of `engine`'s graphed loop (module docstring); `loop_step_ms` is its
    measured time a step (decode seconds over steps of its generations)."""
    if not engine.graphed:
        raise ValueError("loop terms are measured on graphed loops (the cuda-graphs pass)")
    cuda = engine.device.type == "cuda"
    runner = make_runner(engine, len(prompt_ids) + max_new_tokens)
    runner.generate(prompt_ids, max_new_tokens=context_tokens, eos_token_id=engine.eos_token_id)
    parts = runner.parts()
    with torch.inference_mode():
        timed = {name: harness.time_graph(fn, repeats=repeats, cuda=cuda).median_ms for name, fn in parts.items()}
        restore = timed.pop("restore")
        step_replay = harness.capture(parts["step"], cuda=cuda)
        wall = _wall_step_with_sync(step_replay, runner.status, repeats) - restore
    ms = {name: max(0.0, t - restore) for name, t in timed.items()}
    step = ms.pop("step")
    ms.setdefault("propose", 0.0)
    ms["accept_commit"] = max(0.0, step - ms["draft"] - ms["propose"] - ms["verify"])
    ms["launch_sync"] = max(0.0, wall - step)
    ms["host"] = max(0.0, loop_step_ms - max(wall, step))
    return LoopTerms({t: ms[t] for t in TERMS}, loop_step_ms, "cuda-graph" if cuda else "cpu-wall")

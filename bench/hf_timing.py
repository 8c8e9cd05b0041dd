"""Timing HF transformers' `generate` the way the runtime's decode loops time themselves: the prefill
apart from the decode, the device synchronised at each step. Shared by the scripts that put HF
beside specpilot (bench.steps.hf_peers, bench.e2e.zoo_e2e)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class StepClock:
    """A `generate` streamer that timestamps every put with the device synchronised.

    generate puts the prompt first, then the prefill's token, then each decode step's new tokens
    (one for AR, accepted drafts + bonus for assisted generation), and calls end() last.
    """

    device: torch.device
    start: float = 0.0
    puts: list[float] = field(default_factory=list)
    counts: list[int] = field(default_factory=list)
    stop: float = 0.0

    def begin(self) -> StepClock:
        sync(self.device)
        self.start, self.puts, self.counts, self.stop = time.perf_counter(), [], [], 0.0
        return self

    def put(self, value: torch.Tensor) -> None:
        sync(self.device)
        self.puts.append(time.perf_counter())
        self.counts.append(value.numel())

    def end(self) -> None:
        sync(self.device)
        self.stop = time.perf_counter()

    @property
    def prefill_s(self) -> float:
        return self.puts[1] - self.start

    @property
    def decode_s(self) -> float:
        return self.stop - self.puts[1]

    @property
    def step_tokens(self) -> list[int]:
        """New tokens of each decode step (the prompt's and the prefill's puts left out)."""
        return self.counts[2:]


@dataclass
class Run:
    """One timed generation, whichever stack produced it."""

    tokens: list[int]
    prefill_s: float
    decode_s: float
    step_tokens: list[int] = field(default_factory=list)  # tokens per decode step; empty when unknown

    @property
    def decode_tokens(self) -> int:
        return max(0, len(self.tokens) - 1)


def hf_generate(model, prompt: torch.Tensor, max_new_tokens: int, **kwargs) -> Run:
    """Greedy HF `generate` timed through a StepClock (prefill apart from decode)."""
    clock = StepClock(prompt.device).begin()
    out = model.generate(prompt, max_new_tokens=max_new_tokens, do_sample=False, use_cache=True, streamer=clock,
                         **kwargs)
    if not clock.stop:
        clock.end()
    tokens = out[0, prompt.shape[1]:].tolist()
    return Run(tokens=tokens, prefill_s=clock.prefill_s, decode_s=clock.decode_s, step_tokens=clock.step_tokens)


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens `a` and `b` share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n

"""The benchmark harness: run the AR baseline and an engine over prompts, and record where.

Times exclude prefill (the loops time it separately) and come from the runtime's own clocks,
which synchronise the GPU when there is one.
"""

from __future__ import annotations

import os
import platform
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .. import __version__


@dataclass
class Measurement:
    """AR baseline and engine runs over the benchmark prompts (prefill excluded from times)."""

    prompts: list[list[int]] = field(default_factory=list)
    ar_tokens: list[list[int]] = field(default_factory=list)
    spec_tokens: list[list[int]] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)
    ar_decode_s: float = 0.0
    spec_decode_s: float = 0.0

    @property
    def tau(self) -> float:
        return (sum(self.accepted) + len(self.accepted)) / max(1, len(self.accepted))

    @property
    def ar_ms_per_token(self) -> float:
        return 1e3 * self.ar_decode_s / max(1, sum(map(len, self.ar_tokens)))

    @property
    def spec_ms_per_token(self) -> float:
        return 1e3 * self.spec_decode_s / max(1, sum(map(len, self.spec_tokens)))

    @property
    def speedup(self) -> float:
        return self.ar_ms_per_token / self.spec_ms_per_token if self.spec_ms_per_token else 0.0

    @property
    def matches_ar(self) -> int:
        return sum(a == s for a, s in zip(self.ar_tokens, self.spec_tokens))

    def acceptance_histogram(self, block: int) -> list[int]:
        hist = [0] * (block + 1)
        for a in self.accepted:
            hist[min(a, block)] += 1
        return hist


def measure(engine, baseline, prompts: list[list[int]], max_new_tokens: int, progress=None) -> Measurement:
    """AR greedy on `baseline` (the stock deployment: no passes) beside `engine`'s speculative
    decoding, prompt by prompt. The baseline keeps the checkpoint's weights and kernels, so what a
    pass gains on the target's own step (a weight format, a kernel) shows in the speedup."""
    m = Measurement(prompts=prompts)
    warm = prompts[0][:8] or [0]
    baseline.generate_ar(warm, 4)
    engine.generate(warm, 4)
    for p in prompts:
        ar = baseline.generate_ar(p, max_new_tokens)
        sp = engine.generate(p, max_new_tokens)
        m.ar_tokens.append(ar.tokens)
        m.spec_tokens.append(sp.tokens)
        m.accepted += sp.accepted
        m.ar_decode_s += ar.decode_s
        m.spec_decode_s += sp.decode_s
        if progress:
            progress()
    return m


def _git_commit() -> str:
    """SPECPILOT_COMMIT / GIT_COMMIT where set (a copied tree on a GPU machine), else HEAD."""
    for name in ("SPECPILOT_COMMIT", "GIT_COMMIT"):
        if os.environ.get(name):
            return os.environ[name]
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             cwd=Path(__file__).parent, timeout=5)
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def environment(device: torch.device) -> dict:
    env = {"python": platform.python_version(), "torch": torch.__version__, "specpilot": __version__,
           "commit": _git_commit(), "device": str(device)}
    if device.type == "cuda":
        env["gpu_name"] = torch.cuda.get_device_name(device)
    else:
        env["cpu"] = platform.processor() or platform.machine()
    return env

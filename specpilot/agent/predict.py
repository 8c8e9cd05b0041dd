"""The cost model as the search uses it: to prune, never to decide.

`Predictor` prices a program with the roofline model (`cost.CostModel`) on the device the search
measures on: the spec's GPU, or where trials run on a CPU this host's CPU, every figure measured
here (cost/cpu.py; compiler.cost_device). It prices at the acceptance the search has measured: a
per-position alpha (geometric) from the incumbent's measured τ, and once chain trials of other
draft lengths are measured, the alpha measured nearest the candidate's draft length (`learn_trial`).
Its figure is relative: predicted time per output token over the predicted AR time per token,
which is what the workers measure too (engine ms/token over the AR ms/token measured beside it).
`rank_correlation` says how well predictions order candidates as measurements do (Spearman's rho).

`Calibration` learns from the trials of this deployment: log(measured / predicted) is fitted as a
constant plus one term per pass name the pipeline holds (ridge least squares), so the model learns
what a mechanism does here (CUDA graphs that do not run on a CPU, a block size whose τ differs).
A trial's calibrated prediction is made before it is measured, from earlier trials only: it never
learns from the trial it predicts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ..cost import GPU, AcceptanceModel, CostModel, Estimate, Workload, alpha_for_tau
from ..cost.gaps import WhatIfs, draft_positions, no_what_ifs, step_ops
from ..errors import SpecpilotError
from ..ir import Program

RIDGE = 1.0  # prior weight that pulls each pass's term to 0 (no effect beyond the roofline)


class Predictor:
    def __init__(self, gpu: "str | GPU", what_ifs: WhatIfs = no_what_ifs):
        self.model = CostModel(gpu)
        self.what_ifs = what_ifs
        self.alpha: float | None = None  # from the incumbent's measured τ once there is one
        self.alphas: dict[int, list[float]] = {}  # draft positions -> alphas of the chain trials measured there
        self.version = 0  # bumped by every lesson: predictions cached under an older one are stale

    def learn_tau(self, program: Program, tau: float) -> None:
        """The incumbent's measured τ: the alpha of draft lengths no trial has measured."""
        k = draft_positions(program)
        self.alpha = alpha_for_tau(max(1.0, min(tau, k + 1.0)), k) if k else None
        self.version += 1

    def learn_trial(self, program: Program, tau: float) -> None:
        """A validated trial's measured τ (a chain's): the alpha at its draft length. A drafter's
        acceptance per position is not one number (DFlash's drafter, trained at block 16, accepts
        less per position at block 4), so a candidate is priced at the alpha measured nearest its
        draft length (read linearly between measured lengths), not at the incumbent's."""
        k = draft_positions(program)
        if not k or step_ops(program)["verify"]["mode"] != "chain" or not tau:
            return
        self.alphas.setdefault(k, []).append(alpha_for_tau(max(1.0, min(tau, k + 1.0)), k))
        self.version += 1

    def alpha_at(self, k: int) -> float | None:
        if not self.alphas:
            return self.alpha
        points = sorted((kk, sum(a) / len(a)) for kk, a in self.alphas.items())
        if k <= points[0][0]:
            return points[0][1]
        for (k0, a0), (k1, a1) in zip(points, points[1:]):
            if k <= k1:
                return a0 + (k - k0) / (k1 - k0) * (a1 - a0)
        return points[-1][1]

    def workload(self, program: Program) -> Workload:
        k = draft_positions(program)
        alpha = self.alpha_at(k)
        if alpha is None:
            return Workload()
        return Workload(acceptance=AcceptanceModel.geometric(alpha, k, "measured",
                                                             f"alpha={alpha:.4f} from measured τ"))

    def estimate(self, program: Program) -> Estimate:
        """With gaps and ceiling (the what-ifs): for the round's gap report."""
        return self.model.predict(program, self.workload(program), self.what_ifs)

    def relative(self, program: Program) -> tuple[float, float] | None:
        """(predicted engine s/token, predicted engine / AR per token), or None where the model cannot
        price the program (a plugin's format without bits)."""
        try:
            e = self.model.predict(program, self.workload(program))
        except SpecpilotError:
            return None
        return e.t_token.value, e.t_token.value / e.t_ar.value


@dataclass
class Calibration:
    """log(measured relative / predicted relative) ~ c + sum of per-pass terms, from this deployment's trials."""

    rows: list[tuple[frozenset[str], float]] = field(default_factory=list)  # (pass names, log ratio)

    def add(self, pass_names: frozenset[str], predicted: float, measured: float) -> None:
        if predicted > 0 and measured > 0:
            self.rows.append((pass_names, math.log(measured / predicted)))

    def factor(self, pass_names: frozenset[str]) -> float:
        """measured/predicted expected for a pipeline of these passes (1.0 before any trial)."""
        if not self.rows:
            return 1.0
        names = sorted(set().union(*(r[0] for r in self.rows)))
        index = {n: i + 1 for i, n in enumerate(names)}
        x = torch.zeros((len(self.rows), len(names) + 1), dtype=torch.float64)
        y = torch.tensor([r[1] for r in self.rows], dtype=torch.float64)
        x[:, 0] = 1.0
        for row, (ps, _) in enumerate(self.rows):
            for p in ps:
                x[row, index[p]] = 1.0
        penalty = RIDGE * torch.eye(len(names) + 1, dtype=torch.float64)
        penalty[0, 0] = 1e-6  # the constant is free
        coef = torch.linalg.solve(x.T @ x + penalty, x.T @ y).tolist()
        z = coef[0] + sum(coef[index[p]] for p in pass_names if p in index)
        return float(math.exp(z))


def ranks(xs: list[float]) -> list[float]:
    """1-based ranks of xs, ties given their mean rank."""
    order = sorted(range(len(xs)), key=lambda i: xs[i])
    out = [0.0] * len(xs)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and xs[order[j + 1]] == xs[order[i]]:
            j += 1
        for t in range(i, j + 1):
            out[order[t]] = (i + j) / 2 + 1
        i = j + 1
    return out


def rank_correlation(predicted: list[float], measured: list[float], min_pairs: int = 3) -> float | None:
    """Spearman's rho between two lists (Pearson's correlation of their ranks, ties at mean rank);
    None with fewer than `min_pairs` pairs or where either list is constant."""
    if len(predicted) != len(measured):
        raise ValueError("rank_correlation: lists of different lengths")
    if len(predicted) < min_pairs:
        return None
    a, b = ranks(predicted), ranks(measured)
    ma, mb = sum(a) / len(a), sum(b) / len(b)
    cov = sum((x - ma) * (y - mb) for x, y in zip(a, b))
    va, vb = sum((x - ma) ** 2 for x in a), sum((y - mb) ** 2 for y in b)
    if va == 0 or vb == 0:
        return None
    return cov / math.sqrt(va * vb)

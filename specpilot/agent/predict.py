"""The cost model as the search uses it: to prune, never to decide.

`Predictor` prices a program on the spec's GPU with the roofline model (`cost.CostModel`), at the
acceptance the search has measured: the incumbent's measured τ gives a per-position alpha
(geometric), and every candidate is priced at that alpha over its own draft positions. Its figure
is relative: predicted time per output token over the predicted AR time per token, which is what
the workers measure too (engine ms/token over the AR ms/token measured beside it), so predictions
for a GPU and measurements on another device can be set against each other.

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

from ..cost import AcceptanceModel, CostModel, Estimate, Workload, alpha_for_tau
from ..cost.gaps import WhatIfs, draft_positions, no_what_ifs
from ..errors import SpecpilotError
from ..ir import Program

RIDGE = 1.0  # prior weight that pulls each pass's term to 0 (no effect beyond the roofline)


class Predictor:
    def __init__(self, gpu: str, what_ifs: WhatIfs = no_what_ifs):
        self.model = CostModel(gpu)
        self.what_ifs = what_ifs
        self.alpha: float | None = None  # from the measured τ once there is one

    def learn_tau(self, program: Program, tau: float) -> None:
        k = draft_positions(program)
        self.alpha = alpha_for_tau(max(1.0, min(tau, k + 1.0)), k) if k else None

    def workload(self, program: Program) -> Workload:
        if self.alpha is None:
            return Workload()
        k = draft_positions(program)
        return Workload(acceptance=AcceptanceModel.geometric(self.alpha, k, "measured",
                                                             f"alpha={self.alpha:.4f} from the incumbent's measured τ"))

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

"""Sampling-distribution checks: does a sampled decode keep the target's distribution?

Greedy engines are judged token by token (forcing.py). A sampled one cannot be: any single output
is possible. What must hold is that the distribution of outputs equals autoregressive (AR)
sampling's. Two kinds of check, both over callables so this room imports no runtime:

  exact        `ar_distribution` enumerates the target's distribution over short continuations;
               `chain_step_distribution` and `tree_step_distribution` enumerate what one
               speculative step (then AR) emits, from the acceptance rule under test. Equal up to
               float rounding when the rule is right; a wrong rule shows as a total-variation gap.
  statistical  `chi_square_check`: many seeded runs of a real decode loop against the exact AR
               distribution, Pearson's chi-square with bins merged until each expects >= 5
               samples; it fails when the p-value is below `alpha`, so a correct sampler fails
               with probability about `alpha` over the choice of seeds (the false-alarm rate).
               The seeds are fixed, so a run is deterministic.

Outcomes are tuples of token ids (a continuation of fixed length).
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch

Seq = tuple[int, ...]
NextProbs = Callable[[Seq], torch.Tensor]  # committed continuation -> the target's p [V] after it
DraftProbs = Callable[[Seq, int], torch.Tensor]  # (committed continuation, draft position i) -> q_i [V]
AcceptRule = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (p(d), q(d)) -> acceptance probability
ResidualRule = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (p, q) -> distribution after a rejection
TreeRule = Callable[[Sequence[int]], tuple[list[int], int]]  # a draw per node -> (accepted path, bonus)

DEFAULT_ALPHA = 1e-3  # false-alarm rate of one statistical check
MIN_EXPECTED = 5.0  # expected samples per chi-square bin (Cochran's rule)


@dataclass(frozen=True)
class DistributionCheck:
    """Pearson's chi-square goodness of fit of samples against an exact distribution."""

    samples: int
    bins: int  # after merging
    statistic: float
    dof: int
    p_value: float
    alpha: float
    total_variation: float  # between the empirical and the exact distribution (merged bins), for reading
    impossible: int  # samples of outcomes the exact distribution gives probability 0

    @property
    def passed(self) -> bool:
        return self.impossible == 0 and self.p_value >= self.alpha

    def summary(self) -> str:
        verdict = "matches" if self.passed else "DIFFERS"
        extra = f", {self.impossible} impossible outcomes" if self.impossible else ""
        return (f"{verdict}: chi2={self.statistic:.1f} on {self.dof} dof, p={self.p_value:.3g} (alpha {self.alpha:g}), "
                f"TV={self.total_variation:.4f}, {self.samples} samples in {self.bins} bins{extra}")


def chi_square_sf(statistic: float, dof: int) -> float:
    """P(X >= statistic) for X chi-square with `dof` degrees of freedom (regularized upper gamma)."""
    if dof <= 0:
        return 1.0
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(statistic / 2, dtype=torch.float64)))


def chi_square_check(samples: Iterable[Hashable], expected: Mapping[Hashable, float], *,
                     alpha: float = DEFAULT_ALPHA, min_expected: float = MIN_EXPECTED) -> DistributionCheck:
    """Samples against the exact distribution `expected` (outcome -> probability, summing to 1).

    Bins: outcomes in order of increasing probability are pooled until each pool expects at
    least `min_expected` samples (a last small pool joins the one before it)."""
    if not 0 < alpha < 1:
        raise ValueError(f"alpha must be in (0, 1), got {alpha}")
    counts = Counter(samples)
    n = sum(counts.values())
    if n == 0:
        raise ValueError("no samples")
    impossible = sum(c for o, c in counts.items() if expected.get(o, 0.0) <= 0)
    pools: list[tuple[float, int]] = []  # (expected count, observed count)
    e_acc, o_acc = 0.0, 0
    for outcome, prob in sorted(((o, p) for o, p in expected.items() if p > 0), key=lambda x: (x[1], repr(x[0]))):
        e_acc += prob * n
        o_acc += counts.get(outcome, 0)
        if e_acc >= min_expected:
            pools.append((e_acc, o_acc))
            e_acc, o_acc = 0.0, 0
    if e_acc > 0 or o_acc:
        if pools:
            e_last, o_last = pools.pop()
            pools.append((e_last + e_acc, o_last + o_acc))
        else:
            pools.append((e_acc, o_acc))
    stat = sum((o - e) ** 2 / e for e, o in pools if e > 0)
    tv = 0.5 * sum(abs(o / n - e / n) for e, o in pools) + 0.5 * impossible / n
    dof = len(pools) - 1
    return DistributionCheck(samples=n, bins=len(pools), statistic=stat, dof=dof, p_value=chi_square_sf(stat, dof),
                             alpha=alpha, total_variation=tv, impossible=impossible)


def total_variation(a: Mapping[Hashable, float], b: Mapping[Hashable, float]) -> float:
    """0.5 * sum |a - b| over the union of outcomes."""
    return 0.5 * sum(abs(a.get(o, 0.0) - b.get(o, 0.0)) for o in set(a) | set(b))


def _add(dist: dict[Seq, float], key: Seq, mass: float) -> None:
    if mass > 0:
        dist[key] = dist.get(key, 0.0) + mass


def ar_distribution(next_probs: NextProbs, length: int, start: Seq = ()) -> dict[Seq, float]:
    """Exact distribution of the `length` tokens AR sampling emits after `start` (a continuation
    already committed, included in the keys), by enumeration of every prefix of nonzero mass."""
    dist = {start: 1.0}
    for _ in range(length):
        nxt: dict[Seq, float] = {}
        for seq, mass in dist.items():
            for token, p in enumerate(next_probs(seq).tolist()):
                _add(nxt, seq + (token,), mass * p)
        dist = nxt
    return dist


def _finish_ar(next_probs: NextProbs, dist: dict[Seq, float], length: int) -> dict[Seq, float]:
    """Each sequence of `dist` extended by AR sampling to `length` tokens (cut there if longer)."""
    out: dict[Seq, float] = {}
    for seq, mass in dist.items():
        if len(seq) >= length:
            _add(out, seq[:length], mass)
            continue
        for tail, p in ar_distribution(next_probs, length - len(seq), seq).items():
            _add(out, tail, mass * p)
    return out


def chain_step_distribution(next_probs: NextProbs, draft_probs: DraftProbs, *, k: int, length: int,
                            accept: AcceptRule, residual: ResidualRule, start: Seq = ()) -> dict[Seq, float]:
    """Exact distribution of the first `length` tokens after `start` when one chain step runs first
    (k drafts, draft i drawn from draft_probs(start, i); each accepted with probability
    accept(p(d), q(d)) while all before it were; after a rejection at i a token from
    residual(p_i, q_i), after k acceptances one from p_k), then AR sampling."""
    vocab = next_probs(start).shape[0]
    q = [draft_probs(start, i).double() for i in range(k)]
    step: dict[Seq, float] = {}
    for drafts in itertools.product(range(vocab), repeat=k):
        mass = 1.0
        for i, d in enumerate(drafts):
            mass *= float(q[i][d])
        if mass <= 0:
            continue
        reach = mass  # probability of the drafts and of accepting the first i of them
        for i in range(k + 1):
            p = next_probs(start + drafts[:i]).double()
            if i == k:
                for token, pt in enumerate(p.tolist()):
                    _add(step, start + drafts + (token,), reach * pt)
                break
            a = float(accept(p[drafts[i]], q[i][drafts[i]]))
            for token, r in enumerate(residual(p, q[i]).tolist()):
                _add(step, start + drafts[:i] + (token,), reach * (1 - a) * r)
            reach *= a
            if reach <= 0:
                break
    return _finish_ar(next_probs, step, len(start) + length)


def tree_step_distribution(next_probs: NextProbs, parent: Sequence[int], token: Sequence[int], *, length: int,
                           rule: TreeRule, start: Seq = ()) -> dict[Seq, float]:
    """Exact distribution of the first `length` tokens after `start` when one tree step runs first:
    node 0 is the anchor (its own token is the last committed one and is not emitted), every node
    draws one token from p at its path, independently, and `rule(draws)` says which root path is
    accepted and the bonus; then AR sampling. Enumerates every draw vector of nonzero mass (keep
    trees and vocabularies small: V^nodes)."""
    nodes = len(parent)
    paths: list[Seq] = []
    for i in range(nodes):  # the tokens from the root (excluded) down to node i
        path: list[int] = []
        j = i
        while j > 0:
            path.append(token[j])
            j = parent[j]
        paths.append(tuple(reversed(path)))
    probs = [next_probs(start + paths[i]).double().tolist() for i in range(nodes)]
    support = [[t for t, p in enumerate(row) if p > 0] for row in probs]
    step: dict[Seq, float] = {}
    for draws in itertools.product(*support):
        mass = 1.0
        for i, t in enumerate(draws):
            mass *= probs[i][t]
        path_nodes, bonus = rule(list(draws))
        emitted = tuple(token[j] for j in path_nodes[1:]) + (bonus,)
        _add(step, start + emitted, mass)
    return _finish_ar(next_probs, step, len(start) + length)

"""Accept-length distributions from a per-position model: the math the replay drafter draws from
and the cost model prices with.

A step accepts L drafted tokens (0 <= L <= k, the bonus not counted; τ = 1 + E[L]). Everything here
is a survival function S(i) = P(L >= i), i = 1..k:

  chain    per-position acceptance alpha_i = P(position i accepted | 1..i-1 accepted):
           S(i) = alpha_1 · ... · alpha_i. A published τ alone is read as one alpha for every
           position (geometric), the alpha whose chain of k drafts gives that τ
           (`alpha_for_tau`: τ = 1 + alpha + ... + alpha^k).
  tree     per position i the probability p_{i,r} that the target's token is the drafter's rank-r
           candidate; a node (a rank path r_1..r_d) is accepted with probability prod_j p_{j,r_j}
           (ranks at different depths independent), at most one node a depth is accepted, so
           S(d) = the summed probability of the tree's nodes at depth d. The best-first tree of a
           budget holds the most probable paths (`best_first_paths`, the heap of DDTree/Sequoia).
           Unmeasured rank probabilities are geometric: p_{i,r} = alpha_i (1 - alpha_i)^(r-1).

`AcceptDistribution.draws(n, seed)` gives accept lengths whose running mean approaches E[L] at
O(log n / n) rather than O(1/sqrt(n)): inverse-CDF draws at a golden-ratio (Weyl) sequence
u_j = frac(seed_offset + j·0.618...), low-discrepancy over any run of consecutive draws, so a replay
run of a few hundred steps reproduces a profile's τ within a fraction of a percent.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from typing import Sequence

from ..errors import SpecError

GOLDEN = (math.sqrt(5.0) - 1.0) / 2.0  # 0.618...: the Weyl sequence's step


def tau_for_alpha(alpha: float, k: int) -> float:
    """τ of a chain of k drafted tokens under a geometric acceptance alpha (counts the bonus)."""
    return sum(alpha ** i for i in range(k + 1))  # = (1 - alpha^(k+1)) / (1 - alpha), exact near alpha = 1


def alpha_for_tau(tau: float, k: int) -> float:
    """The geometric alpha whose chain of k drafted tokens reaches τ (1 <= τ <= k + 1)."""
    if k < 1:
        raise SpecError(f"acceptance: a chain needs k >= 1 drafted tokens (got {k})")
    if not 1.0 <= tau <= k + 1:
        raise SpecError(f"acceptance: τ={tau:g} is impossible for chains of {k} drafted tokens (need 1 <= τ <= {k + 1})")
    if tau >= k + 1:
        return 1.0
    lo, hi = 0.0, 1.0
    for _ in range(100):
        mid = 0.5 * (lo + hi)
        if tau_for_alpha(mid, k) < tau:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


def geometric_ranks(alpha: float, width: int) -> tuple[float, ...]:
    """p_r = alpha (1 - alpha)^(r-1), r = 1..width: each lower rank catches the same share of what
    the ranks above it missed."""
    return tuple(alpha * (1.0 - alpha) ** (r - 1) for r in range(1, width + 1))


def best_first_paths(rank_probs: Sequence[Sequence[float]], budget: int) -> list[tuple[float, tuple[int, ...]]]:
    """The `budget` most probable rank paths [(P(accepted), ranks 1-based)], best first, over
    depths 1..len(rank_probs) (rank_probs[d-1][r-1] = p_{d,r}, each row non-increasing). A child
    is never more probable than its parent, nor a sibling than the one ranked above it, so the
    chosen set is a tree and a lazy heap finds it: take the best frontier node, then offer its
    next sibling and its first child."""
    depth = len(rank_probs)
    chosen: list[tuple[float, tuple[int, ...]]] = []
    frontier = [(-rank_probs[0][0], (1,))] if depth >= 1 and rank_probs[0] else []
    while frontier and len(chosen) < budget:
        neg, ranks = heapq.heappop(frontier)
        p = -neg
        if p <= 0.0:
            break
        chosen.append((p, ranks))
        d, r = len(ranks), ranks[-1]
        parent_p = p / rank_probs[d - 1][r - 1]
        if r < len(rank_probs[d - 1]):  # next sibling
            heapq.heappush(frontier, (-parent_p * rank_probs[d - 1][r], ranks[:-1] + (r + 1,)))
        if d < depth:  # first child
            heapq.heappush(frontier, (-p * rank_probs[d][0], ranks + (1,)))
    return chosen


@dataclass(frozen=True)
class AcceptDistribution:
    """P(L >= i) for i = 1..k (non-increasing, in [0, 1]): the accept length of one step."""

    survival: tuple[float, ...]

    def __post_init__(self):
        s = self.survival
        if any(not 0.0 <= x <= 1.0 + 1e-12 for x in s) or any(b > a + 1e-12 for a, b in zip(s, s[1:])):
            raise ValueError(f"a survival function is non-increasing in [0, 1], got {s}")

    @staticmethod
    def chain(alphas: Sequence[float], k: int) -> AcceptDistribution:
        """A chain of k drafts; positions past len(alphas) take the last alpha."""
        out, s = [], 1.0
        for i in range(k):
            s *= alphas[min(i, len(alphas) - 1)] if alphas else 0.0
            out.append(s)
        return AcceptDistribution(tuple(out))

    @staticmethod
    def tree(alphas: Sequence[float], depth: int, budget: int, topk: int) -> AcceptDistribution:
        """The best-first tree of `budget` nodes over `depth` positions, `topk` ranks each, under
        geometric rank probabilities."""
        ranks = [geometric_ranks(alphas[min(i, len(alphas) - 1)], topk) for i in range(depth)]
        at_depth = [0.0] * depth
        for p, path in best_first_paths(ranks, budget):
            at_depth[len(path) - 1] += p
        return AcceptDistribution(tuple(min(1.0, x) for x in at_depth))

    @property
    def k(self) -> int:
        return len(self.survival)

    @property
    def tau(self) -> float:
        """τ = 1 + E[L] (counts the bonus)."""
        return 1.0 + sum(self.survival)

    def probabilities(self) -> list[float]:
        """P(L = n) for n = 0..k."""
        s = [1.0, *self.survival, 0.0]
        return [max(0.0, s[n] - s[n + 1]) for n in range(self.k + 1)]

    def quantile(self, u: float) -> int:
        """The accept length at CDF level u in [0, 1): the smallest n with P(L <= n) > u."""
        cdf = 0.0
        for n, p in enumerate(self.probabilities()):
            cdf += p
            if u < cdf:
                return n
        return self.k

    def draws(self, n: int, seed: int = 0, start: int = 0) -> list[int]:
        """Accept lengths n draws long: draws start..start+n-1 of the seed's low-discrepancy stream."""
        offset = (seed * GOLDEN * math.pi) % 1.0
        return [self.quantile((offset + (start + j) * GOLDEN) % 1.0) for j in range(n)]

"""The acceptance model: how many drafted tokens the target accepts, per step.

The model holds, for each draft position i = 1..K, the conditional acceptance probability
alpha_i = P(position i accepted | positions 1..i-1 accepted) of the drafter's top-1 token, and
optionally, per position, the probabilities p_{i,r} that the target's token is the drafter's
rank-r candidate (r = 1 is top-1, so p_{i,1} = alpha_i). τ counts the bonus token:

    chain of k drafted tokens:  E[accepted] = sum_{i=1..k} prod_{j<=i} alpha_j,   τ = 1 + E[accepted]

A tree of candidates (nodes = rank paths (r_1, ..., r_d), each node's parent a prefix of it) is
accepted along at most one path, so E[accepted] = sum over the tree's nodes of
P(path accepted) = prod_j p_{j, r_j}, taking the ranks at different depths as independent. The
best tree of a budget of N nodes takes the N most probable paths (best-first); every child is at
most as probable as its parent, so that set is a tree.

Sources:
- `from_histogram(counts)`: a measured histogram of accepted lengths (counts[n] = steps that
  accepted n drafted tokens, n = 0..K, the bonus not counted); survival S(i) = P(A >= i) and
  alpha_i = S(i) / S(i-1). Positions past K are not credited (alpha = 0).
- `from_tau(tau, k)`: a τ measured or stated for chains of k drafted tokens, read as a geometric
  model with one alpha for every position, solving τ = (1 - alpha^(k+1)) / (1 - alpha) (bisection;
  τ is increasing in alpha from 1 at alpha = 0 to k + 1 at alpha = 1).
- `from_profile(profile, benchmark)`: a published acceptance profile (specpilot/profiles), its
  per-position alpha over the profile's drafts (the geometric model the profile file states).
- Rank probabilities not measured are assumed: p_{i,r} = alpha_i (1 - alpha_i)^(r-1), i.e. each
  lower-ranked candidate catches the same share alpha_i of the probability the ranks above missed.

The chain and tree math (alpha_for_tau, the best-first heap) lives in specpilot/profiles/acceptance.py,
shared with the replay drafter, so a profile's τ and the cost model's agree by construction.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from ..errors import SpecError
from ..profiles import Profile, alpha_for_tau, best_first_paths, tau_for_alpha


@dataclass(frozen=True)
class AcceptanceModel:
    """Per-position acceptance: `alphas[i-1]` = P(position i accepted | 1..i-1 accepted)."""

    alphas: tuple[float, ...]
    topk: tuple[tuple[float, ...], ...] | None = None  # per position: P(the target's token is rank r)
    source: str = "predicted"  # "measured" when it came from a measured histogram or τ
    note: str = ""

    def __post_init__(self):
        for a in self.alphas:
            if not 0.0 <= a <= 1.0:
                raise SpecError(f"acceptance: per-position acceptance {a!r} is outside [0, 1]")

    # -- construction
    @staticmethod
    def geometric(alpha: float, positions: int, source: str = "predicted", note: str = "") -> "AcceptanceModel":
        return AcceptanceModel(tuple([float(alpha)] * positions), source=source, note=note)

    @staticmethod
    def from_tau(tau: float, k: int, source: str = "measured", note: str = "") -> "AcceptanceModel":
        """The geometric model whose chain of k drafted tokens has this τ (τ counts the bonus token)."""
        alpha = alpha_for_tau(tau, k)
        return AcceptanceModel.geometric(alpha, k, source, note or f"geometric alpha={alpha:.4f} from τ={tau:g} at k={k}")

    @staticmethod
    def from_histogram(counts: Sequence[float], topk: Sequence[Sequence[float]] | None = None,
                       source: str = "measured", note: str = "") -> "AcceptanceModel":
        """From counts[n] = steps that accepted n drafted tokens (n = 0..K, bonus not counted)."""
        total = float(sum(counts))
        if total <= 0 or any(c < 0 for c in counts):
            raise SpecError(f"acceptance histogram {list(counts)!r}: counts must be >= 0 with a positive sum")
        survival = [sum(counts[n:]) / total for n in range(len(counts))]  # S(n) = P(A >= n)
        alphas = tuple(survival[i] / survival[i - 1] if survival[i - 1] > 0 else 0.0 for i in range(1, len(counts)))
        ranks = tuple(tuple(float(p) for p in row) for row in topk) if topk else None
        return AcceptanceModel(alphas, ranks, source, note or f"histogram of {int(total)} steps")

    @staticmethod
    def from_profile(profile: Profile, benchmark: str) -> "AcceptanceModel":
        """The profile's per-position acceptance for `benchmark` over its drafts (ProfileError where
        it gives none). "measured" where the profile's τ is a paper's, "predicted" where modeled."""
        alpha = profile.alpha(benchmark)
        source = "measured" if profile.status in ("published", "secondary") and profile.base is None else "predicted"
        return AcceptanceModel.geometric(alpha, profile.drafts, source,
                                         f"profile {profile.name} ({benchmark}): alpha={alpha:.4f}, {profile.status}")

    # -- chain
    @property
    def positions(self) -> int:
        return len(self.alphas)

    def alpha(self, i: int) -> float:
        """alpha at position i (1-based); 0 past the measured positions."""
        return self.alphas[i - 1] if 1 <= i <= len(self.alphas) else 0.0

    def survival(self, k: int) -> list[float]:
        """[P(A >= 1), ..., P(A >= k)] for a chain of k drafted tokens."""
        out, s = [], 1.0
        for i in range(1, k + 1):
            s *= self.alpha(i)
            out.append(s)
        return out

    def expected_accepted(self, k: int) -> float:
        """E[drafted tokens accepted] for a chain of k."""
        return sum(self.survival(k))

    def tau_chain(self, k: int) -> float:
        """τ = E[accepted + 1] for a chain of k drafted tokens."""
        return 1.0 + self.expected_accepted(k)

    # -- tree
    def rank_probs(self, i: int, width: int) -> tuple[float, ...]:
        """p_{i,r} for r = 1..width: measured where given, else the geometric rank assumption."""
        a = self.alpha(i)
        measured = self.topk[i - 1] if self.topk and i <= len(self.topk) else ()
        out = []
        for r in range(1, width + 1):
            if r <= len(measured):
                out.append(float(measured[r - 1]))
            else:
                out.append(a * (1.0 - a) ** (r - 1) if not measured else 0.0)
        return tuple(out)

    def best_tree(self, budget: int, depth: int, width: int = 8) -> list[tuple[float, tuple[int, ...]]]:
        """The `budget` most probable rank paths of length <= depth: [(P(accepted), ranks)], best first."""
        if depth < 1 or width < 1:
            return []
        return best_first_paths([self.rank_probs(i, width) for i in range(1, depth + 1)], budget)

    def expected_accepted_tree(self, budget: int, depth: int, width: int = 8) -> float:
        """E[drafted tokens accepted] for the best-first tree of `budget` candidates."""
        return sum(p for p, _ in self.best_tree(budget, depth, width))

    def tau_tree(self, budget: int, depth: int, width: int = 8) -> float:
        return 1.0 + self.expected_accepted_tree(budget, depth, width)


__all__ = ["AcceptanceModel", "alpha_for_tau", "tau_for_alpha"]

"""Acceptance profiles: published acceptance of parallel drafters on 8B targets, as data with its sources.

A profile (one YAML file in `data/`) holds what a paper measured for one drafter on one target:
τ (accepted drafts + the bonus per verify step) per benchmark at a stated block size, with the
paper, its arXiv id, the table, and how the numbers were read. Its `model` field states the
per-position model fitted to those τ (a constant acceptance alpha at every draft position, the
alpha whose chain of the profile's drafts reaches the published τ), which is what turns one τ
into a distribution of accept lengths for any chain length or tree budget (acceptance.py).

    profile = load_profile("dflash-qwen3-8b")
    profile.tau("humaneval")                                  # 6.50, as published
    profile.distribution("humaneval", drafts=7).tau           # the same alpha over a block of 8 (modeled)
    profile.distribution("humaneval", drafts=15, budget=64)   # a best-first tree of 64 nodes (modeled)

`status` says how far a profile's numbers can be trusted: "published" (read from the paper),
"secondary" (the paper's table read through public copies that agree), "modeled" (τ derived by the
stated model from another profile: trees whose τ-against-budget table was not reachable) or
"missing" (the source is named, the τ are not entered: the profile cannot be used). Everything
reading τ from a profile (the replay drafter of runtime/replay.py, the cost model's
AcceptanceModel.from_profile, bench/e2e/replay.py) imports this room; it imports nothing of ours
but errors.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

import yaml

from ..errors import SpecpilotError
from .acceptance import AcceptDistribution, alpha_for_tau, best_first_paths, geometric_ranks, tau_for_alpha

KINDS = ("chain", "tree")
STATUSES = ("published", "secondary", "modeled", "missing")
DRAFTER_SHAPES = ("dflash", "pard")


class ProfileError(SpecpilotError):
    """A profile is unknown, malformed, or has no τ to give."""


@dataclass(frozen=True)
class Source:
    paper: str
    arxiv: str
    table: str
    read: str

    def cite(self) -> str:
        return f"{self.paper}, arXiv {self.arxiv}: {self.table}"


@dataclass(frozen=True)
class Profile:
    name: str
    method: str
    kind: str  # "chain": τ per benchmark of chain verification; "tree": τ against a tree budget
    target: str  # the target's shape (hf/known.py)
    drafter: str  # the drafter network's shape: "dflash" or "pard"
    block_size: int  # the block the τ were measured at (DFlash: anchor included; PARD: k)
    status: str
    source: Source
    model: str
    default_benchmark: str
    taus: dict[str, float | None] = field(default_factory=dict)  # chain profiles: the published τ
    speedups: dict[str, float] = field(default_factory=dict)  # what the paper reports beside τ
    base: "Profile | None" = None  # tree profiles: the chain profile their τ are modeled from
    published: dict[str, dict[str, float]] = field(default_factory=dict)  # tree profiles: the figures quoted
    budgets: tuple[int, ...] = ()

    @property
    def drafts(self) -> int:
        """Drafted positions a step at the profile's block: DFlash's block holds the anchor."""
        return drafts_of(self.drafter, self.block_size)

    @property
    def benchmarks(self) -> tuple[str, ...]:
        return tuple((self.base.taus if self.base else self.taus))

    @property
    def usable(self) -> bool:
        return self.status != "missing"

    def check(self, benchmark: str) -> None:
        """ProfileError unless this profile gives a τ for `benchmark`."""
        if not self.usable:
            raise ProfileError(f"profile {self.name!r} has no τ entered yet (status 'missing'; its source: "
                               f"arXiv {self.source.arxiv}, {self.source.table})")
        if benchmark not in self.benchmarks:
            raise ProfileError(f"profile {self.name!r} has no benchmark {benchmark!r} (it has: "
                               f"{', '.join(self.benchmarks)})")

    def tau(self, benchmark: str) -> float:
        """The published τ of a chain at the profile's block (a tree profile: its base's)."""
        self.check(benchmark)
        if self.base is not None:
            return self.base.tau(benchmark)
        return float(self.taus[benchmark])  # type: ignore[arg-type]

    def alpha(self, benchmark: str) -> float:
        """The per-position acceptance fitted to the benchmark's τ (the file's `model`)."""
        if self.base is not None:
            return self.base.alpha(benchmark)
        return alpha_for_tau(self.tau(benchmark), self.drafts)

    def distribution(self, benchmark: str, *, drafts: int, budget: int | None = None,
                     topk: int = 4) -> AcceptDistribution:
        """Accept lengths of one step: a chain of `drafts` positions, or (with `budget`) the
        best-first tree of `budget` nodes over `drafts` positions from the top-`topk` of each."""
        alpha = self.alpha(benchmark)
        if budget is None:
            return AcceptDistribution.chain([alpha], drafts)
        return AcceptDistribution.tree([alpha], drafts, budget, topk)

    def tau_source(self, drafts: int, budget: int | None) -> str:
        """"published" where the distribution's τ is the paper's own number (a chain at the
        profile's block of a published or secondary profile), else "modeled"."""
        exact = budget is None and self.base is None and drafts == self.drafts
        return "published" if exact and self.status in ("published", "secondary") else "modeled"


def drafts_of(drafter: str, block_size: int) -> int:
    """Drafted positions a step: a DFlash block holds the anchor, a PARD step drafts k."""
    return block_size - 1 if drafter == "dflash" else block_size


def _fail(name: str, what: str) -> ProfileError:
    return ProfileError(f"specpilot/profiles/data/{name}.yaml: {what}")


def _text(doc: dict, key: str, name: str) -> str:
    value = doc.get(key)
    if not isinstance(value, str) or not value.strip():
        raise _fail(name, f"field {key!r}: expected text, got {value!r}")
    return " ".join(value.split())


def _parse(name: str, doc: Any) -> Profile:
    if not isinstance(doc, dict):
        raise _fail(name, "expected a mapping")
    if doc.get("name") != name:
        raise _fail(name, f"field 'name' is {doc.get('name')!r}; expected the file's name {name!r}")
    src = doc.get("source")
    if not isinstance(src, dict):
        raise _fail(name, "field 'source': expected a mapping of paper, arxiv, table, read")
    source = Source(*(_text(src, k, name) for k in ("paper", "arxiv", "table", "read")))
    kind, status, drafter = doc.get("kind"), doc.get("status"), doc.get("drafter")
    if kind not in KINDS or status not in STATUSES or drafter not in DRAFTER_SHAPES:
        raise _fail(name, f"kind/status/drafter {kind!r}/{status!r}/{drafter!r}: expected one of {KINDS}, "
                          f"{STATUSES}, {DRAFTER_SHAPES}")
    block = doc.get("block_size")
    if not isinstance(block, int) or isinstance(block, bool) or drafts_of(drafter, block) < 1:
        raise _fail(name, f"field 'block_size' is {block!r}; expected a block of at least one draft")
    common = dict(name=name, method=_text(doc, "method", name), kind=kind, target=_text(doc, "target", name),
                  drafter=drafter, block_size=block, status=status, source=source, model=_text(doc, "model", name),
                  default_benchmark=_text(doc, "default_benchmark", name))
    if kind == "tree":
        base = load_profile(_text(doc, "base", name))
        if base.kind != "chain" or base.target != common["target"]:
            raise _fail(name, f"field 'base': {base.name!r} is no chain profile of the same target")
        published = {b: {k: float(v) for k, v in row.items()} for b, row in (doc.get("published") or {}).items()}
        profile = Profile(**common, base=base, published=published, budgets=tuple(doc.get("budgets") or ()))
    else:
        rows = doc.get("benchmarks")
        if not isinstance(rows, dict) or not rows:
            raise _fail(name, "field 'benchmarks': expected a mapping of benchmark -> {tau, speedup}")
        taus, speedups = {}, {}
        most = drafts_of(drafter, block) + 1
        for bench, row in rows.items():
            tau = (row or {}).get("tau")
            if tau is None and status != "missing":
                raise _fail(name, f"benchmarks.{bench}.tau is empty but status is {status!r} (expected 'missing')")
            if tau is not None and not (isinstance(tau, (int, float)) and 1.0 <= tau <= most):
                raise _fail(name, f"benchmarks.{bench}.tau is {tau!r}; expected a τ in [1, {most}] (block {block})")
            taus[bench] = None if tau is None else float(tau)
            if (row or {}).get("speedup") is not None:
                speedups[bench] = float(row["speedup"])
        profile = Profile(**common, taus=taus, speedups=speedups)
    if profile.usable and profile.default_benchmark not in profile.benchmarks:
        raise _fail(name, f"field 'default_benchmark': {profile.default_benchmark!r} is not among its benchmarks")
    return profile


def profile_names() -> list[str]:
    """Every profile in specpilot/profiles/data, by name."""
    data = resources.files(__package__) / "data"
    return sorted(p.name.removesuffix(".yaml") for p in data.iterdir() if p.name.endswith(".yaml"))


@functools.lru_cache(maxsize=None)
def load_profile(name: str) -> Profile:
    """The profile `name` (ProfileError listing the names where there is none)."""
    if name not in profile_names():
        raise ProfileError(f"no acceptance profile {name!r} (profiles: {', '.join(profile_names())})")
    text = (resources.files(__package__) / "data" / f"{name}.yaml").read_text(encoding="utf-8")
    return _parse(name, yaml.safe_load(text))


__all__ = ["AcceptDistribution", "DRAFTER_SHAPES", "KINDS", "Profile", "ProfileError", "STATUSES", "Source",
           "alpha_for_tau", "best_first_paths", "drafts_of", "geometric_ranks", "load_profile", "profile_names",
           "tau_for_alpha"]

"""Replay drafting for the batched engine: per-request plans, so 8B-shaped runs accept as a profile says.

The batch-1 replay drafter (runtime/replay.py) reads one plan by absolute position. In a batch each
request needs its own: `BatchReplay` keeps a plan row per KV slot (truth tokens and planned bonus
positions by absolute position), loaded when a request first drafts in that slot, and overwrites
the drafted logits as ReplayPlan.overwrite does (the truth raised to rank 1, or at a planned bonus
position pushed below every logit), all on the device: it is the batched engine's `draft_hook`.

A request's plan: truth = its prompt + a guess of its greedy output (the batch-1 engine's, or
batched AR's), bonus positions from accept lengths drawn from the profile's distribution. Where the
guess differs from what the batched verify picks (a bf16 near-tie resolved differently), the run
accepts less than planned: the measured τ is reported beside the profile's, never assumed. When
verify-budget or spec-control verify fewer drafts than drawn, the step stops early and the next
one continues along the same plan.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specpilot.profiles import AcceptDistribution
from specpilot.runtime.replay import LOWER, RAISE


class BatchReplay:
    def __init__(self, distribution: AcceptDistribution, *, slots: int, size: int, device: torch.device | str,
                 seed: int = 0) -> None:
        self.distribution = distribution
        self.size = size
        self.seed = seed
        self.drawn = 0
        self.truth = torch.zeros(slots, size, dtype=torch.long, device=device)
        self.bonus = torch.zeros(slots, size, dtype=torch.bool, device=device)
        self.loaded: dict[int, object] = {}  # slot -> the request whose plan it holds
        self.guesses: dict[tuple[int, ...], list[int]] = {}

    def suggest(self, prompt: Sequence[int], guess: Sequence[int]) -> None:
        """The output a prompt's plan follows (its greedy continuation as best known)."""
        self.guesses[tuple(prompt)] = list(guess)

    def plan(self, prompt: Sequence[int]) -> tuple[list[int], list[int]]:
        """(truth by position, planned bonus positions) of a new request on `prompt`."""
        guess = self.guesses.get(tuple(prompt), [])
        truth = (list(prompt) + guess)[: self.size]
        anchor, bonus = len(prompt), []
        while anchor < self.size:
            n = self.distribution.draws(1, self.seed, start=self.drawn)[0]
            self.drawn += 1
            anchor += n + 1
            bonus.append(anchor)
        return truth, [b for b in bonus if b < self.size]

    def load(self, slot: int, prompt: Sequence[int]) -> None:
        truth, bonus = self.plan(prompt)
        row = torch.zeros(self.size, dtype=torch.long)
        row[: len(truth)] = torch.tensor(truth, dtype=torch.long)
        flags = torch.zeros(self.size, dtype=torch.bool)
        flags[bonus] = True
        self.truth[slot].copy_(row)
        self.bonus[slot].copy_(flags)

    def __call__(self, logits: torch.Tensor, reqs, first: list[int]) -> torch.Tensor:
        """The batched engine's draft hook: logits [B, k, V] of requests `reqs`, row j of request b
        drafting absolute position first[b] + j."""
        for q in reqs:
            if self.loaded.get(q.slot) is not q:  # a new request in this slot (rids may repeat)
                self.load(q.slot, q.prompt)
                self.loaded[q.slot] = q
        b, k, _ = logits.shape
        dev = logits.device
        slots = torch.tensor([q.slot for q in reqs], device=dev)
        pos = (torch.tensor(first, device=dev)[:, None] + torch.arange(k, device=dev)[None]).clamp_(max=self.size - 1)
        tok = self.truth[slots[:, None], pos]
        value = torch.where(self.bonus[slots[:, None], pos], LOWER, RAISE).to(logits.dtype)
        return logits.scatter_(-1, tok[..., None], value[..., None])

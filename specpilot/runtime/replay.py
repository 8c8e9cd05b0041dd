"""Replay drafters: a real drafter network whose proposal is overwritten to follow an acceptance profile.

A replay drafter runs the drafter network of its shape (DFlash or PARD, random weights) so that every
step pays the true drafting cost, then overwrites the logits it returns: at each drafted position
the target's own greedy token is raised far above every other logit (rank 1) or pushed below them
all (out of any top-k), so that a chain's argmax, or the best-first tree built from the top-k, is
correct up to an accept length drawn from a profile (specpilot/profiles) and wrong right after it.
For trees the correct prefix is the tree's top-1 spine; the rest of the budget fills with the
network's own candidates, which never match. The decode loops are the stock ones (decode,
tree_decode, graph_decode): they cannot tell a replay drafter from a trained one, and every output
token is still the target's verify argmax, so token forcing checks a replay run like any other.

The plan is data on the device, indexed by absolute sequence position: `truth[p]` the token at
position p (the prompt, then the greedy continuation), `bonus[p]` whether p is a planned bonus
position (the first position a step must not accept). A drafted row at position p gets truth[p]
raised unless bonus[p], lowered if so. The anchor a step drafts from is the target cache's length,
so a step whose anchor is a_s accepts exactly up to the next bonus position a_{s+1} = a_s + L_s + 1.
Nothing in the overwrite reads the host: three small kernels (gather, where, scatter) inside the
drafter's forward, so graphed loops capture it like the rest of the step.

The truth must be the target's greedy continuation *as the engine verifies it*: with random bf16
weights many logits are near-ties, and a verify of 16 rows rounds differently from a step of one,
so an AR run's tokens are not the engine's. `Replay.generate` therefore plans by fixed point: it
runs the engine's own loop with the plan, and where a step accepted other than planned (its verify
chose differently from the guess), it takes that run's output as the new guess and runs again.
Each run fixes the first place it went off plan, so a few runs settle (one per near-tie the
verify resolves differently); the run that matches its plan is the one returned, timed by the
loop's own clocks like any generation. Accept lengths come from the profile's distribution for
the program's chain length or tree budget, as a low-discrepancy stream (AcceptDistribution.draws)
continued across prompts, so a run's τ follows the profile closely.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from specpilot.hf.config import DrafterConfig, ModelConfig
from specpilot.profiles import AcceptDistribution
from specpilot.runtime.cache import KVCache
from specpilot.runtime.decode import Generation
from specpilot.runtime.dflash import DFlashDrafter
from specpilot.runtime.model import ModelOutput, Transformer

RAISE = 1.0e4  # far above any logit of a real head (the truth becomes rank 1, log-probability ~0)
LOWER = -1.0e4  # below every real logit: out of any top-k a tree takes (draft-vocab's -inf stay below it)


class ReplayPlan:
    """The plan a replay drafter reads: truth and bonus flags of `size` absolute positions, on the device.

    The buffers are allocated once and reloaded in place (`load`), so a CUDA graph captured over a
    drafter that reads them stays valid for every prompt."""

    def __init__(self, size: int, device: torch.device | str) -> None:
        self.size = size
        self.truth = torch.zeros(size, dtype=torch.long, device=device)
        self.bonus = torch.zeros(size, dtype=torch.bool, device=device)
        self.rows = torch.arange(size, device=device)

    def load(self, tokens: Sequence[int], bonus_positions: Sequence[int]) -> None:
        """truth[p] = tokens[p] (0 past them); bonus[p] for each p of `bonus_positions`."""
        if len(tokens) > self.size:
            raise ValueError(f"a replay plan of {len(tokens)} positions exceeds the {self.size} it holds")
        truth = torch.zeros(self.size, dtype=torch.long)
        truth[: len(tokens)] = torch.as_tensor(list(tokens), dtype=torch.long)
        bonus = torch.zeros(self.size, dtype=torch.bool)
        bonus[[p for p in bonus_positions if p < self.size]] = True
        self.truth.copy_(truth)
        self.bonus.copy_(bonus)

    def overwrite(self, logits: torch.Tensor, first: int | torch.Tensor) -> torch.Tensor:
        """logits [B, R, V], row r drafting absolute position first + r: the truth raised or lowered
        in place (device ops only; `first` may be a device tensor)."""
        b, r, _ = logits.shape
        pos = (self.rows[:r] + first).clamp_(max=self.size - 1)
        tok = self.truth.index_select(0, pos)
        raise_or_lower = torch.where(self.bonus.index_select(0, pos), LOWER, RAISE).to(logits.dtype)
        return logits.scatter_(-1, tok.view(1, r, 1).expand(b, r, 1), raise_or_lower.view(1, r, 1).expand(b, r, 1))


class ReplayDFlash(DFlashDrafter):
    """A DFlash drafter whose drafts follow `plan`: the block's row j drafts position anchor + j + 1,
    the anchor's position being the cache length once the new context is added."""

    def __init__(self, cfg: DrafterConfig, embed, head, plan: ReplayPlan) -> None:
        super().__init__(cfg, embed, head)
        self.plan = plan

    def forward(self, block_ids: torch.Tensor, new_context_hidden: torch.Tensor, cache: KVCache,
                count: torch.Tensor | None = None) -> torch.Tensor:
        logits = super().forward(block_ids, new_context_hidden, cache, count)
        return self.plan.overwrite(logits, cache.length + 1)


class ReplayCausalLM(Transformer):
    """A PARD drafter's causal LM whose drafts follow `plan`: row r of a forward drafts position
    start + r + 1 (start: the cache length before it). A prefill (only_last) is left alone."""

    def __init__(self, cfg: ModelConfig, plan: ReplayPlan) -> None:
        super().__init__(cfg)
        self.plan = plan

    def forward(self, input_ids: torch.Tensor, cache: KVCache, **kwargs) -> ModelOutput:
        start = cache.length.clone() if torch.is_tensor(cache.length) else cache.length
        out = super().forward(input_ids, cache, **kwargs)
        if not kwargs.get("only_last"):
            out.logits = self.plan.overwrite(out.logits, start + 1)
        return out


@dataclass
class PromptPlan:
    """One prompt's plan: the accept length of each step and the guess of the output it was planned on."""

    accepts: list[int]
    tokens: list[int]
    runs: int = 0  # engine runs it took to settle
    settled: bool = False

    def bonus_positions(self, prompt_len: int) -> list[int]:
        """The planned anchors after the first: a_1 = prompt_len (the prefill's token), a_{s+1} = a_s + L_s + 1."""
        out, anchor = [], prompt_len
        for n in self.accepts:
            anchor += n + 1
            out.append(anchor)
        return out

    def matches(self, gen: Generation) -> bool:
        """The run went as planned: its output is the guess, and every step but the last (cut by
        max_new_tokens or EOS) accepted its planned length."""
        steps = gen.accepted[:-1]
        return gen.tokens == self.tokens[: len(gen.tokens)] and steps == self.accepts[: len(steps)]


@dataclass
class Replay:
    """The replay side of an engine: the plan its drafter reads, the accept-length distribution of
    its program (chain length or tree budget), the draw stream, and the plans made per prompt."""

    plan: ReplayPlan
    distribution: AcceptDistribution
    seed: int = 0
    label: str = ""  # the profile and benchmark, for reports
    max_runs: int = 64  # a plan that has not settled after this many engine runs is used as it stands
    plans: dict[tuple, PromptPlan] = field(default_factory=dict)
    guesses: dict[tuple, list[int]] = field(default_factory=dict)
    drawn: int = 0  # draws taken from the stream of counted steps so far
    tail_drawn: int = 0  # and from the stream of the steps near an end

    def reconfigured(self, distribution: AcceptDistribution) -> Replay:
        """The same plan buffers under another distribution (another chain length or tree budget),
        with a fresh stream and no plans."""
        return Replay(self.plan, distribution, self.seed, self.label, self.max_runs)

    def suggest(self, prompt_ids: Sequence[int], tokens: Sequence[int]) -> None:
        """A first guess of `prompt_ids`' output (an AR run's): spares the plan the run that finds it."""
        self.guesses[tuple(prompt_ids)] = list(tokens)

    def _draw(self, max_new_tokens: int) -> list[int]:
        """Accept lengths until the steps' tokens (each L + 1, after the prefill's one) reach
        max_new_tokens. A step that begins k + 1 tokens or more before the end (one `uncut` counts)
        takes the next draw of the seed's stream; one nearer the end, which the end may cut, takes
        its draw from a second stream, so the counted steps read one unbroken run of the first:
        their mean then follows the profile at the stream's low discrepancy."""
        accepts, produced = [], 1
        while produced < max_new_tokens:
            if max_new_tokens - produced >= self.distribution.k + 1:
                n = self.distribution.draws(1, self.seed, start=self.drawn)[0]
                self.drawn += 1
            else:
                n = self.distribution.draws(1, self.seed + 1, start=self.tail_drawn)[0]
                self.tail_drawn += 1
            accepts.append(n)
            produced += n + 1
        return accepts

    def generate(self, prompt_ids: Sequence[int], max_new_tokens: int,
                 run: Callable[[], Generation]) -> Generation:
        """The engine's `run` (its decode loop on this prompt) under this prompt's plan, re-planned
        until a run goes as planned (module docstring); that run is returned."""
        key = (tuple(prompt_ids), max_new_tokens)
        plan = self.plans.get(key)
        if plan is None:
            plan = PromptPlan(self._draw(max_new_tokens), list(self.guesses.get(key[0], [])))
            self.plans[key] = plan
        prompt = list(prompt_ids)
        while True:
            self.plan.load(prompt + plan.tokens, plan.bonus_positions(len(prompt)))
            gen = run()
            plan.runs += 1
            if plan.matches(gen) or plan.runs >= self.max_runs:
                plan.settled = plan.matches(gen)
                return gen
            plan.tokens = list(gen.tokens)

    def uncut(self, accepted: Sequence[int], max_new_tokens: int) -> list[int]:
        """The steps of one run that began at least k + 1 tokens before its end (k: the most a step
        accepts), which no end could cut. Dropping just the steps the end did cut would bias τ low:
        a long step is the likelier to reach the end. Which steps count depends only on where each
        began, not on its own length, so their mean is unbiased."""
        out, produced = [], 1
        for n in accepted:
            if max_new_tokens - produced < self.distribution.k + 1:
                break
            out.append(n)
            produced += n + 1
        return out

    def summary(self, runs: Sequence[tuple[Sequence[int], int]]) -> dict:
        """The profile's τ for this program beside the τ measured over `runs` ((per-step accepted
        drafts, max_new_tokens) of each prompt's run): over the steps no end could cut (`uncut`),
        which is what a profile describes, and over every step (None where no step counts: outputs
        shorter than a block give none)."""
        counted = [n for accepted, m in runs for n in self.uncut(accepted, m)]
        every = [n for accepted, _ in runs for n in accepted]
        drawn = [n for (prompt, m), p in self.plans.items() for n in self.uncut(p.accepts, m)]
        tau = lambda xs: round(1.0 + sum(xs) / len(xs), 4) if xs else None  # noqa: E731
        profile_tau, measured = self.distribution.tau, tau(counted)
        ratio = None if measured is None else round(measured / profile_tau, 4)
        return {"profile": self.label, "profile_tau": round(profile_tau, 4), "drawn_tau": tau(drawn),
                "measured_tau": measured, "measured_tau_all_steps": tau(every), "measured_over_profile": ratio,
                "within_3pct": None if ratio is None else bool(abs(ratio - 1.0) <= 0.03),
                "steps_counted": len(counted), "steps": len(every),
                "plans_settled": f"{sum(p.settled for p in self.plans.values())}/{len(self.plans)}",
                "engine_runs": sum(p.runs for p in self.plans.values())}

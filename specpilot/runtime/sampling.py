"""Lossless speculative sampling: temperature / top-p sampling that keeps the target's distribution.

Greedy decoding (temperature 0) never comes here: it stays token-forced (decode.py). With
temperature > 0 every emitted token must be distributed exactly as autoregressive (AR) sampling
from the target would emit it, p = top_p(softmax(logits / T)), whatever the drafter proposes.
The proofs are in docs/SAMPLING.md; the statistical and exact checks in specpilot/validate/sampling.py
and tests/test_sampling.py. Two schemes:

  chains   rejection sampling (Leviathan et al. 2023, Chen et al. 2023). Draft i is sampled from the
           drafter's distribution at its position, q_i (a parallel drafter gives one per position:
           DFlash, PARD); it is accepted with probability min(1, p_i(d)/q_i(d)) while all before it
           were; at the first rejection the token is drawn from norm(max(0, p_i - q_i)); when all k
           are accepted the bonus is drawn from p_k.
  trees    candidate trees are deterministic (top-k of the drafter, tree.py), so each node's
           drafts are point masses: recursive rejection sampling over a node's children with
           q = delta(child) accepts child c with probability p(c) / (1 - sum of earlier siblings'
           p) and finally draws from p without the children, which is exactly "draw x ~ p at the
           node, follow the child whose token is x, else emit x as the bonus". So each tree node
           gets one independent draw from its own p (`sample_tokens`), and the greedy tree
           acceptance (tree.accept_tree / graph_decode.accept_tree_on_device) runs on the draws in
           place of the argmax.

Randomness is counter-based (`uniforms`): a 32-bit integer hash of (seed, step, stream, index),
written in int64 tensor ops, so it runs on any device, inside a CUDA graph (the step counter is a
device tensor) and gives the same numbers on CPU and GPU. Uniforms have 24 bits: an acceptance
probability is compared at 2^-24 resolution. Distributions are float64: the inverse-CDF draw over a
150k vocabulary then errs by far less than any test could see.
"""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass

import torch

MASK32 = 0xFFFFFFFF
# streams: what a step's uniforms are for (one hash input, so draws for different purposes never coincide)
STREAM_FIRST, STREAM_DRAFT, STREAM_ACCEPT, STREAM_BONUS, STREAM_TREE = 1, 2, 3, 4, 5


@dataclass(frozen=True)
class SamplingParams:
    """How tokens are chosen: temperature 0 is greedy (the default, token-forced); above 0 tokens
    are sampled from top_p(softmax(logits / temperature)), reproducibly for a given seed."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature)
                and self.temperature >= 0):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed < 2**64:
            raise ValueError(f"seed must be an integer in [0, 2**64), got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


GREEDY = SamplingParams()


def request_sampling(temperature: float, top_p: float, seed: int | None) -> SamplingParams:
    """A request's sampling (engine_api.RequestParams' fields): greedy at temperature 0; else its
    seed, or a random one without, taken modulo 2^64 so negative seeds are seeds too."""
    if temperature == 0:
        return GREEDY
    seed = secrets.randbits(64) if seed is None else seed % 2**64
    return SamplingParams(temperature=temperature, top_p=top_p, seed=seed)


def probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """float64 [..., V]: softmax(logits / T) restricted to its top-p nucleus (the fewest most likely
    tokens whose mass reaches top_p; ties broken by the sort) and renormalised. What AR sampling
    draws from, and what the drafter's q is made of."""
    if params.greedy:
        raise ValueError("probabilities() is for temperature > 0; greedy decoding takes the argmax")
    return probabilities_at(logits, params.temperature, params.top_p)


def probabilities_at(logits: torch.Tensor, temperature: float | torch.Tensor,
                     top_p: float | torch.Tensor) -> torch.Tensor:
    """`probabilities` with the temperature and top_p as numbers, or as float64 tensors of logits'
    leading shape (one per row: the requests of a batch, each its own)."""
    row = (lambda v: v) if isinstance(temperature, (int, float)) else (lambda v: v.unsqueeze(-1))
    probs = torch.softmax(logits.double() / row(temperature), dim=-1)
    if isinstance(top_p, (int, float)):
        return probs if top_p >= 1 else nucleus(probs, top_p)
    top = top_p.unsqueeze(-1)
    return torch.where(top >= 1, probs, nucleus(probs, top))


def nucleus(probs: torch.Tensor, top_p: float | torch.Tensor) -> torch.Tensor:
    """probs [..., V] cut to each row's top-p nucleus and renormalised (top_p a number or [..., 1])."""
    sorted_p, order = probs.sort(dim=-1, descending=True)
    before = sorted_p.cumsum(-1) - sorted_p  # mass of the tokens ranked above each one
    keep_sorted = before < top_p  # the top token is always kept
    keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
    kept = torch.where(keep, probs, torch.zeros_like(probs))
    return kept / kept.sum(-1, keepdim=True)


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """x * c mod 2^32 for x in [0, 2^32), without int64 overflow (16-bit halves of c)."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & MASK32


def hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer mix (lowbias32, C. Wellons): int64 values in [0, 2^32) -> [0, 2^32)."""
    x = x & MASK32
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def seed_key(seed: int, device: torch.device | str) -> torch.Tensor:
    """A 0-dim int64 key for a 64-bit seed: both halves hashed in."""
    lo, hi = seed & MASK32, (seed >> 32) & MASK32
    return hash32(hash32(torch.tensor(lo, device=device)) ^ torch.tensor(hi, device=device))


def uniforms(key: torch.Tensor, step: torch.Tensor | int, stream: int, n: int) -> torch.Tensor:
    """float64 [n] in (0, 1), a function of (key, step, stream, index) alone: the same on every
    device, and with `step` a device tensor, fit for CUDA-graph capture. With keys and steps [B]
    (requests of a batch, each its own seed and step), [B, n]: row b is uniforms(key[b], step[b])."""
    index = torch.arange(n, device=key.device, dtype=torch.long)
    step = torch.as_tensor(step, device=key.device)
    h = hash32(key[..., None] ^ hash32(step[..., None] + (stream << 28)))
    h = hash32(h ^ hash32(index + 0x9E3779B9))
    return ((h >> 8).double() + 0.5) / float(1 << 24)


def sample_tokens(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One draw a row by the inverse CDF: probs [R, V] (rows sum to 1, or any positive mass), u [R]
    in (0, 1) -> int64 [R]. A token of zero probability is never drawn."""
    cdf = probs.cumsum(-1)
    pick = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None].to(cdf.dtype), right=True)[:, 0]
    return pick.clamp(max=probs.shape[-1] - 1)


def acceptance_probability(p_draft: torch.Tensor, q_draft: torch.Tensor) -> torch.Tensor:
    """min(1, p(d) / q(d)) for drafts d drawn from q (so q(d) > 0)."""
    return (p_draft / q_draft.clamp(min=torch.finfo(q_draft.dtype).tiny)).clamp(max=1.0)


def residual_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)) row-wise; where p == q (no mass left: a rejection cannot happen) p itself."""
    r = (p - q).clamp(min=0)
    mass = r.sum(-1, keepdim=True)
    return torch.where(mass > 0, r / mass.clamp(min=torch.finfo(r.dtype).tiny), p)


@dataclass
class StepRandom:
    """The uniforms of one generation: a seed key and a step counter, both device tensors."""

    key: torch.Tensor
    step: torch.Tensor

    @classmethod
    def for_seed(cls, seed: int, device: torch.device | str) -> StepRandom:
        return cls(seed_key(seed, device), torch.zeros((), dtype=torch.long, device=device))

    def reset(self, seed: int) -> None:
        """Start over with `seed` (in place: a captured graph keeps reading these tensors)."""
        self.key.copy_(seed_key(seed, self.key.device))
        self.step.zero_()

    def draw(self, stream: int, n: int) -> torch.Tensor:
        return uniforms(self.key, self.step, stream, n)

    def advance(self) -> None:
        self.step += 1


def sample_first(logits: torch.Tensor, params: SamplingParams, rng: StepRandom) -> torch.Tensor:
    """The token after the prompt (logits [V]), drawn from p; int64 [1]."""
    return sample_tokens(probabilities(logits[None], params), rng.draw(STREAM_FIRST, 1))


def first_token(logits: torch.Tensor, params: SamplingParams, rng: StepRandom | None) -> int:
    """The token after the prompt from the prefill's last logits [V], as the eager loops take it: the
    argmax where greedy (`rng` None), else drawn from p, and `rng` moved on to the next step."""
    if rng is None:
        return int(logits.argmax())
    token = int(sample_first(logits, params, rng)[0])
    rng.advance()
    return token


def draft_chain(draft_logits: torch.Tensor, params: SamplingParams, rng: StepRandom
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Drafter logits [k, V] -> (drafts [k], each drawn from its position's q_i, and q [k, V])."""
    q = probabilities(draft_logits, params)
    return sample_tokens(q, rng.draw(STREAM_DRAFT, q.shape[0])), q


def accept_chain(drafts: torch.Tensor, q: torch.Tensor, target_logits: torch.Tensor, params: SamplingParams,
                 rng: StepRandom) -> tuple[torch.Tensor, torch.Tensor]:
    """Rejection sampling of a chain, on the device: drafts [k] drawn from q [k, V]; the target's
    logits [k+1, V] at [last token, d1..dk]. Returns (n, span) as graph_decode.accept_on_device
    does: n (0-dim) drafts accepted, span [k+1] = drafts[:n], then the token drawn at position n
    (from the residual after a rejection, from p_k after k acceptances); entries after n don't-care.
    (`accept_chains` of one request.)"""
    k = drafts.shape[0]
    n, token = accept_chains(drafts[None], k, q[None], target_logits[None], params.temperature, params.top_p,
                             rng.key.view(1), rng.step.view(1))
    span = torch.cat([drafts, drafts[:1]]).index_copy_(0, n, token)
    return n[0], span


def accept_chains(drafts: torch.Tensor, counts: int | torch.Tensor, q: torch.Tensor, target_logits: torch.Tensor,
                  temperature: float | torch.Tensor, top_p: float | torch.Tensor, key: torch.Tensor,
                  step: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rejection sampling of B chains at once, on the device, each with its own temperature, top_p,
    seed key and step ([B] tensors, or numbers for all): request b verified its first counts[b] of
    drafts [B, K] (drawn from q [B, K, V]); target_logits [B, K+1, V] at [last token, d1..dK] (rows
    past counts[b] don't-care). Returns (n [B] drafts accepted, token [B] drawn at position n: from
    the residual after a rejection, from p at counts[b] after counts[b] acceptances). A request with
    no drafts takes an AR step: its token drawn as generate_ar draws one (stream FIRST)."""
    b, kk = drafts.shape
    temp = temperature if isinstance(temperature, (int, float)) else temperature[:, None]
    top = top_p if isinstance(top_p, (int, float)) else top_p[:, None]
    p = probabilities_at(target_logits, temp, top)  # [B, K+1, V]
    j = torch.arange(kk, device=drafts.device)
    limit = counts if isinstance(counts, int) else counts[:, None]
    at = drafts[..., None]
    accept = acceptance_probability(p[:, :kk].gather(2, at)[..., 0], q.gather(2, at)[..., 0])
    ok = (uniforms(key, step, STREAM_ACCEPT, kk) < accept) & (j < limit)
    n = torch.cumprod(ok.long(), 1).sum(1)  # [B]
    rows = torch.arange(b, device=drafts.device)
    at_p = p[rows, n]  # [B, V]: p at position n (the bonus row when n == counts)
    if kk:
        residual = residual_distribution(p[rows, n.clamp(max=kk - 1)], q[rows, n.clamp(max=kk - 1)])
        at_p = torch.where((n < counts)[:, None], residual, at_p)
    u = uniforms(key, step, STREAM_BONUS, 1)[:, 0]
    if isinstance(counts, int):
        u = uniforms(key, step, STREAM_FIRST, 1)[:, 0] if counts == 0 else u
    else:
        u = torch.where(counts == 0, uniforms(key, step, STREAM_FIRST, 1)[:, 0], u)
    return n, sample_tokens(at_p, u)


def tree_draws(target_logits: torch.Tensor, params: SamplingParams, rng: StepRandom) -> torch.Tensor:
    """One independent draw from p at every tree node (logits [n, V] -> int64 [n]): what the tree
    acceptance follows in place of the argmax (module docstring)."""
    p = probabilities(target_logits, params)
    return sample_tokens(p, rng.draw(STREAM_TREE, p.shape[0]))

"""Greedy decode loops: autoregressive, PARD-style and DFlash-style speculative decoding.

Every loop is lossless: its output equals AR greedy token for token (the tests check it in fp32).
In bf16 the verify forward (q = k+1) and AR's (q = 1) round differently, so exact near-ties of the
bf16 logits can flip: on the tiny models, 8 of 40 bf16 runs of 48 tokens diverged on CUDA, and every
divergence checked on CPU had a teacher-forced margin of 0 or 1 bf16 ulp. Token forcing
(specpilot.validate) reports such benign near-ties. With `sampling` at temperature > 0 the loops sample
instead, losslessly in distribution (sampling.py: drafts drawn from the drafter's q, rejection
sampling at accept). One speculative step is draft -> verify -> accept -> commit:

  draft    the drafter proposes k tokens in one forward;
  verify   the target runs [last committed token, d1..dk] in one forward (q = k+1);
  accept   `accept_greedy`: d_i is kept while it equals the target's argmax at the position before
           it; the target's argmax at the first mismatch (or after dk) is the bonus token;
  commit   accepted drafts + bonus are appended; caches roll back to the accepted path.

Cache invariant between steps: the target's KV cache holds every committed token except the last
one, which is the next verify's first input.

Accounting (`Generation`): tokens[0] comes from the prefill logits; speculative step i then emits
accepted[i] drafts + 1 bonus. When EOS or max_new_tokens cuts a step short, accepted[i] counts only
the tokens that reached the output, minus one (the last token emitted plays the bonus's role). So,
exactly: len(tokens) == 1 + steps + sum(accepted) whenever tokens is non-empty, with steps ==
len(accepted) for speculative loops (AR: accepted == [], steps == len(tokens) - 1).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from specpilot.runtime.cache import KVCache
from specpilot.runtime.dflash import DFlashDrafter
from specpilot.runtime.model import PardDrafter, Transformer
from specpilot.runtime.sampling import (GREEDY, SamplingParams, StepRandom, accept_chain, draft_chain, first_token,
                                        sample_first)


@dataclass
class Generation:
    tokens: list[int]  # output tokens only (prompt excluded)
    accepted: list[int] = field(default_factory=list)  # per speculative step: drafts accepted (bonus not counted)
    steps: int = 0  # decode steps after the prefill (target forwards)
    prefill_s: float = 0.0
    decode_s: float = 0.0

    @property
    def tau(self) -> float:
        """Mean tokens per speculative step, bonus included (1.0 for AR)."""
        return 1.0 + sum(self.accepted) / len(self.accepted) if self.accepted else 1.0


def accept_greedy(draft_tokens: Sequence[int], target_argmax: Sequence[int]) -> int:
    """Number of leading drafts the target agrees with.

    target_argmax[i] is the target's argmax at verify position i, i.e. its choice for the token where
    draft i sits (position 0 holds the last committed token). The bonus is target_argmax[n].
    """
    n = 0
    for draft, target in zip(draft_tokens, target_argmax):
        if draft != target:
            break
        n += 1
    return n


class OutputTokens:
    """The output so far; stops right after the first EOS or at exactly max_new_tokens."""

    def __init__(self, max_new_tokens: int, eos_token_id: int | None) -> None:
        self.tokens: list[int] = []
        self.max_new_tokens = max_new_tokens
        self.eos_token_id = eos_token_id
        self.done = max_new_tokens <= 0

    def extend(self, span: Sequence[int]) -> int:
        """Append tokens in order until done; returns how many were kept."""
        kept = 0
        for token in span:
            if self.done:
                break
            self.tokens.append(token)
            kept += 1
            self.done = token == self.eos_token_id or len(self.tokens) >= self.max_new_tokens
        return kept


class DecodeClock:
    """perf_counter, synchronising the device first so queued GPU work is counted."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def __call__(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()


def prompt_tensor(prompt_ids: Sequence[int] | torch.Tensor, device: torch.device) -> torch.Tensor:
    ids = torch.as_tensor(prompt_ids, dtype=torch.long, device=device)
    ids = ids[None] if ids.dim() == 1 else ids
    if ids.dim() != 2 or ids.shape[0] != 1 or ids.shape[1] == 0:
        raise ValueError(f"prompt_ids must be a non-empty sequence (batch size 1), got shape {tuple(ids.shape)}")
    return ids


def check_max_new(max_new_tokens: int) -> None:
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")


def generate_ar(
    target: Transformer, prompt_ids: Sequence[int] | torch.Tensor, *, max_new_tokens: int, eos_token_id: int | None,
    sampling: SamplingParams = GREEDY,
) -> Generation:
    """Autoregressive decoding with the static KV cache: prefill, then one token per step; greedy, or
    drawn from p = top_p(softmax(logits / T)) when `sampling` says (the distribution every sampled
    speculative loop must keep)."""
    check_max_new(max_new_tokens)
    target.eval()
    clock = DecodeClock(target.device)
    out = OutputTokens(max_new_tokens, eos_token_id)
    if out.done:
        return Generation(tokens=[])
    with torch.inference_mode():
        prompt = prompt_tensor(prompt_ids, target.device)
        cache = target.new_cache(1, prompt.shape[1] + max_new_tokens)
        rng = None if sampling.greedy else StepRandom.for_seed(sampling.seed, target.device)

        def choose(logits: torch.Tensor) -> torch.Tensor:  # logits [1, V] -> token [1, 1]
            if rng is None:
                return logits.argmax(-1, keepdim=True)
            token = sample_first(logits[0], sampling, rng)[None]
            rng.advance()
            return token

        t0 = clock()
        token = choose(target(prompt, cache, only_last=True).logits[:, -1])
        out.extend(token[0].tolist())
        t1 = clock()
        steps = 0
        while not out.done:
            token = choose(target(token, cache).logits[:, -1])
            out.extend(token[0].tolist())
            steps += 1
        t2 = clock()
    return Generation(tokens=out.tokens, accepted=[], steps=steps, prefill_s=t1 - t0, decode_s=t2 - t1)


def verify_chain(
    target: Transformer, cache: KVCache, last_token: int, drafts: torch.Tensor, hidden_layers: tuple[int, ...] = ()
) -> tuple[list[int], torch.Tensor | None]:
    """Target forward over [last_token, d1..dk]: (argmax at each of the k+1 positions, hidden states)."""
    logits, hidden = verify_chain_logits(target, cache, last_token, drafts, hidden_layers)
    return logits.argmax(-1).tolist(), hidden


def verify_chain_logits(
    target: Transformer, cache: KVCache, last_token: int, drafts: torch.Tensor, hidden_layers: tuple[int, ...] = ()
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Target forward over [last_token, d1..dk]: (logits [k+1, V], hidden states)."""
    ids = torch.cat([drafts.new_tensor([last_token]), drafts])[None]
    out = target(ids, cache, hidden_layers=hidden_layers)
    return out.logits[0], out.hidden


def _commit(
    out: OutputTokens, accepted: list[int], drafts: list[int], target_argmax: list[int]
) -> tuple[int, list[int]]:
    """Greedy acceptance + bonus; appends to `out` and `accepted`. Returns (n accepted, committed span)."""
    n = accept_greedy(drafts, target_argmax)
    span = drafts[:n] + [target_argmax[n]]
    accepted.append(out.extend(span) - 1)
    return n, span


class ChainStep:
    """draft choice -> verify -> accept of one chain step, greedy or sampled (`sampling`)."""

    def __init__(self, sampling: SamplingParams, device: torch.device) -> None:
        self.sampling = sampling
        self.rng = None if sampling.greedy else StepRandom.for_seed(sampling.seed, device)
        self.q: torch.Tensor | None = None

    def first(self, logits: torch.Tensor) -> int:
        """The token after the prompt from the prefill's last logits [V]."""
        return first_token(logits, self.sampling, self.rng)

    def drafts(self, draft_logits: torch.Tensor) -> torch.Tensor:
        """The drafter's logits [k, V] -> k drafts: argmax, or drawn from each position's q."""
        if self.rng is None:
            return draft_logits.argmax(-1)
        drafts, self.q = draft_chain(draft_logits, self.sampling, self.rng)
        return drafts

    def verify(self, target: Transformer, cache: KVCache, out: OutputTokens, accepted: list[int], last: int,
               drafts: torch.Tensor, hidden_layers: tuple[int, ...] = ()) -> tuple[int, list[int], torch.Tensor | None]:
        """Verify and accept `drafts` (on the target's device); appends to `out` and `accepted`.
        Returns (n accepted, committed span, hidden states)."""
        if self.rng is None:
            target_argmax, hidden = verify_chain(target, cache, last, drafts, hidden_layers)
            n, span = _commit(out, accepted, drafts.tolist(), target_argmax)
            return n, span, hidden
        logits, hidden = verify_chain_logits(target, cache, last, drafts, hidden_layers)
        n_t, span_t = accept_chain(drafts, self.q.to(logits.device), logits, self.sampling, self.rng)
        self.rng.advance()
        n = int(n_t)
        span = span_t[: n + 1].tolist()
        accepted.append(out.extend(span) - 1)
        return n, span, hidden


def generate_pard(
    target: Transformer,
    drafter: Transformer | PardDrafter,
    prompt_ids: Sequence[int] | torch.Tensor,
    *,
    k: int,
    mask_token_id: int,
    max_new_tokens: int,
    eos_token_id: int | None,
    sampling: SamplingParams = GREEDY,
) -> Generation:
    """PARD-style speculative decoding (lossless: greedy, or sampled by `sampling`).

    The drafter is a causal LM with its own KV cache of committed tokens. Each step it runs
    [committed tokens not yet in its cache] + [mask x (k-1)] in one forward: the logits at the last
    real token give draft 1, at mask i draft i+1; then its cache is rolled back past the masks.
    """
    check_max_new(max_new_tokens)
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    draft_model = drafter.model if isinstance(drafter, PardDrafter) else drafter
    target.eval()
    draft_model.eval()
    clock = DecodeClock(target.device)
    out = OutputTokens(max_new_tokens, eos_token_id)
    if out.done:
        return Generation(tokens=[])
    accepted: list[int] = []
    with torch.inference_mode():
        prompt = prompt_tensor(prompt_ids, target.device)
        capacity = prompt.shape[1] + max_new_tokens + k + 1
        t_cache = target.new_cache(1, capacity)
        d_cache = draft_model.new_cache(1, capacity)
        t0 = clock()
        step = ChainStep(sampling, target.device)
        first = step.first(target(prompt, t_cache, only_last=True).logits[0, -1])
        draft_model(prompt.to(draft_model.device), d_cache, only_last=True)
        seq = prompt[0].tolist()
        out.extend([first])
        seq.append(first)
        t1 = clock()
        masks = [mask_token_id] * (k - 1)
        while not out.done:
            # draft: the committed tokens the drafter has not seen, then k-1 masks, in one forward
            fresh = seq[d_cache.length :]
            ids = torch.tensor([fresh + masks], dtype=torch.long, device=draft_model.device)
            logits = draft_model(ids, d_cache).logits[0, len(fresh) - 1 :]
            drafts = step.drafts(logits).to(target.device)
            d_cache.rollback(len(seq))
            # verify, accept, commit
            start = t_cache.length
            n, span, _ = step.verify(target, t_cache, out, accepted, seq[-1], drafts)
            t_cache.rollback(start + 1 + n)
            seq.extend(span)
        t2 = clock()
    return Generation(tokens=out.tokens, accepted=accepted, steps=len(accepted), prefill_s=t1 - t0, decode_s=t2 - t1)


def generate_dflash(
    target: Transformer,
    drafter: DFlashDrafter,
    prompt_ids: Sequence[int] | torch.Tensor,
    *,
    block_size: int,
    mask_token_id: int,
    max_new_tokens: int,
    eos_token_id: int | None,
    sampling: SamplingParams = GREEDY,
) -> Generation:
    """DFlash-style speculative decoding (lossless: greedy, or sampled by `sampling`).

    The target's prefill and every verify also return hidden states at drafter.target_layer_ids.
    The drafter keeps the accepted positions' features as context (context-only KV) and drafts
    block_size-1 tokens in one non-causal pass over [last token, mask x (block_size-1)].
    """
    check_max_new(max_new_tokens)
    if block_size < 2:
        raise ValueError(f"block_size must be >= 2 (anchor + drafts), got {block_size}")
    target.eval()
    drafter.eval()
    layers = tuple(drafter.target_layer_ids)
    clock = DecodeClock(target.device)
    out = OutputTokens(max_new_tokens, eos_token_id)
    if out.done:
        return Generation(tokens=[])
    accepted: list[int] = []
    with torch.inference_mode():
        prompt = prompt_tensor(prompt_ids, target.device)
        capacity = prompt.shape[1] + max_new_tokens + block_size + 1
        t_cache = target.new_cache(1, capacity)
        d_cache = drafter.new_cache(1, capacity)
        t0 = clock()
        step = ChainStep(sampling, target.device)
        pre = target(prompt, t_cache, hidden_layers=layers, only_last=True)
        first = step.first(pre.logits[0, -1])
        drafter.add_context(pre.hidden, d_cache)
        new_context = pre.hidden[:, :0]
        seq = prompt[0].tolist()
        out.extend([first])
        seq.append(first)
        t1 = clock()
        masks = [mask_token_id] * (block_size - 1)
        while not out.done:
            block = torch.tensor([[seq[-1]] + masks], dtype=torch.long, device=target.device)
            drafts = step.drafts(drafter(block, new_context, d_cache)[0])
            start = t_cache.length
            n, span, hidden = step.verify(target, t_cache, out, accepted, seq[-1], drafts, layers)
            t_cache.rollback(start + 1 + n)
            new_context = hidden[:, : n + 1]  # the last committed token and the accepted drafts
            seq.extend(span)
        t2 = clock()
    return Generation(tokens=out.tokens, accepted=accepted, steps=len(accepted), prefill_s=t1 - t0, decode_s=t2 - t1)

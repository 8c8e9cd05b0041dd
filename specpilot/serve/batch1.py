"""A StepEngine (runtime/engine_api.py) over today's batch-1 decode loops, until the batched runtime lands.

Compute is not batched: each `step()` advances every active request by one step of its own, one
request after another (interleaved), each with its own caches. What the server gains is that many
clients are served at once and a long request does not hold the others back for its whole run.

A request's session, by what the engine and the request ask:
- greedy, chain verification, eager loops (the zoo engines): `ChainSession`, one speculative step
  (draft -> verify -> accept -> commit) per `step()`, as decode.generate_pard / generate_dflash do it;
  its output is token for token the engine's own loop's (tests/test_serve_engine.py checks it);
- greedy, any other loop (tree verification, CUDA graphs, replay drafters): `WholeRunSession` runs the
  engine's own loop in full at its first step, then hands out one speculative step's tokens per
  `step()` as that run recorded them;
- temperature > 0: `SampleSession`, plain autoregressive sampling from the target (temperature,
  top-p) with a generator seeded per request. That keeps the target's distribution by definition;
  lossless speculative sampling (runtime/sampling.py) replaces it when it lands.
"""

from __future__ import annotations

import secrets
from typing import Protocol

import torch

from ..backends.torch_backend import Engine
from ..runtime.decode import OutputTokens, accept_greedy, prompt_tensor
from ..runtime.dflash import DFlashDrafter
from ..runtime.engine_api import RequestParams
from ..runtime.model import PardDrafter


class Session(Protocol):
    def step(self) -> list[int]: ...  # the tokens this step produced ([] once the request is done)


class ChainSession:
    """Greedy speculative decoding of one request, one step per call (PARD or DFlash drafter)."""

    def __init__(self, engine: Engine, prompt_ids: list[int], max_new_tokens: int) -> None:
        self.target, self.drafter = engine.target, engine.drafter
        self.k = engine.block_size
        self.dflash = isinstance(self.drafter, DFlashDrafter)
        self.prompt = prompt_ids
        self.out = OutputTokens(max_new_tokens, engine.eos_token_id)
        self.started = False
        self.max_new_tokens = max_new_tokens

    def _prefill(self) -> list[int]:
        prompt = prompt_tensor(self.prompt, self.target.device)
        capacity = prompt.shape[1] + self.max_new_tokens + self.k + 1
        self.t_cache = self.target.new_cache(1, capacity)
        if self.dflash:
            self.layers = tuple(self.drafter.target_layer_ids)
            self.d_cache = self.drafter.new_cache(1, capacity)
            pre = self.target(prompt, self.t_cache, hidden_layers=self.layers, only_last=True)
            self.drafter.add_context(pre.hidden, self.d_cache)
            self.context = pre.hidden[:, :0]
            self.masks = [self.drafter.mask_token_id] * (self.k - 1)
        else:
            self.draft_model = self.drafter.model if isinstance(self.drafter, PardDrafter) else self.drafter
            self.d_cache = self.draft_model.new_cache(1, capacity)
            pre = self.target(prompt, self.t_cache, only_last=True)
            self.draft_model(prompt.to(self.draft_model.device), self.d_cache, only_last=True)
            self.masks = [self.drafter.mask_token_id] * (self.k - 1)
        first = int(pre.logits[0, -1].argmax())
        self.seq = prompt[0].tolist() + [first]
        return [first][: self.out.extend([first])]

    def _draft(self) -> torch.Tensor:
        device = self.target.device
        if self.dflash:
            block = torch.tensor([[self.seq[-1]] + self.masks], dtype=torch.long, device=device)
            return self.drafter(block, self.context, self.d_cache)[0].argmax(-1)
        fresh = self.seq[self.d_cache.length:]
        ids = torch.tensor([fresh + self.masks], dtype=torch.long, device=self.draft_model.device)
        logits = self.draft_model(ids, self.d_cache).logits[0, len(fresh) - 1:]
        self.d_cache.rollback(len(self.seq))
        return logits.argmax(-1).to(device)

    def step(self) -> list[int]:
        with torch.inference_mode():
            if not self.started:
                self.started = True
                return self._prefill()
            if self.out.done:
                return []
            drafts = self._draft()
            start = self.t_cache.length
            ids = torch.cat([drafts.new_tensor([self.seq[-1]]), drafts])[None]
            verified = self.target(ids, self.t_cache, hidden_layers=self.layers if self.dflash else ())
            target_argmax = verified.logits[0].argmax(-1).tolist()
            n = accept_greedy(drafts.tolist(), target_argmax)
            span = drafts.tolist()[:n] + [target_argmax[n]]
            kept = self.out.extend(span)
            self.t_cache.rollback(start + 1 + n)
            if self.dflash:
                self.context = verified.hidden[:, : n + 1]
            self.seq.extend(span)
            return span[:kept]


class WholeRunSession:
    """The engine's own loop run in full at the first step; one recorded step's tokens per call."""

    def __init__(self, engine: Engine, prompt_ids: list[int], max_new_tokens: int) -> None:
        self.engine, self.prompt, self.max_new_tokens = engine, prompt_ids, max_new_tokens
        self.chunks: list[list[int]] | None = None

    def step(self) -> list[int]:
        if self.chunks is None:
            gen = self.engine.generate(self.prompt, self.max_new_tokens)
            tokens, self.chunks = gen.tokens, []
            if tokens:
                self.chunks.append(tokens[:1])
                i = 1
                for a in gen.accepted:
                    self.chunks.append(tokens[i:i + a + 1])
                    i += a + 1
                if i < len(tokens):
                    self.chunks.append(tokens[i:])
            self.chunks.reverse()
        return self.chunks.pop() if self.chunks else []


def sample_token(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator) -> int:
    """One token from softmax(logits / temperature) restricted to the top-p nucleus (the smallest
    set of most likely tokens whose mass reaches top_p; always at least the most likely one)."""
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_p, order = probs.sort(descending=True)
        before = sorted_p.cumsum(-1) - sorted_p  # mass of the more likely tokens
        sorted_p = torch.where(before < top_p, sorted_p, torch.zeros_like(sorted_p))
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
    return int(torch.multinomial(probs, 1, generator=generator))


class SampleSession:
    """Autoregressive sampling from the target, one token per call, seeded per request."""

    def __init__(self, engine: Engine, prompt_ids: list[int], params: RequestParams) -> None:
        self.target, self.params = engine.target, params
        self.prompt = prompt_ids
        self.out = OutputTokens(params.max_new_tokens, engine.eos_token_id)
        seed = params.seed if params.seed is not None else secrets.randbits(63)
        self.generator = torch.Generator(device=self.target.device).manual_seed(seed)
        self.cache = None

    def step(self) -> list[int]:
        if self.out.done:
            return []
        with torch.inference_mode():
            if self.cache is None:
                prompt = prompt_tensor(self.prompt, self.target.device)
                self.cache = self.target.new_cache(1, prompt.shape[1] + self.params.max_new_tokens + 1)
                logits = self.target(prompt, self.cache, only_last=True).logits[0, -1]
            else:
                ids = torch.tensor([[self.out.tokens[-1]]], dtype=torch.long, device=self.target.device)
                logits = self.target(ids, self.cache).logits[0, -1]
            token = sample_token(logits, self.params.temperature, self.params.top_p, self.generator)
        kept = self.out.extend([token])
        return [token][:kept]


def runs_stepwise(engine: Engine) -> bool:
    """Whether greedy requests of `engine` run a step per call (ChainSession): chain verification in
    the eager loops, a real drafter."""
    verify = engine.program.step.one("verify")[1]
    return verify["mode"] == "chain" and not engine.graphed and engine.replay is None


class Batch1StepEngine:
    """StepEngine over the batch-1 loops: `max_batch` requests in flight, stepped one after another."""

    def __init__(self, engine: Engine, max_batch: int) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self.engine, self.max_batch = engine, max_batch
        self.stepwise = runs_stepwise(engine)
        self.sessions: dict[str, Session] = {}

    def admit(self, rid: str, prompt_ids: list[int], params: RequestParams) -> None:
        if rid in self.sessions:
            raise ValueError(f"request {rid!r} is already active")
        if len(self.sessions) >= self.max_batch:
            raise ValueError(f"{len(self.sessions)} requests active: max_batch is {self.max_batch}")
        if params.temperature > 0:
            session: Session = SampleSession(self.engine, prompt_ids, params)
        elif self.stepwise:
            session = ChainSession(self.engine, prompt_ids, params.max_new_tokens)
        else:
            session = WholeRunSession(self.engine, prompt_ids, params.max_new_tokens)
        self.sessions[rid] = session

    def step(self) -> dict[str, list[int]]:
        return {rid: s.step() for rid, s in list(self.sessions.items())}

    def release(self, rid: str) -> None:
        self.sessions.pop(rid, None)

    def active(self) -> list[str]:
        return list(self.sessions)

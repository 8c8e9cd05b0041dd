"""A StepEngine (runtime/engine_api.py) over the batch-1 decode loops: what serves every request of an
engine the batched engine does not serve (replay drafters; serve/routed.py).

Compute is not batched: each `step()` advances every active request by one step of its own, one
request after another (interleaved), each with its own caches. What the server gains is that many
clients are served at once and a long request does not hold the others back for its whole run.

A request's session, by what the engine asks:
- chain verification in the eager loops (the zoo engines): `ChainSession`, one speculative step
  (draft -> verify -> accept -> commit) per `step()`, through decode.ChainStep as
  decode.generate_pard / generate_dflash run it: greedy, or at temperature > 0 lossless speculative
  sampling (runtime/sampling.py: rejection sampling of the chain, counter-based uniforms seeded per
  request). Either way its output is token for token the engine's own loop's for the same request
  and seed (tests/test_serve_engine.py checks it);
- any other loop (tree verification, CUDA graphs, replay drafters): `WholeRunSession` runs the
  engine's own loop (Engine.generate, greedy or sampled) in full at its first step, then hands out
  one speculative step's tokens per `step()` as that run recorded them.
"""

from __future__ import annotations

from typing import Protocol

import torch

from ..backends.torch_backend import Engine
from ..runtime.decode import ChainStep, OutputTokens, prompt_tensor
from ..runtime.dflash import DFlashDrafter
from ..runtime.engine_api import RequestParams
from ..runtime.model import PardDrafter
from ..runtime.sampling import SamplingParams, request_sampling


def sampling_params(params: RequestParams) -> SamplingParams:
    """The runtime's sampling of a request (sampling.request_sampling)."""
    return request_sampling(params.temperature, params.top_p, params.seed)


class Session(Protocol):
    def step(self) -> list[int]: ...  # the tokens this step produced ([] once the request is done)


class ChainSession:
    """Speculative decoding of one request, one step per call (PARD or DFlash drafter), greedy or sampled."""

    def __init__(self, engine: Engine, prompt_ids: list[int], max_new_tokens: int, sampling: SamplingParams) -> None:
        self.target, self.drafter = engine.target, engine.drafter
        self.k = engine.block_size
        self.dflash = isinstance(self.drafter, DFlashDrafter)
        self.prompt = prompt_ids
        self.out = OutputTokens(max_new_tokens, engine.eos_token_id)
        self.max_new_tokens = max_new_tokens
        self.chain = ChainStep(sampling, self.target.device)
        self.accepted: list[int] = []
        self.started = False

    def _prefill(self) -> list[int]:
        prompt = prompt_tensor(self.prompt, self.target.device)
        capacity = prompt.shape[1] + self.max_new_tokens + self.k + 1
        self.t_cache = self.target.new_cache(1, capacity)
        self.masks = [self.drafter.mask_token_id] * (self.k - 1)
        if self.dflash:
            self.layers = tuple(self.drafter.target_layer_ids)
            self.d_cache = self.drafter.new_cache(1, capacity)
            pre = self.target(prompt, self.t_cache, hidden_layers=self.layers, only_last=True)
            first = self.chain.first(pre.logits[0, -1])
            self.drafter.add_context(pre.hidden, self.d_cache)
            self.context = pre.hidden[:, :0]
        else:
            self.layers = ()
            self.draft_model = self.drafter.model if isinstance(self.drafter, PardDrafter) else self.drafter
            self.d_cache = self.draft_model.new_cache(1, capacity)
            first = self.chain.first(self.target(prompt, self.t_cache, only_last=True).logits[0, -1])
            self.draft_model(prompt.to(self.draft_model.device), self.d_cache, only_last=True)
        self.seq = prompt[0].tolist() + [first]
        return [first][: self.out.extend([first])]

    def _draft(self) -> torch.Tensor:
        if self.dflash:
            block = torch.tensor([[self.seq[-1]] + self.masks], dtype=torch.long, device=self.target.device)
            return self.chain.drafts(self.drafter(block, self.context, self.d_cache)[0])
        fresh = self.seq[self.d_cache.length:]
        ids = torch.tensor([fresh + self.masks], dtype=torch.long, device=self.draft_model.device)
        logits = self.draft_model(ids, self.d_cache).logits[0, len(fresh) - 1:]
        drafts = self.chain.drafts(logits).to(self.target.device)
        self.d_cache.rollback(len(self.seq))
        return drafts

    def step(self) -> list[int]:
        with torch.inference_mode():
            if not self.started:
                self.started = True
                return self._prefill()
            if self.out.done:
                return []
            drafts = self._draft()
            start, before = self.t_cache.length, len(self.out.tokens)
            n, span, hidden = self.chain.verify(self.target, self.t_cache, self.out, self.accepted, self.seq[-1],
                                                drafts, self.layers)
            self.t_cache.rollback(start + 1 + n)
            if self.dflash:
                self.context = hidden[:, : n + 1]  # the last committed token and the accepted drafts
            self.seq.extend(span)
            return self.out.tokens[before:]


class WholeRunSession:
    """The engine's own loop run in full at the first step; one recorded step's tokens per call."""

    def __init__(self, engine: Engine, prompt_ids: list[int], max_new_tokens: int, sampling: SamplingParams) -> None:
        self.engine, self.prompt, self.max_new_tokens, self.sampling = engine, prompt_ids, max_new_tokens, sampling
        self.chunks: list[list[int]] | None = None

    def step(self) -> list[int]:
        if self.chunks is None:
            gen = self.engine.generate(self.prompt, self.max_new_tokens, self.sampling)
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


def runs_stepwise(engine: Engine) -> bool:
    """Whether requests of `engine` run a step per call (ChainSession): chain verification in the
    eager loops, a real drafter."""
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
        sampling = sampling_params(params)
        if self.engine.replay is not None and not sampling.greedy:
            raise ValueError("this engine's replay drafter follows a greedy plan: it serves temperature 0 only")
        session: Session
        if self.stepwise:
            session = ChainSession(self.engine, prompt_ids, params.max_new_tokens, sampling)
        else:
            session = WholeRunSession(self.engine, prompt_ids, params.max_new_tokens, sampling)
        self.sessions[rid] = session

    def step(self) -> dict[str, list[int]]:
        return {rid: s.step() for rid, s in list(self.sessions.items())}

    def release(self, rid: str) -> None:
        self.sessions.pop(rid, None)

    def active(self) -> list[str]:
        return list(self.sessions)

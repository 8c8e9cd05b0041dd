"""Decode loops whose every step is one CUDA graph, with acceptance on the device.

The eager loops of `decode` keep the cache length and the committed tokens on the host and read
the target's argmax back every step. Here the whole step lives on the device:

  state     DeviceKVCaches (length as a device tensor), the last committed token, the drafter's
            pending context, and an output buffer with its length: all preallocated tensors;
  step      draft -> verify -> accept (argmax, prefix match, bonus) -> commit (cache lengths,
            output buffer, next step's inputs), written once as tensor ops with static shapes;
  graphs    on CUDA each step is captured once per runner (the runner is reused across prompts of
            the same capacity: `runner_for`) and replayed; elsewhere it simply runs, which is how
            the CPU tests check these loops against AR greedy;
  host      per step it reads one small status tensor: [accepted drafts, EOS seen]. The tokens
            cross once, at the end.

Trees (`GraphedTreeDFlash`, `GraphedTreePard`): the drafter's top-k -> a best-first tree of a
static node budget, built by the builder a backend installs (one Triton program on a GPU; the
host heap of tree.py by default) -> one verify forward under the ancestor mask -> `accept_tree_on_device`
-> KV compaction by device indices; the same trees and acceptances as tree_decode.py.

Sampling (a runner built with `sampling` at temperature > 0, sampling.py): drafts drawn from the
drafter's q and rejection sampling for chains, one draw from p a node for trees, all on the device
with the counter-based uniforms (the step counter a device tensor, the seed put in per generation),
so a sampled step is one graph replay as a greedy one is.

The prefill is eager (its length varies) on the same caches. Token accounting matches `decode`
(`Generation`), reconstructed at the end from the per-step accepted counts.

Invariant between steps, as in `decode`: the target's cache holds every committed token except
the last one (`last`), which is the next verify's first input.

For timing, a speculative runner cuts its step in parts (`parts()`): the drafting, the tree's
proposal, the verify forward and the whole step, each a function of the runner's state after a
generation that puts that state back, so a benchmark can capture and replay each alone
(specpilot/bench/loop.py: the loop's terms).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from specpilot.runtime.cache import DeviceKVCache
from specpilot.runtime.decode import Generation, OutputTokens, check_max_new, DecodeClock, prompt_tensor
from specpilot.runtime.dflash import DFlashDrafter
from specpilot.runtime.hybrid import GatedAttention, GatedDeltaNet, HybridCache
from specpilot.runtime.model import Attention, ModelOutput, PardDrafter, Transformer
from specpilot.runtime.sampling import (GREEDY, SamplingParams, StepRandom, accept_chain, draft_chain, first_token,
                                        sample_first, tree_draws)
from specpilot.runtime.tree import best_first_tree_padded

# Capacity buckets: a runner (and its graphs) serves every request that fits.
MIN_CAPACITY = 256


def accept_on_device(drafts: torch.Tensor, target_argmax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy acceptance without leaving the device: drafts [k], target_argmax [k+1].

    Returns (n, span): n (0-dim) leading drafts equal the target's argmax before them; span [k+1]
    holds drafts[:n] then the bonus target_argmax[n] at index n (entries after n are don't-care).
    """
    n = torch.cumprod((drafts == target_argmax[:-1]).long(), 0).sum()
    at_n = n.view(1)  # index with a 1-element tensor: a 0-dim one would be read on the host
    span = torch.cat([drafts, drafts[:1]]).index_copy_(0, at_n, target_argmax.index_select(0, at_n))
    return n, span


class GraphedStep:
    """`fn` (no arguments, reads and writes preallocated tensors) captured once as a CUDA graph and
    replayed; called directly on other devices. Warm-up runs touch the state: callers reset it."""

    def __init__(self, fn: Callable[[], None], device: torch.device, pool=None) -> None:
        self.fn = fn
        self.graph = None
        if device.type != "cuda":
            for _ in range(2):  # the same warm-up as below, so CPU runs see what a capture's state sees
                fn()
            return
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm-up: lazy inits, cuBLAS handles, Triton compiles
                fn()
        torch.cuda.current_stream(device).wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            fn()

    def __call__(self) -> None:
        if self.graph is None:
            self.fn()
        else:
            self.graph.replay()


class _Runner:
    """What every graphed loop shares: the target cache, the output buffer, status and graphs.

    Speculative runners split a step into `_draft()` (the drafter's logits at the draft positions
    [D, V]) and `_commit_draft(n, span, path_hidden)` (the drafter's state after n accepted drafts),
    so that a chain step and a tree step (`_TreeSteps`) share everything but the verification."""

    layers: tuple[int, ...] = ()  # target layers whose hidden states the drafter reads

    def __init__(self, target: Transformer, capacity: int, block: int, eos_token_id: int | None,
                 extra_slots: int = 0, sampling: SamplingParams = GREEDY) -> None:
        self.target = target
        self.sampling = sampling
        self.rng = None if sampling.greedy else StepRandom.for_seed(sampling.seed, target.device)
        self.device = target.device
        self.capacity = capacity
        self.block = block  # tokens a step may commit, at most
        self.eos = -1 if eos_token_id is None else eos_token_id
        # a verify writes at most `block` (a chain) or block + extra_slots (a tree) slots past the length
        self.t_cache = target.new_cache(1, capacity + 2 * block + extra_slots, device_length=True)
        dev = self.device
        self.last = torch.zeros(1, dtype=torch.long, device=dev)
        self.out = torch.zeros(capacity + 2 * block, dtype=torch.long, device=dev)
        self.out_len = torch.zeros((), dtype=torch.long, device=dev)
        self.status = torch.zeros(2, dtype=torch.long, device=dev)  # [accepted drafts, EOS in span]
        self.arange = torch.arange(block, device=dev)
        self.zero = torch.zeros((), dtype=torch.long, device=dev)
        self.step: GraphedStep | None = None
        # a hybrid target verifies a chain as a tree of one path (`_verify_chain`): its mask, made here
        self.chain_mask = (torch.ones(block, block, dtype=torch.bool, device=dev).tril()
                           if isinstance(self.t_cache, HybridCache) else None)

    def _verify_chain(self, ids: torch.Tensor, **kw) -> ModelOutput:
        """The target over the anchor and a chain of drafts ids [1, t] from the cache's length; `_keep_chain`
        then keeps the accepted prefix. A hybrid target runs it as a tree of one path: the commit then
        moves each Gated DeltaNet state once, where a chain forward moves it to the chain's end and a
        rollback recomputes it (bench/results/hybrid_tree_steps_cpu_ops.json counts both)."""
        if self.chain_mask is None:
            return self.target(ids, self.t_cache, **kw)
        t = ids.shape[1]
        positions = (self.t_cache.length + self.arange[:t])[None]
        return self.target(ids, self.t_cache, mask=self.chain_mask[:t, :t], positions=positions, **kw)

    def _keep_chain(self, start: torch.Tensor, n: torch.Tensor, t: int) -> None:
        """After `_verify_chain` of t tokens from `start`: keep the anchor and the first n drafts."""
        if self.chain_mask is None:
            self.t_cache.rollback(start + 1 + n)
        else:
            self.t_cache.commit_path(start, self.arange[:t], n)

    def _emit(self, n: torch.Tensor, span: torch.Tensor) -> None:
        """Commit span[:n+1] to the output buffer and the status (inside the graph)."""
        self.out.index_copy_(0, self.out_len + self.arange[: span.shape[0]], span)
        self.out_len += n + 1
        self.last.copy_(span.index_select(0, n.view(1)))
        self.status[0] = n
        self.status[1] = ((span == self.eos) & (self.arange[: span.shape[0]] <= n)).any()

    def _caches(self) -> list[DeviceKVCache]:
        return [self.t_cache]

    def _first(self, logits: torch.Tensor) -> int:
        """The token after the prompt from the prefill's last logits [V] (eager)."""
        return first_token(logits, self.sampling, self.rng)

    def _drafts(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The drafter's logits [k, V] -> (drafts, q): argmax, or drawn from each position's q."""
        if self.rng is None:
            return logits.argmax(-1), None
        return draft_chain(logits, self.sampling, self.rng)

    def _accept_chain(self, drafts: torch.Tensor, q: torch.Tensor | None,
                      logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(n, span) of a chain: greedy prefix match, or rejection sampling."""
        if self.rng is None:
            return accept_on_device(drafts, logits.argmax(-1))
        n, span = accept_chain(drafts, q, logits, self.sampling, self.rng)
        self.rng.advance()
        return n, span

    def _state(self) -> list[torch.Tensor]:
        """What a step rewrites besides cache slots past the lengths: what `parts` puts back."""
        return [c.length for c in self._caches()] + [self.last, self.out_len, self.status] + (
            [self.rng.step] if self.rng is not None else [])

    def _parts(self) -> dict[str, Callable[[], object]]:
        return {}

    def parts(self) -> dict[str, Callable[[], None]]:
        """The step in parts, for timing: functions of the runner's present state (a generation
        already run) that each put the state back when done, so a timer may capture and replay them
        as often as it likes: "restore" (the putting back alone), the parts ("draft", for trees
        "propose", then "verify") and "step" (the whole step as the loop replays it)."""
        state = self._state()
        saved = [t.clone() for t in state]

        def restore() -> None:
            for t, s in zip(state, saved):
                t.copy_(s)

        with torch.inference_mode():
            named = {**self._parts(), "step": self._step}
            restore()  # a part may have run once to fix its inputs (a tree's)
        out: dict[str, Callable[[], None]] = {"restore": restore}
        for name, fn in named.items():
            def run(fn=fn) -> None:
                fn()
                restore()
            out[name] = run
        return out

    def _capture(self) -> None:
        if self.step is None:
            with torch.inference_mode():
                self.step = GraphedStep(self._step, self.device)

    def _reset(self) -> None:
        for cache in self._caches():
            cache.reset()
        self.out_len.zero_()
        self.status.zero_()

    def generate(self, prompt_ids, *, max_new_tokens: int, eos_token_id: int | None, seed: int = 0) -> Generation:
        """One generation; `seed` seeds a sampling runner's draws (ignored when greedy)."""
        check_max_new(max_new_tokens)
        if (-1 if eos_token_id is None else eos_token_id) != self.eos:
            raise ValueError(f"this runner was built for eos_token_id={self.eos}, got {eos_token_id}")
        if max_new_tokens == 0:
            return Generation(tokens=[])
        prompt = prompt_tensor(prompt_ids, self.device)
        if prompt.shape[1] + max_new_tokens > self.capacity:
            raise ValueError(f"prompt {prompt.shape[1]} + {max_new_tokens} new tokens exceed the capacity {self.capacity}")
        self.target.eval()
        self._capture()
        clock = DecodeClock(self.device)
        with torch.inference_mode():
            self._reset()
            if self.rng is not None:
                self.rng.reset(seed)
            t0 = clock()
            first = self._prefill(prompt)
            self.out[0] = first
            self.out_len.fill_(1)
            self.last.fill_(first)
            t1 = clock()
            steps: list[int] = []
            produced = 1
            done = first == eos_token_id or max_new_tokens <= 1
            while not done:
                self.step()
                n, eos_seen = self.status.tolist()  # the one sync a step
                steps.append(n)
                produced += n + 1
                done = bool(eos_seen) or produced >= max_new_tokens
            t2 = clock()
            tokens = self.out[:produced].tolist()
        return self._account(tokens, steps, max_new_tokens, eos_token_id, t1 - t0, t2 - t1)

    def _account(self, tokens: list[int], steps: list[int], max_new: int, eos: int | None,
                 prefill_s: float, decode_s: float) -> Generation:
        out = OutputTokens(max_new, eos)
        out.extend(tokens[:1])
        accepted, pos = [], 1
        for n in steps:
            accepted.append(out.extend(tokens[pos : pos + n + 1]) - 1)
            pos += n + 1
        if self.block == 1:  # AR: no drafts
            return Generation(tokens=out.tokens, accepted=[], steps=len(steps), prefill_s=prefill_s, decode_s=decode_s)
        return Generation(tokens=out.tokens, accepted=accepted, steps=len(steps), prefill_s=prefill_s, decode_s=decode_s)


class GraphedAR(_Runner):
    """Greedy AR: one q=1 target forward, argmax and commit per graph replay."""

    def __init__(self, target: Transformer, capacity: int, eos_token_id: int | None,
                 sampling: SamplingParams = GREEDY) -> None:
        super().__init__(target, capacity, 1, eos_token_id, sampling=sampling)

    def _prefill(self, prompt: torch.Tensor) -> int:
        return self._first(self.target(prompt, self.t_cache, only_last=True).logits[0, -1])

    def _step(self) -> None:
        logits = self.target(self.last[None], self.t_cache).logits[0, -1]
        if self.rng is None:
            token = logits.argmax(-1, keepdim=True)
        else:
            token = sample_first(logits, self.sampling, self.rng)
            self.rng.advance()
        self._emit(self.zero, token)


class GraphedDFlash(_Runner):
    """DFlash-style: drafter block (its pending context added first) -> verify -> accept -> commit."""

    def __init__(self, target: Transformer, drafter: DFlashDrafter, capacity: int, block_size: int,
                 mask_token_id: int, eos_token_id: int | None, extra_slots: int = 0,
                 sampling: SamplingParams = GREEDY) -> None:
        if block_size < 2:
            raise ValueError(f"block_size must be >= 2 (anchor + drafts), got {block_size}")
        super().__init__(target, capacity, block_size, eos_token_id, extra_slots, sampling)
        self.drafter = drafter
        self.layers = tuple(drafter.target_layer_ids)
        self.d_cache = drafter.new_cache(1, capacity + 3 * block_size, device_length=True)
        width = len(self.layers) * target.cfg.hidden_size
        self.context = torch.zeros(1, block_size, width, dtype=target.dtype, device=self.device)
        self.context_count = torch.zeros((), dtype=torch.long, device=self.device)
        self.masks = torch.full((block_size - 1,), mask_token_id, dtype=torch.long, device=self.device)
        self.no_context = self.context[:, :0]

    def _caches(self) -> list[DeviceKVCache]:
        return [self.t_cache, self.d_cache]

    def _state(self) -> list[torch.Tensor]:
        return super()._state() + [self.context, self.context_count]

    def _parts(self) -> dict[str, Callable[[], object]]:
        drafts = torch.zeros(self.block - 1, dtype=torch.long, device=self.device)  # a verify's cost holds for any tokens
        return {"draft": lambda: self._draft().argmax(-1),
                "verify": lambda: self._verify_chain(torch.cat([self.last, drafts])[None], hidden_layers=self.layers)}

    def _reset(self) -> None:
        super()._reset()
        self.context_count.zero_()

    def _prefill(self, prompt: torch.Tensor) -> int:
        pre = self.target(prompt, self.t_cache, hidden_layers=self.layers, only_last=True)
        self.drafter.add_context(pre.hidden, self.d_cache)
        return self._first(pre.logits[0, -1])

    def _draft(self) -> torch.Tensor:
        self.drafter.eval()
        self.drafter.add_context(self.context, self.d_cache, self.context_count)
        return self.drafter(torch.cat([self.last, self.masks])[None], self.no_context, self.d_cache)[0]

    def _commit_draft(self, n: torch.Tensor, span: torch.Tensor, path_hidden: torch.Tensor) -> None:
        self.context.copy_(path_hidden)  # the last committed token and the accepted drafts, in order
        self.context_count.copy_(n + 1)
        self._emit(n, span)

    def _step(self) -> None:
        drafts, q = self._drafts(self._draft())
        start = self.t_cache.length.clone()
        out = self._verify_chain(torch.cat([self.last, drafts])[None], hidden_layers=self.layers)
        n, span = self._accept_chain(drafts, q, out.logits[0])
        self._keep_chain(start, n, drafts.shape[0] + 1)
        self._commit_draft(n, span, out.hidden)


class GraphedPard(_Runner):
    """PARD-style: the drafter reads the tokens it has not seen (padded to k+1 with masks) and k-1
    masks in one causal forward; draft j sits at row fresh-1+j. Padding with masks changes nothing
    before them (causal), so the drafts equal the eager loop's."""

    def __init__(self, target: Transformer, drafter: Transformer, capacity: int, k: int,
                 mask_token_id: int, eos_token_id: int | None, extra_slots: int = 0,
                 sampling: SamplingParams = GREEDY) -> None:
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        super().__init__(target, capacity, k + 1, eos_token_id, extra_slots, sampling)
        self.drafter = drafter
        self.k = k
        self.d_cache = drafter.new_cache(1, capacity + 4 * (k + 1), device_length=True)
        self.fresh = torch.zeros(k + 1, dtype=torch.long, device=self.device)
        # >= 1 at every step, also the capture's warm-up steps: row fresh_count - 1 is read
        self.fresh_count = torch.ones((), dtype=torch.long, device=self.device)
        self.mask_token = torch.tensor(mask_token_id, device=self.device)
        self.masks = torch.full((k - 1,), mask_token_id, dtype=torch.long, device=self.device)

    def _caches(self) -> list[DeviceKVCache]:
        return [self.t_cache, self.d_cache]

    def _state(self) -> list[torch.Tensor]:
        return super()._state() + [self.fresh, self.fresh_count]

    def _parts(self) -> dict[str, Callable[[], object]]:
        drafts = torch.zeros(self.k, dtype=torch.long, device=self.device)
        return {"draft": lambda: self._draft().argmax(-1),
                "verify": lambda: self._verify_chain(torch.cat([self.last, drafts])[None])}

    def _reset(self) -> None:
        super()._reset()
        self.fresh_count.fill_(1)

    def _prefill(self, prompt: torch.Tensor) -> int:
        first = self._first(self.target(prompt, self.t_cache, only_last=True).logits[0, -1])
        self.drafter(prompt, self.d_cache, only_last=True)
        self.fresh[0] = first
        self.fresh_count.fill_(1)
        return first

    def _draft(self) -> torch.Tensor:
        self.drafter.eval()
        seen = self.arange < self.fresh_count
        ids = torch.cat([torch.where(seen, self.fresh, self.mask_token), self.masks])[None]
        d_start = self.d_cache.length.clone()
        logits = self.drafter(ids, self.d_cache).logits[0]
        self.d_cache.rollback(d_start + self.fresh_count)
        return logits.index_select(0, self.fresh_count - 1 + self.arange[: self.k])

    def _commit_draft(self, n: torch.Tensor, span: torch.Tensor, path_hidden: torch.Tensor | None) -> None:
        self.fresh.copy_(span)  # the committed tokens the drafter has not seen yet
        self.fresh_count.copy_(n + 1)
        self._emit(n, span)

    def _step(self) -> None:
        drafts, q = self._drafts(self._draft())
        start = self.t_cache.length.clone()
        verify = self._verify_chain(torch.cat([self.last, drafts])[None])
        n, span = self._accept_chain(drafts, q, verify.logits[0])
        self._keep_chain(start, n, drafts.shape[0] + 1)
        self._commit_draft(n, span, None)


def runners_of(target: nn.Module) -> dict:
    """The runners kept for `target`, on the module itself, so they go when it goes: a runner holds
    its target (and a DFlash drafter its target's embed and head), so a table keyed weakly by the
    target would keep every target that ever ran a graphed loop alive, weights and graphs."""
    return target.__dict__.setdefault("_graph_runners", {})


def _capacity(needed: int) -> int:
    return max(MIN_CAPACITY, 1 << (needed - 1).bit_length())


def _graph_inputs(*modules: nn.Module | None) -> tuple:
    """What a captured graph bakes in from `modules`: every weight's address (a graph replays raw
    pointers, so a weight moved to new storage, as install_fused's concatenation does, needs new
    graphs) and the attention, fused and Gated DeltaNet tree kernels installed at capture."""
    sig: list[int] = []
    for module in modules:
        if module is None:
            continue
        sig.append(id(getattr(module, "fused", None)))
        sig += [p.data_ptr() for p in module.parameters()]
        sig += [id(m.attention) for m in module.modules() if isinstance(m, (Attention, GatedAttention))]
        sig += [id(m.tree_rule) for m in module.modules() if isinstance(m, GatedDeltaNet)]
    return tuple(sig)


def runner_for(target: Transformer, key: tuple, make: Callable[[int], _Runner], needed: int,
               drafter: nn.Module | None = None) -> _Runner:
    """The runner (caches + captured graphs) for `key` on `target` (and `drafter`) whose capacity
    fits `needed` tokens; built on first use, kept as long as the target lives, and never reused
    once a weight has moved or another kernel is installed."""
    runners = runners_of(target)
    key = (key, _capacity(needed), _graph_inputs(target, drafter))
    if key not in runners:
        runners[key] = make(key[1])
    return runners[key]


def _length(prompt_ids: Sequence[int] | torch.Tensor) -> int:
    return torch.as_tensor(prompt_ids).shape[-1]


def _sampling_key(sampling: SamplingParams) -> tuple:
    """What a runner bakes into its graphs of the sampling: temperature and top_p (the seed is a
    tensor it resets per generation)."""
    return () if sampling.greedy else (sampling.temperature, sampling.top_p)


def generate_ar_graphed(target: Transformer, prompt_ids, *, max_new_tokens: int, eos_token_id: int | None,
                        sampling: SamplingParams = GREEDY) -> Generation:
    """`decode.generate_ar`, one CUDA graph a step."""
    runner = runner_for(target, ("ar", eos_token_id, _sampling_key(sampling)),
                        lambda cap: GraphedAR(target, cap, eos_token_id, sampling), _length(prompt_ids) + max_new_tokens)
    return runner.generate(prompt_ids, max_new_tokens=max_new_tokens, eos_token_id=eos_token_id, seed=sampling.seed)


def generate_dflash_graphed(target: Transformer, drafter: DFlashDrafter, prompt_ids, *, block_size: int,
                            mask_token_id: int, max_new_tokens: int, eos_token_id: int | None,
                            sampling: SamplingParams = GREEDY) -> Generation:
    """`decode.generate_dflash`, one CUDA graph a speculative step."""
    key = ("dflash", id(drafter), block_size, mask_token_id, eos_token_id, _sampling_key(sampling))
    make = lambda cap: GraphedDFlash(target, drafter, cap, block_size, mask_token_id, eos_token_id,  # noqa: E731
                                     sampling=sampling)
    runner = runner_for(target, key, make, _length(prompt_ids) + max_new_tokens, drafter)
    return runner.generate(prompt_ids, max_new_tokens=max_new_tokens, eos_token_id=eos_token_id, seed=sampling.seed)


def generate_pard_graphed(target: Transformer, drafter: Transformer | PardDrafter, prompt_ids, *, k: int,
                          mask_token_id: int, max_new_tokens: int, eos_token_id: int | None,
                          sampling: SamplingParams = GREEDY) -> Generation:
    """`decode.generate_pard`, one CUDA graph a speculative step."""
    model = drafter.model if isinstance(drafter, PardDrafter) else drafter
    key = ("pard", id(model), k, mask_token_id, eos_token_id, _sampling_key(sampling))
    make = lambda cap: GraphedPard(target, model, cap, k, mask_token_id, eos_token_id,  # noqa: E731
                                   sampling=sampling)
    runner = runner_for(target, key, make, _length(prompt_ids) + max_new_tokens, model)
    return runner.generate(prompt_ids, max_new_tokens=max_new_tokens, eos_token_id=eos_token_id, seed=sampling.seed)


# --- tree verification -------------------------------------------------------------------------


def ancestor_mask_static(parent: torch.Tensor, max_depth: int) -> torch.Tensor:
    """tree.ancestor_mask for trees at most `max_depth` deep, in a fixed number of launches (no host
    read of the depth): the reflexive-transitive closure of "is the parent of" by repeated
    squaring, ceil(log2(max_depth)) products of 0/1 matrices (exact: sums <= nodes, even in TF32).
    A hop a launch, as before, took ~6 launches a level: 90 at depth 15. A batch of trees (parent
    [B, n]) gives [B, n, n] in the same launches."""
    nodes = torch.arange(parent.shape[-1], device=parent.device)
    reach = (nodes[:, None] == nodes[None, :]) | (parent[..., :, None] == nodes)  # self or parent
    hops = 1
    while hops < max_depth:
        r = reach.float()
        reach = (r @ r) > 0
        hops *= 2
    return reach


def accept_tree_on_device(parent: torch.Tensor, depth: torch.Tensor, token: torch.Tensor, ancestors: torch.Tensor,
                          target_argmax: torch.Tensor, levels: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """tree.accept_tree without leaving the device: (n accepted drafts (0-dim), path [levels] (node
    at each depth, don't-care beyond n), span [levels]: the path's drafts then the bonus at n)."""
    n, path, span = accept_trees_on_device(parent[None], depth[None], token[None], ancestors[None],
                                           target_argmax[None], levels)
    return n[0], path[0], span[0]


def accept_trees_on_device(parent: torch.Tensor, depth: torch.Tensor, token: torch.Tensor, ancestors: torch.Tensor,
                           target_argmax: torch.Tensor, levels: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """accept_tree_on_device over a batch of trees ([B, n] each, ancestors [B, n, n], the target's
    argmax at every node [B, n]): n [B], path [B, levels], span [B, levels]."""
    first = torch.arange(parent.shape[-1], device=parent.device) == 0
    ok = first | ((parent >= 0) & (token == target_argmax.gather(1, parent.clamp(min=0))))
    accepted = ~(ancestors & ~ok[:, None, :]).any(dim=2)
    deepest = torch.where(accepted, depth, -1).argmax(dim=1, keepdim=True)  # the first deepest, as accept_tree
    n = depth.gather(1, deepest)[:, 0]
    on_path = ancestors.gather(1, deepest[:, :, None].expand(-1, 1, ancestors.shape[2]))[:, 0]
    at_level = on_path[:, None, :] & (depth[:, None, :] == torch.arange(levels, device=depth.device)[:, None])
    path = at_level.int().argmax(dim=2)
    drafts = token.gather(1, path)
    bonus = target_argmax.gather(1, path.gather(1, n[:, None]))
    span = torch.cat([drafts[:, 1:], drafts[:, :1]], dim=1).scatter(1, n[:, None], bonus)
    return n, path, span


def compact_on_device(cache: DeviceKVCache | HybridCache, start: torch.Tensor, path: torch.Tensor, n: torch.Tensor) -> None:
    """tree.compact_kv with device indices: slot start + j takes slot start + path[j], the length
    becomes start + n + 1 (slots after it receive don't-care values)."""
    if isinstance(cache, HybridCache):  # the linear layers take the path's state too (hybrid_tree.py)
        cache.commit_path(start, path, n)
        return
    src = start + path
    dst = start + torch.arange(path.shape[0], device=path.device)
    if cache.stacked is not None:  # every layer's k and v in one gather and one scatter
        cache.stacked.index_copy_(4, dst, cache.stacked.index_select(4, src))
    else:
        for k, v in zip(cache.k, cache.v):
            k.index_copy_(2, dst, k.index_select(2, src))  # gathered first: overlapping moves are safe
            v.index_copy_(2, dst, v.index_select(2, src))
    cache.rollback(start + n + 1)


# (logp, ids [D, K], anchor [1], budget) -> parent, depth, token, score [budget + 1] (tree.best_first_tree_padded);
# a batch of trees: [B, D, K] and anchors [B] -> [B, budget + 1] each (the batched engine's)
TreeBuilder = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int],
                       tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]


class _TreeSteps:
    """Mixed into a chain runner: the same drafting, verified as a best-first tree of `budget`
    nodes (plus the anchor) from the drafter's top-k; the KV of the accepted path is compacted."""

    def _init_tree(self, positions: int, budget: int, topk: int, build: TreeBuilder | None) -> None:
        if budget < 1 or topk < 1:
            raise ValueError(f"budget and topk must be >= 1, got {budget}, {topk}")
        self.positions, self.budget, self.topk = positions, budget, topk
        self.build = build or best_first_tree_padded

    def _propose(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The drafter's logits [D, V] -> the tree (parent, depth, token) and its ancestor mask."""
        logp, ids = torch.log_softmax(logits.float(), dim=-1).topk(min(self.topk, logits.shape[-1]), dim=-1)
        parent, depth, token, _ = self.build(logp, ids, self.last, self.budget)
        return parent, depth, token, ancestor_mask_static(parent, self.positions)

    def _parts(self) -> dict[str, Callable[[], object]]:
        logits = self._draft()  # one drafting fixes the proposal's input and the verified tree
        parent, depth, token, ancestors = self._propose(logits)

        def verify() -> None:
            start = self.t_cache.length
            self.target(token[None], self.t_cache, mask=ancestors, positions=(start + depth)[None],
                        positions_in_cache=True, hidden_layers=self.layers)

        return {"draft": self._draft, "propose": lambda: self._propose(logits), "verify": verify}

    def _step(self) -> None:
        parent, depth, token, ancestors = self._propose(self._draft())
        start = self.t_cache.length.clone()
        out = self.target(token[None], self.t_cache, mask=ancestors, positions=(start + depth)[None],
                          positions_in_cache=True, hidden_layers=self.layers)
        if self.rng is None:
            choice = out.logits[0].argmax(-1)
        else:  # one draw from p a node, followed where greedy follows the argmax
            choice = tree_draws(out.logits[0], self.sampling, self.rng)
            self.rng.advance()
        n, path, span = accept_tree_on_device(parent, depth, token, ancestors, choice, self.block)
        compact_on_device(self.t_cache, start, path, n)
        self._commit_draft(n, span, None if out.hidden is None else out.hidden.index_select(1, path))


class GraphedTreeDFlash(_TreeSteps, GraphedDFlash):
    """DFlash-style drafting verified as a best-first tree, one CUDA graph a step."""

    def __init__(self, target: Transformer, drafter: DFlashDrafter, capacity: int, block_size: int, budget: int,
                 topk: int, mask_token_id: int, eos_token_id: int | None, build: TreeBuilder | None = None,
                 sampling: SamplingParams = GREEDY) -> None:
        super().__init__(target, drafter, capacity, block_size, mask_token_id, eos_token_id, extra_slots=budget + 1,
                         sampling=sampling)
        self._init_tree(block_size - 1, budget, topk, build)


class GraphedTreePard(_TreeSteps, GraphedPard):
    """PARD-style drafting (as GraphedPard) verified as a best-first tree, one CUDA graph a step."""

    def __init__(self, target: Transformer, drafter: Transformer, capacity: int, k: int, budget: int, topk: int,
                 mask_token_id: int, eos_token_id: int | None, build: TreeBuilder | None = None,
                 sampling: SamplingParams = GREEDY) -> None:
        super().__init__(target, drafter, capacity, k, mask_token_id, eos_token_id, extra_slots=budget + 1,
                         sampling=sampling)
        self._init_tree(k, budget, topk, build)


def generate_dflash_tree_graphed(target: Transformer, drafter: DFlashDrafter, prompt_ids, *, block_size: int,
                                 budget: int, topk: int, mask_token_id: int, max_new_tokens: int,
                                 eos_token_id: int | None, build: TreeBuilder | None = None,
                                 sampling: SamplingParams = GREEDY) -> Generation:
    """`tree_decode.generate_dflash_tree` (best-first), one CUDA graph a step; `build` the tree
    builder (default: the host heap, `tree.best_first_tree_padded`)."""
    key = ("dflash-tree", id(drafter), block_size, budget, topk, mask_token_id, eos_token_id, build,
           _sampling_key(sampling))
    make = lambda cap: GraphedTreeDFlash(target, drafter, cap, block_size, budget, topk, mask_token_id,  # noqa: E731
                                         eos_token_id, build, sampling)
    runner = runner_for(target, key, make, _length(prompt_ids) + max_new_tokens, drafter)
    return runner.generate(prompt_ids, max_new_tokens=max_new_tokens, eos_token_id=eos_token_id, seed=sampling.seed)


def generate_pard_tree_graphed(target: Transformer, drafter: Transformer | PardDrafter, prompt_ids, *, k: int,
                               budget: int, topk: int, mask_token_id: int, max_new_tokens: int,
                               eos_token_id: int | None, build: TreeBuilder | None = None,
                               sampling: SamplingParams = GREEDY) -> Generation:
    """`tree_decode.generate_pard_tree` (best-first), one CUDA graph a step; `build` as above."""
    model = drafter.model if isinstance(drafter, PardDrafter) else drafter
    key = ("pard-tree", id(model), k, budget, topk, mask_token_id, eos_token_id, build, _sampling_key(sampling))
    make = lambda cap: GraphedTreePard(target, model, cap, k, budget, topk, mask_token_id, eos_token_id,  # noqa: E731
                                       build, sampling)
    runner = runner_for(target, key, make, _length(prompt_ids) + max_new_tokens, model)
    return runner.generate(prompt_ids, max_new_tokens=max_new_tokens, eos_token_id=eos_token_id, seed=sampling.seed)

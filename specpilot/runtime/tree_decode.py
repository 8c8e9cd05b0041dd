"""Greedy tree-verification decode loops for parallel drafters (DFlash- and PARD-style).

One step is draft -> propose -> verify -> accept -> commit, as for chains (decode.py), except:

  propose  top-k of the drafter's per-position distributions -> a candidate tree of `budget`
           nodes (best-first by default, see tree.py), padded to budget + 1 with the anchor;
  verify   one target forward over the tree's tokens at positions prefix + depth under the
           ancestor-only mask (`verify_tree`);
  accept   `accept_tree`: the longest root path whose tokens each equal the target's argmax at
           their parent, plus the bonus (the target's argmax at the path's last node);
  commit   accepted tokens + bonus are appended; `compact_kv` leaves the target's cache holding
           exactly the root path (the anchor and the accepted drafts).

Lossless: every accepted token is the target's greedy choice given the committed prefix, since a
node's logits see exactly its ancestors at their sequence positions (the tests check the output
against AR greedy in fp32 and, for DFlash, the context features against a linear forward).
Sampled (`sampling` at temperature > 0; sampling.py, docs/SAMPLING.md): the tree stays the
drafter's top-k tree; every node gets one independent draw from the target's p at that node, and
acceptance follows the draws where greedy follows the argmax: lossless in distribution.
Accounting is decode.py's: Generation.accepted[i] = drafts accepted in step i (bonus excluded,
cut at EOS / max_new_tokens), so τ compares directly with the chain loops.
The DFlash drafter's next context is the target's hidden states at the accepted path's nodes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from specpilot.runtime.cache import KVCache
from specpilot.runtime.decode import Generation, OutputTokens, check_max_new, DecodeClock, prompt_tensor
from specpilot.runtime.dflash import DFlashDrafter
from specpilot.runtime.hybrid import HybridCache
from specpilot.runtime.model import PardDrafter, Transformer
from specpilot.runtime.sampling import GREEDY, SamplingParams, StepRandom, first_token, tree_draws
from specpilot.runtime.tree import TREE_SHAPES, Tree, accept_tree, ancestor_mask, compact_kv, draft_topk


VerifyOut = tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]  # logits [n, V], hidden or None, ancestor mask


class Pruning(Protocol):
    """A first level as the tree loops take it (two_level.FirstLevel): cuts each drafted tree to the
    nodes the target verifies, then verifies them (`verify_tree_logits`'s contract; it may continue a
    forward the cut began)."""

    def __call__(self, tree: Tree, cache: KVCache) -> Tree: ...

    def verify(self, target: Transformer, cache: KVCache, tree: Tree, hidden_layers: tuple[int, ...] = ()
               ) -> VerifyOut: ...


def verify_tree(
    target: Transformer, cache: KVCache, tree: Tree, hidden_layers: tuple[int, ...] = ()
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Target forward over the tree's nodes after the cache's prefix: (argmax [n], hidden
    [1, n, ...] or None, ancestor mask [n, n]). The nodes' K/V land in slots [length, +n)."""
    logits, hidden, mask = verify_tree_logits(target, cache, tree, hidden_layers)
    return logits.argmax(-1), hidden, mask


def verify_tree_logits(
    target: Transformer, cache: KVCache, tree: Tree, hidden_layers: tuple[int, ...] = ()
) -> VerifyOut:
    """`verify_tree` with the logits [n, V] in place of their argmax."""
    mask = ancestor_mask(tree)
    positions = (cache.length + tree.depth)[None]
    out = target(tree.token[None], cache, mask=mask, positions=positions, positions_in_cache=True,
                 hidden_layers=hidden_layers)
    return out.logits[0], out.hidden, mask


def commit_tree(cache: KVCache | HybridCache, start: int, path: list[int]) -> None:
    """Keep the accepted root path (node indices) of the tree verified from `start`: the KV moves
    into place (`compact_kv`); a hybrid target's linear layers also take the path's state."""
    if isinstance(cache, HybridCache):
        cache.commit_path(start, path)
    else:
        compact_kv(cache, start, [start + i for i in path])


def propose_tree(draft_logits: torch.Tensor, anchor: int, *, budget: int, topk: int, shape: str,
                 device: torch.device) -> Tree:
    """Drafter logits [D, V] -> the candidate tree, padded to budget + 1 nodes, on `device`."""
    if shape not in TREE_SHAPES:
        raise ValueError(f"tree shape must be one of {', '.join(TREE_SHAPES)}, got {shape!r}")
    logp, ids = draft_topk(draft_logits, topk)
    tree = TREE_SHAPES[shape](logp.cpu(), ids.cpu(), anchor, budget=budget)
    return tree.padded(budget + 1).to(device)


class _TreeStep:
    """verify -> accept -> commit on the target, shared by both drafter kinds; greedy, or following
    one draw from p a node when `sampling` samples."""

    def __init__(self, target: Transformer, cache: KVCache, out: OutputTokens, layers: tuple[int, ...] = (),
                 sampling: SamplingParams = GREEDY, verify: Callable[..., VerifyOut] = verify_tree_logits):
        self.target, self.cache, self.out, self.layers, self.verify = target, cache, out, layers, verify
        self.accepted: list[int] = []
        self.sampling = sampling
        self.rng = None if sampling.greedy else StepRandom.for_seed(sampling.seed, target.device)

    def first(self, logits: torch.Tensor) -> int:
        """The token after the prompt from the prefill's last logits [V]."""
        return first_token(logits, self.sampling, self.rng)

    def __call__(self, tree: Tree) -> tuple[list[int], torch.Tensor | None]:
        """Returns (committed span: accepted drafts + bonus, hidden states of the path's nodes)."""
        start = self.cache.length
        logits, hidden, mask = self.verify(self.target, self.cache, tree, self.layers)
        if self.rng is None:
            choice = logits.argmax(-1)
        else:
            choice = tree_draws(logits, self.sampling, self.rng)
            self.rng.advance()
        path, bonus = accept_tree(tree, choice, mask)
        tokens = tree.token[path].tolist()
        span = tokens[1:] + [bonus]
        self.accepted.append(self.out.extend(span) - 1)
        commit_tree(self.cache, start, path)
        path_hidden = hidden[:, path] if hidden is not None else None
        return span, path_hidden


def _check_tree_args(budget: int, topk: int) -> None:
    if budget < 1:
        raise ValueError(f"budget must be >= 1, got {budget}")
    if topk < 1:
        raise ValueError(f"topk must be >= 1, got {topk}")


def generate_dflash_tree(
    target: Transformer,
    drafter: DFlashDrafter,
    prompt_ids: Sequence[int] | torch.Tensor,
    *,
    block_size: int,
    budget: int,
    topk: int,
    mask_token_id: int,
    max_new_tokens: int,
    eos_token_id: int | None,
    shape: str = "best-first",
    sampling: SamplingParams = GREEDY,
    prune: Pruning | None = None,
) -> Generation:
    """DFlash-style drafting (block_size-1 positions per block) verified as a tree of `budget` nodes;
    `prune` (a two-level first level, `Pruning`) first cuts each drafted tree to the nodes the target
    verifies, and verifies them."""
    check_max_new(max_new_tokens)
    _check_tree_args(budget, topk)
    if block_size < 2:
        raise ValueError(f"block_size must be >= 2 (anchor + drafts), got {block_size}")
    target.eval()
    drafter.eval()
    layers = tuple(drafter.target_layer_ids)
    clock = DecodeClock(target.device)
    out = OutputTokens(max_new_tokens, eos_token_id)
    if out.done:
        return Generation(tokens=[])
    with torch.inference_mode():
        prompt = prompt_tensor(prompt_ids, target.device)
        t_cache = target.new_cache(1, prompt.shape[1] + max_new_tokens + budget + 1)
        d_cache = drafter.new_cache(1, prompt.shape[1] + max_new_tokens + block_size + 1)
        step = _TreeStep(target, t_cache, out, layers, sampling, verify_tree_logits if prune is None else prune.verify)
        t0 = clock()
        pre = target(prompt, t_cache, hidden_layers=layers, only_last=True)
        first = step.first(pre.logits[0, -1])
        drafter.add_context(pre.hidden, d_cache)
        new_context = pre.hidden[:, :0]
        last = first
        out.extend([first])
        t1 = clock()
        masks = [mask_token_id] * (block_size - 1)
        while not out.done:
            block = torch.tensor([[last] + masks], dtype=torch.long, device=target.device)
            logits = drafter(block, new_context, d_cache)[0]
            tree = propose_tree(logits, last, budget=budget, topk=topk, shape=shape, device=target.device)
            if prune is not None:
                tree = prune(tree, t_cache)
            span, new_context = step(tree)  # the anchor and the accepted drafts become context
            last = span[-1]
        t2 = clock()
    return Generation(tokens=out.tokens, accepted=step.accepted, steps=len(step.accepted),
                      prefill_s=t1 - t0, decode_s=t2 - t1)


def generate_pard_tree(
    target: Transformer,
    drafter: Transformer | PardDrafter,
    prompt_ids: Sequence[int] | torch.Tensor,
    *,
    k: int,
    budget: int,
    topk: int,
    mask_token_id: int,
    max_new_tokens: int,
    eos_token_id: int | None,
    shape: str = "best-first",
    sampling: SamplingParams = GREEDY,
    prune: Pruning | None = None,
) -> Generation:
    """PARD-style drafting (k positions per forward, see decode.generate_pard) verified as a tree;
    `prune` as for generate_dflash_tree."""
    check_max_new(max_new_tokens)
    _check_tree_args(budget, topk)
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    draft_model = drafter.model if isinstance(drafter, PardDrafter) else drafter
    target.eval()
    draft_model.eval()
    clock = DecodeClock(target.device)
    out = OutputTokens(max_new_tokens, eos_token_id)
    if out.done:
        return Generation(tokens=[])
    with torch.inference_mode():
        prompt = prompt_tensor(prompt_ids, target.device)
        t_cache = target.new_cache(1, prompt.shape[1] + max_new_tokens + budget + 1)
        d_cache = draft_model.new_cache(1, prompt.shape[1] + max_new_tokens + k + 1)
        step = _TreeStep(target, t_cache, out, sampling=sampling,
                         verify=verify_tree_logits if prune is None else prune.verify)
        t0 = clock()
        first = step.first(target(prompt, t_cache, only_last=True).logits[0, -1])
        draft_model(prompt.to(draft_model.device), d_cache, only_last=True)
        seq = prompt[0].tolist()
        out.extend([first])
        seq.append(first)
        t1 = clock()
        masks = [mask_token_id] * (k - 1)
        while not out.done:
            fresh = seq[d_cache.length :]
            ids = torch.tensor([fresh + masks], dtype=torch.long, device=draft_model.device)
            logits = draft_model(ids, d_cache).logits[0, len(fresh) - 1 :]
            d_cache.rollback(len(seq))
            tree = propose_tree(logits, seq[-1], budget=budget, topk=topk, shape=shape, device=target.device)
            if prune is not None:
                tree = prune(tree, t_cache)
            span, _ = step(tree)
            seq.extend(span)
        t2 = clock()
    return Generation(tokens=out.tokens, accepted=step.accepted, steps=len(step.accepted),
                      prefill_s=t1 - t0, decode_s=t2 - t1)

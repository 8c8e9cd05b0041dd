"""Batched speculative decoding: many requests at once, joining and leaving at every step.

`BatchEngine` implements `engine_api.StepEngine` over the runtime's own models (no new model code):
it drives their layers through `ragged_forward`, which runs the rows of many requests packed into
one flat token batch (no padding to the longest), each request with its own KV slot, past length,
positions and visibility.

KV: one static cache of `max_batch + 1` rows (`SlotKV`: the runtime's stacked KVCache, a row a
request, the last row scratch for padding rows of CUDA-graph buckets) with a host length per row;
rollback is a pointer move per request, as in the batch-1 loops. A DFlash drafter keeps its context
K/V in a SlotKV of its own, a PARD drafter its causal LM's.

One `step()`:

  admit     requests admitted since the last step are prefilled together (packed, causal each),
            emitting their first token;
  control   each running request's draft length (BatchPolicy: spec control, else the block's);
  draft     one drafter forward over every drafting request: DFlash adds each request's new context
            features (the target's hidden states of its last committed tokens) and drafts its block;
            PARD runs each request's fresh committed tokens + masks, causal;
  budget    with verify-budget, the batch-wide number of verified drafts and its split by survival
            (batch_control.choose_verify_budget); without ragged packing every request is padded
            to the longest share (it verifies that many of its drafts); with trees and `keep` (two-level
            verification) the total over every request's tree nodes, split by the first level's scores
            (an early exit first runs the target's first layers over every drafted tree, packed);
  verify    one target forward over [last committed token, drafts...] of every request, packed;
  accept    on the device: per request the longest prefix of drafts equal to the target's argmax,
            and the bonus; one transfer a step of (accepted count, bonus) and the drafts, which stay
            on the device from drafting to the verify's ids (verify-budget over the drafter's
            confidences reads those before the verify);
  commit    each request's target cache length moves to its accepted path (a pointer move).

Lossless: a request's rows see exactly its own cached prefix and its own earlier rows (the
attention is per request; nothing of another request is visible), so each committed token is the
target's greedy choice given that request's prefix, as in its own batch-1 AR run (tests: every
request's output equals its batch-1 AR output in fp32, whatever shares its batch and whenever it
joins or leaves).

Hybrid targets (Qwen3-Next family: Gated DeltaNet layers beside gated attention) run the same step
eagerly (batch_hybrid.py): the attention layers' K/V in the SlotKV, and a recurrent-state row a
request (`SlotStates`: each layer's state and conv inputs, zeroed when a request takes the slot). The
verify runs every request's rows as its own tree over its own row (a chain: every node under the one
before), the requests batched, and changes no row; after acceptance each request's row moves along
its accepted path only (`commit_states`), so nothing of a rejected draft stays. No graphs and no
early-exit first level for them (refused).

Attention is a hook (`attention`): `ragged_attention_reference` (SDPA per request, the default) or
the split-KV kernel's ragged mode, which a backend installs (backends/kernel_hooks.py).

Sampling: a request at temperature > 0 shares the batch with greedy ones and samples losslessly as
the batch-1 loops do (runtime/sampling.py, docs/SAMPLING.md): its drafts drawn from the drafter's
q and rejection sampling at accept for chains (`sampling.accept_chains`, all sampled requests of a
step at once, each with its own temperature and top_p), one draw from p a node for trees. Each
request draws from its own counter-based uniforms (its seed, its own step counter), and its number
of verified drafts is its own (the verify budget, spec control's batch-wide AR switch and two-level's
batch-wide first level leave it alone; padding rows are verified but not accepted), so its tokens do not depend on what shares
its batch: they are the batch-1 loop's for its seed (tests/test_batch_sampling.py). Steps with a
sampled request run the verify eagerly (graphed verifies return only the greedy acceptance).

CUDA graphs (BatchConfig.graphs): the verify forward with greedy acceptance (GraphedVerify) and the
drafter's forwards (GraphedDraft: DFlash's context update and block pass, PARD's forward and head)
are replays of graphs captured once a shape over StaticRagged inputs, so nothing inside reads a host
value; the attention must read the Ragged's device tensors (the split-KV kernel's ragged mode),
which BatchEngine checks. A greedy tree step is one replay too (GraphedVerify.tree): the trees built
by a device builder (the best-first kernel, a program a tree) from the drafts' top-k, the verify
under their ancestor masks, tree acceptance and each request's KV compaction. Around them a step
stays eager: the host bookkeeping (spec control, verify budget, the Ragged layouts and their
host-to-device copies), the draft hook, the drafts' argmax (chains) or top-k (trees) and their
gather into the verify's inputs, and one read a step (accepted counts, bonus tokens and drafts or
tree paths together). Two-level verification and steps with a sampled request run eagerly. On other
devices the same code runs as is (the CPU tests).
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING

import torch

from specpilot.runtime.batch_control import (BatchPolicy, SpecControl, StepCost, choose_verify_budget,
                                             survival_from_confidence, survival_from_rate)
from specpilot.runtime.batch_hybrid import SlotStates, hybrid_ragged_forward, hybrid_slots
from specpilot.runtime.cache import KVCache
from specpilot.runtime.decode import OutputTokens
from specpilot.runtime.dflash import DFlashDrafter
from specpilot.runtime.engine_api import RequestParams
from specpilot.runtime.hybrid import HybridTransformer
from specpilot.runtime.model import PardDrafter, Transformer, attend, build_mask
from specpilot.runtime.sampling import (GREEDY, STREAM_DRAFT, SamplingParams, StepRandom, accept_chains, first_token,
                                        probabilities_at, request_sampling, sample_tokens, tree_draws, uniforms)
from specpilot.runtime.tree import (Tree, accept_tree, ancestor_mask, best_first_size, best_first_tree,
                                    best_first_tree_padded, draft_topk)
from specpilot.runtime.two_level import EXITS, FIRST_LEVELS, forest, level_scores, share_budget, subtree, survivors

if TYPE_CHECKING:
    from specpilot.runtime.graph_decode import TreeBuilder


@dataclass(frozen=True, eq=False)
class Ragged:
    """Rows of several requests packed flat: request i owns rows starts[i]..starts[i]+counts[i]-1,
    sits in KV row slots[i], has pasts[i] cached keys (all visible to its rows), and its new rows
    sit at key slots pasts[i].. and see each other as `mask` says ("causal", "full", or per request
    a bool [count, count] tensor: a tree). `positions` (RoPE) default to the key slots."""

    slots: tuple[int, ...]
    pasts: tuple[int, ...]
    counts: tuple[int, ...]
    mask: str | tuple[torch.Tensor, ...]
    device: torch.device
    positions: torch.Tensor | None = None  # [N] int64, when not the key slots (trees: past + depth)
    pad_to: int = 0  # total rows after padding (CUDA-graph buckets): extra rows go to `pad_slot`
    pad_slot: int = -1

    def __post_init__(self):
        if not (len(self.slots) == len(self.pasts) == len(self.counts)):
            raise ValueError("Ragged: slots, pasts and counts must have one entry per request")
        if any(c < 1 for c in self.counts):
            raise ValueError(f"Ragged: every request needs at least one row, got counts {self.counts}")

    @cached_property
    def starts(self) -> tuple[int, ...]:
        out, s = [], 0
        for c in self.counts:
            out.append(s)
            s += c
        return tuple(out)

    @property
    def rows(self) -> int:
        return sum(self.counts)

    @property
    def total(self) -> int:
        return max(self.rows, self.pad_to)

    @property
    def max_count(self) -> int:
        return max(self.counts)

    @cached_property
    def token_slot(self) -> torch.Tensor:
        """[total] the KV row of every packed row (padding rows: pad_slot)."""
        ids = [s for s, c in zip(self.slots, self.counts) for _ in range(c)]
        ids += [self.pad_slot] * (self.total - len(ids))
        return torch.tensor(ids, dtype=torch.long, device=self.device)

    @cached_property
    def token_key(self) -> torch.Tensor:
        """[total] the key slot every packed row writes (padding rows: 0..)."""
        keys = [p + j for p, c in zip(self.pasts, self.counts) for j in range(c)]
        keys += list(range(self.total - len(keys)))
        return torch.tensor(keys, dtype=torch.long, device=self.device)

    @cached_property
    def token_position(self) -> torch.Tensor:
        if self.positions is None:
            return self.token_key
        pad = torch.arange(self.total - self.rows, device=self.device)
        return torch.cat((self.positions.to(self.device), pad))

    @cached_property
    def device_args(self) -> dict[str, torch.Tensor]:
        """cu_seqlens [B+1], slots [B], pasts [B] as int32 device tensors (the kernel's arguments)."""
        i32 = dict(dtype=torch.int32, device=self.device)
        return {"cu": torch.tensor([*self.starts, self.rows], **i32), "slots": torch.tensor(self.slots, **i32),
                "pasts": torch.tensor(self.pasts, **i32)}

    def request_mask(self, i: int) -> str | torch.Tensor:
        return self.mask if isinstance(self.mask, str) else self.mask[i]

    @cached_property
    def tree_masks(self) -> torch.Tensor | None:
        """[B, T, T] bool (T the longest count), each request's tree in its top-left corner."""
        if isinstance(self.mask, str):
            return None
        t = self.max_count
        out = torch.zeros(len(self.counts), t, t, dtype=torch.bool, device=self.device)
        for i, (m, c) in enumerate(zip(self.mask, self.counts)):
            out[i, :c, :c] = m.to(self.device)
        return out


RaggedAttention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, Ragged], torch.Tensor]


def ragged_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, r: Ragged) -> torch.Tensor:
    """q [N, H, D] packed (N >= r.rows) over k, v [slots, Hkv, cap, D] -> [N, H, D]: request i's rows
    attend to its slot's first pasts[i] keys and its own new keys as the mask says (SDPA per
    request, the batch-1 loops' own attention). Padding rows come out zero."""
    out = torch.zeros_like(q)
    for i, (slot, past, count, start) in enumerate(zip(r.slots, r.pasts, r.counts, r.starts)):
        qi = q[start:start + count].transpose(0, 1)[None]  # [1, H, T, D]
        k = k_cache[slot:slot + 1, :, :past + count]
        v = v_cache[slot:slot + 1, :, :past + count]
        o = attend(qi, k, v, build_mask(r.request_mask(i), past, count, q.device))
        out[start:start + count] = o[0].transpose(0, 1)
    return out


class SlotKV:
    """A static KV cache of `rows` request rows (the runtime's stacked KVCache) and a host length
    per row. Row `rows - 1` is scratch (where padding rows of a bucketed forward write)."""

    def __init__(self, cache: KVCache, rows: int) -> None:
        self.cache = cache
        self.rows = rows
        self.lengths = [0] * rows

    @property
    def capacity(self) -> int:
        return self.cache.max_len

    @property
    def scratch(self) -> int:
        return self.rows - 1

    def compact(self, slot: int, start: int, path_slots: Sequence[int]) -> None:
        """Row `slot` keeps the K/V of `path_slots` (ascending, each >= its destination) at slots
        start.. in every layer, and its length becomes start + len(path_slots) (tree.compact_kv's
        move, for one request)."""
        n = len(path_slots)
        if list(path_slots) != list(range(start, start + n)):
            src = torch.as_tensor(path_slots, dtype=torch.long, device=self.cache.stacked.device)
            rows = self.cache.stacked[:, :, slot]  # [2, layers, Hkv, cap, D]
            rows[:, :, :, start:start + n] = rows[:, :, :, src]  # the gather copies first
        self.lengths[slot] = start + n

    def gather(self, slot: int, start: int, src: Sequence[int], layers: int) -> None:
        """Row `slot`'s K/V of layers 0..layers-1 at key slots start + src[j] move to start + j (gathered
        first, so overlapping moves are safe); the length does not move (two_level.move_kv's, per request)."""
        n = len(src)
        if list(src) != list(range(n)):
            index = start + torch.as_tensor(list(src), dtype=torch.long, device=self.cache.stacked.device)
            rows = self.cache.stacked[:, :layers, slot]  # [2, layers, Hkv, cap, D]
            rows[:, :, :, start:start + n] = rows[:, :, :, index]

    def write(self, layer: int, r: Ragged, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v [1, Hkv, N, D] of the packed rows into their slots and key slots."""
        self.cache.k[layer][r.token_slot, :, r.token_key] = k[0].transpose(0, 1)
        self.cache.v[layer][r.token_slot, :, r.token_key] = v[0].transpose(0, 1)


@dataclass
class RaggedOutput:
    x: torch.Tensor  # [N, hidden] after the final norm (the head's input)
    hidden: torch.Tensor | None  # [N, len(layers) * hidden] of the asked layers


def ragged_layers(model: Transformer, kv: SlotKV, x: torch.Tensor, r: Ragged, attention: RaggedAttention,
                  layers: range, hidden_layers: tuple[int, ...] = ()) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """The model's `layers` over packed rows x [1, N, hidden] (the batch-1 forward's ops, row for row):
    K/V land at each row's slot and key slot. Returns the last layer's output and the outputs of
    the `hidden_layers` among `layers`."""
    cos, sin = model.rope(r.token_position[None], kv.capacity)
    picked = {}
    for i in layers:
        layer = model.model.layers[i]
        attn = layer.self_attn
        h = layer.input_layernorm(x)
        k, v = attn.keys_values(h, cos, sin)
        kv.write(i, r, k, v)
        q = attn.queries(h, cos, sin)[0].transpose(0, 1)  # [N, H, D]
        o = attention(q, kv.cache.k[i], kv.cache.v[i], r)
        x = x + attn.output(o.transpose(0, 1)[None])
        x = x + layer.mlp(layer.post_attention_layernorm(x))
        if i in hidden_layers:
            picked[i] = x
    return x, picked


def ragged_forward(model: Transformer, kv: SlotKV, ids: torch.Tensor, r: Ragged, attention: RaggedAttention,
                   hidden_layers: tuple[int, ...] = ()) -> RaggedOutput:
    """The model's layers over packed rows ids [N] (the batch-1 forward's ops, row for row): K/V land
    at each row's slot and key slot; lengths are the caller's to move."""
    x, picked = ragged_layers(model, kv, model.embed(ids[None]), r, attention, range(len(model.model.layers)),
                              hidden_layers)
    hidden = torch.cat([picked[i] for i in hidden_layers], dim=-1)[0] if hidden_layers else None
    return RaggedOutput(model.final_norm(x)[0], hidden)


def dflash_add_context(drafter: DFlashDrafter, kv: SlotKV, hidden: torch.Tensor, r: Ragged) -> None:
    """Each request's new context features (packed rows of `hidden`) into its drafter slot, kept."""
    ctx = drafter.encoder(hidden[None].to(drafter.dtype))
    cos, sin = drafter.rope(r.token_position[None], kv.capacity)
    for i, layer in enumerate(drafter.layers):
        k, v = layer.self_attn.keys_values(ctx, cos, sin)
        kv.write(i, r, k, v)


def dflash_draft(drafter: DFlashDrafter, kv: SlotKV, blocks: torch.Tensor, r: Ragged,
                 attention: RaggedAttention, block_size: int) -> torch.Tensor:
    """Blocks [anchor, mask x (bs-1)] of each request (packed, `r` with mask "full" at the context
    lengths; bs = block_size) -> logits [total / bs, bs-1, V]: DFlashDrafter.forward's ops per request,
    the block's K/V in scratch slots past the context. Padding rows (r.total past r.rows, whole blocks
    of padding requests) come out as don't-care blocks; no host field of `r` is read (GraphedDraft
    captures this)."""
    x = drafter.embed(blocks[None]).to(drafter.dtype)
    cos, sin = drafter.rope(r.token_position[None], kv.capacity)
    for i, layer in enumerate(drafter.layers):
        attn = layer.self_attn
        h = layer.input_layernorm(x)
        k, v = attn.keys_values(h, cos, sin)
        kv.write(i, r, k, v)
        q = attn.queries(h, cos, sin)[0].transpose(0, 1)
        x = x + attn.output(attention(q, kv.cache.k[i], kv.cache.v[i], r).transpose(0, 1)[None])
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    x = x[0].view(-1, block_size, x.shape[-1])[:, 1:]
    return drafter.head(drafter.norm(x))


@dataclass
class Request:
    rid: str
    slot: int
    prompt: list[int]
    out: OutputTokens
    seq: list[int] = field(default_factory=list)  # prompt + committed output
    prefilled: bool = False
    context: torch.Tensor | None = None  # DFlash: hidden rows of committed tokens not yet in the drafter's cache
    accepted: list[int] = field(default_factory=list)  # drafts accepted per speculative step (bonus excluded)
    verified: list[int] = field(default_factory=list)  # drafts verified per step (0: an AR step)
    sampling: SamplingParams = GREEDY
    rng: StepRandom | None = None  # a sampled request's uniforms (its seed, its step counter)


@dataclass(frozen=True)
class BatchConfig:
    """Sizes of a batched engine: concurrent requests and KV slots per request (prompt + output +
    one verify block must fit), and token-count buckets of the verify forward (0: exact counts)."""

    max_batch: int = 8
    capacity: int = 1024
    buckets: tuple[int, ...] = ()  # verify forwards padded up to the next bucket (CUDA-graph shapes)
    graphs: bool = False  # verify (chain or tree step) and drafter forwards as CUDA-graph replays by shape

    def __post_init__(self):
        if self.max_batch < 1 or self.capacity < 2:
            raise ValueError(f"BatchConfig: max_batch >= 1 and capacity >= 2 expected, got {self.max_batch}, {self.capacity}")
        if list(self.buckets) != sorted(set(self.buckets)) or any(b < 1 for b in self.buckets):
            raise ValueError(f"BatchConfig.buckets must be increasing positive token counts, got {self.buckets}")
        if self.graphs and not self.buckets:
            raise ValueError("BatchConfig.graphs needs buckets: a graph serves one token count")

    def bucket(self, rows: int) -> int:
        for b in self.buckets:
            if b >= rows:
                return b
        return rows


@dataclass
class StepStats:
    """What the engine did, summed over steps (for benchmarks and tests)."""

    steps: int = 0
    verify_rows: int = 0  # packed verify rows, padding to buckets excluded
    padded_rows: int = 0  # rows of padding to the longest share (ragged off) and to buckets
    drafted_requests: int = 0
    committed: int = 0
    ar_steps: int = 0  # steps where no request speculated
    spec_request_steps: int = 0  # (request, step) pairs that verified at least one draft
    spec_committed: int = 0  # tokens those committed (bonus included)
    prefill_s: float = 0.0  # wall time of the prefill forwards (synchronized), so benchmarks can exclude it
    prefill_cpu_s: float = 0.0  # the calling thread's CPU time in them (a loaded CPU's benchmarks)
    prefill_tokens: int = 0  # first tokens the prefills committed
    pruned_nodes: int = 0  # drafted tree nodes a batch-wide first level did not verify (keep)

    @property
    def tau(self) -> float:
        """Tokens a request commits per step it speculated, bonus included (1.0 when none did)."""
        return self.spec_committed / self.spec_request_steps if self.spec_request_steps else 1.0


class BatchEngine:
    """Continuous batching over a target and a parallel drafter (or none: batched AR)."""

    def __init__(self, target: Transformer | HybridTransformer, drafter: DFlashDrafter | PardDrafter | None, *,
                 eos_token_id: int | None,
                 config: BatchConfig = BatchConfig(), policy: BatchPolicy | None = None,
                 block_size: int | None = None, attention: RaggedAttention = ragged_attention_reference,
                 draft_hook: Callable[[torch.Tensor, list["Request"], list[int]], torch.Tensor] | None = None,
                 tree: tuple[int, int] | None = None, keep: int | None = None, first: str = "drafter",
                 exit_layer: int = 0, tree_builder: TreeBuilder | None = None) -> None:
        """`block_size`: DFlash block incl. the anchor / PARD k (default the drafter's). `draft_hook`
        (logits [B, k, V], the drafting requests, the absolute position of each one's first draft)
        may rewrite the drafts' logits (replay drafters). `tree` (budget, top-k): verify best-first
        trees instead of chains; with graphs a greedy tree step is one replay (GraphedVerify.tree),
        its trees built by `tree_builder` (graph_decode.TreeBuilder over a batch: a backend installs
        the Triton kernel; default the host heap, which only runs uncaptured). `keep`: two-level verification's
        drafter first level with a batch-wide budget: each step verifies at most `keep` drafted nodes
        a drafting request on average, the best of all requests' trees, as many as the verify budget
        pays for with the policy's verify_budget (`keep_batch_wide`). `first`: the first level that
        scores the nodes (two_level.FIRST_LEVELS); an early exit reads the target's first `exit_layer`
        layers over every drafted tree and the second level continues the survivors from there
        (`first_level`). A hybrid target (HybridTransformer) keeps a recurrent-state row a request
        beside its attention K/V (batch_hybrid.py), eagerly: no graphs, no early-exit first level."""
        if not isinstance(target, (Transformer, HybridTransformer)):
            raise TypeError(f"BatchEngine runs llama/qwen3 targets (Transformer) and Qwen3-Next-family hybrids "
                            f"(HybridTransformer), got {type(target).__name__}")
        hybrid = isinstance(target, HybridTransformer)
        if hybrid and config.graphs:
            raise ValueError("BatchEngine: BatchConfig.graphs is not built for hybrid (Gated DeltaNet) targets: the "
                             "graphed verify replays attention-only layers; run a hybrid target with graphs=False")
        if hybrid and first in EXITS:
            raise ValueError(f"BatchEngine: the {first} first level is not built for hybrid (Gated DeltaNet) targets "
                             "in the batched engine (its second level moves attention K/V only, not the Gated "
                             "DeltaNet layers' pending vectors); use first='drafter'")
        self.target = target.eval()
        self.drafter = drafter
        self.kind = "ar" if drafter is None else "pard" if isinstance(drafter, PardDrafter) else "dflash"
        if block_size is None:
            block_size = 1 if drafter is None else drafter.k if isinstance(drafter, PardDrafter) else drafter.block_size
        self.block_size = block_size
        drafts = 0 if drafter is None else block_size - 1 if self.kind == "dflash" else block_size
        self.policy = policy or BatchPolicy(max_drafts=drafts)
        if self.policy.max_drafts > drafts:
            raise ValueError(f"BatchPolicy.max_drafts={self.policy.max_drafts} exceeds the {drafts} drafts a "
                             f"{self.kind} block of {block_size} makes")
        if tree is not None and drafter is None:
            raise ValueError("BatchEngine: trees need a drafter")
        if keep is not None and config.graphs:
            raise ValueError("BatchEngine: two-level verification (keep) runs without graphs")
        self.tree_builder = tree_builder or best_first_tree_padded
        if (config.graphs and tree is not None and target.device.type == "cuda"
                and self.tree_builder is best_first_tree_padded):
            raise ValueError("BatchEngine: graphed trees need a device tree builder (the best-first kernel: "
                             "backends.kernel_hooks.tree_builder); the host heap reads the drafts on the host, "
                             "which a capture cannot")
        if config.graphs and target.device.type == "cuda" and attention is ragged_attention_reference:
            raise ValueError("BatchEngine: graphed verifies and drafts need an attention that reads the Ragged's "
                             "device tensors (the split-KV kernel's ragged mode: backends.kernel_hooks."
                             "ragged_attention); the torch reference reads its host fields, which a capture would "
                             "freeze at the capture's layout")
        if keep is not None and (tree is None or keep < 1):
            raise ValueError(f"BatchEngine: keep={keep} is a two-level first level's budget over drafted trees: "
                             "expected keep >= 1 with tree=(budget, topk)")
        if first not in FIRST_LEVELS:
            raise ValueError(f"BatchEngine: first must be one of {', '.join(FIRST_LEVELS)}, got {first!r}")
        layers = len(target.model.layers)
        if first in EXITS and (keep is None or not 1 <= exit_layer < layers):
            raise ValueError(f"BatchEngine: the {first} first level needs keep and exit_layer in 1..{layers - 1} "
                             f"(the target has {layers} layers), got keep={keep}, exit_layer={exit_layer}")
        self.tree = tree
        self.keep = keep
        self.first = first
        self.exit_layer = exit_layer if first in EXITS else 0
        self.control = SpecControl(self.policy)
        self.config = config
        self.max_batch = config.max_batch
        self.eos_token_id = eos_token_id
        self.attention = attention
        self.draft_hook = draft_hook
        rows = config.max_batch + 1
        self.states: SlotStates | None = None  # a hybrid target's recurrent-state rows
        if hybrid:
            cache, self.states = hybrid_slots(target, rows, config.capacity)
            self.kv = SlotKV(cache, rows)
        else:
            self.kv = SlotKV(target.new_cache(rows, config.capacity), rows)
        self.draft_kv: SlotKV | None = None
        if self.kind == "dflash":
            self.draft_kv = SlotKV(drafter.new_cache(rows, config.capacity), rows)
        elif self.kind == "pard":
            self.draft_kv = SlotKV(drafter.model.new_cache(rows, config.capacity), rows)
        self.layers = tuple(drafter.target_layer_ids) if self.kind == "dflash" else ()
        self.requests: dict[str, Request] = {}
        self.free = list(range(config.max_batch))
        self.graphed = GraphedVerify(self) if config.graphs else None
        self.graphed_draft = GraphedDraft(self) if config.graphs and drafter is not None else None
        self.stats = StepStats()

    # --- the StepEngine interface ------------------------------------------------------------

    def admit(self, rid: str, prompt_ids: list[int], params: RequestParams) -> None:
        if rid in self.requests:
            raise ValueError(f"request {rid!r} is already active")
        try:
            sampling = request_sampling(params.temperature, params.top_p, params.seed)
        except ValueError as e:
            raise ValueError(f"request {rid!r}: {e}") from None
        if params.max_new_tokens < 0:
            raise ValueError(f"request {rid!r}: max_new_tokens must be >= 0, got {params.max_new_tokens}")
        if not prompt_ids:
            raise ValueError(f"request {rid!r}: the prompt is empty")
        step_rows = max(self.block_size, self.tree[0] + 1 if self.tree is not None else 0)
        need = len(prompt_ids) + params.max_new_tokens + step_rows + 1
        if need > self.config.capacity:
            raise ValueError(f"request {rid!r}: prompt {len(prompt_ids)} + max_new_tokens {params.max_new_tokens} + "
                             f"a step of {step_rows} rows need {need} KV slots; the engine holds {self.config.capacity} "
                             "a request (BatchConfig.capacity)")
        if not self.free:
            raise RuntimeError(f"request {rid!r}: all {self.max_batch} slots are taken; release one first")
        slot = self.free.pop(0)
        if self.states is not None:
            self.states.reset(slot)  # a reused slot still holds its last request's recurrent state
        rng = None if sampling.greedy else StepRandom.for_seed(sampling.seed, self.target.device)
        self.requests[rid] = Request(rid, slot, list(prompt_ids), OutputTokens(params.max_new_tokens, self.eos_token_id),
                                     seq=list(prompt_ids), sampling=sampling, rng=rng)

    def release(self, rid: str) -> None:
        req = self.requests.pop(rid, None)
        if req is None:
            raise KeyError(f"request {rid!r} is not active")
        self.kv.lengths[req.slot] = 0
        if self.draft_kv is not None:
            self.draft_kv.lengths[req.slot] = 0
        self.free.append(req.slot)
        self.free.sort()
        self.control.forget(rid)

    def active(self) -> list[str]:
        return list(self.requests)

    def done(self, rid: str) -> bool:
        """The request has all its tokens (EOS or max_new_tokens): release it."""
        return self.requests[rid].out.done

    def output(self, rid: str) -> list[int]:
        return list(self.requests[rid].out.tokens)

    def request(self, rid: str) -> Request:
        return self.requests[rid]

    @torch.inference_mode()
    def step(self) -> dict[str, list[int]]:
        new: dict[str, list[int]] = {rid: [] for rid in self.requests}
        fresh = [r for r in self.requests.values() if not r.prefilled and not r.out.done]
        if fresh:
            started, cpu = time.perf_counter(), time.thread_time()
            self._prefill(fresh, new)
            if self.target.device.type == "cuda":
                torch.cuda.synchronize(self.target.device)
            self.stats.prefill_s += time.perf_counter() - started
            self.stats.prefill_cpu_s += time.thread_time() - cpu
            self.stats.prefill_tokens += len(fresh)
        running = [r for r in self.requests.values() if r.prefilled and not r.out.done and r not in fresh]
        if running:
            self._decode(running, new)
        return new

    # --- the step's parts --------------------------------------------------------------------

    def target_forward(self, ids: torch.Tensor, r: Ragged, *, prefill: bool = False) -> RaggedOutput:
        """The target over packed rows (ragged_forward), the drafter's hidden layers kept. A hybrid
        target's Gated DeltaNet rows move at once in a `prefill` (a fresh request's prompt), and
        otherwise wait for `commit_states` (batch_hybrid.py)."""
        if self.states is None:
            return ragged_forward(self.target, self.kv, ids, r, self.attention, self.layers)
        x, hidden = hybrid_ragged_forward(self.target, self.kv, self.states, ids, r, self.attention, self.layers,
                                          prefill=prefill)
        return RaggedOutput(x, hidden)

    def commit_states(self, paths: Sequence[Sequence[int]]) -> None:
        """A hybrid target's Gated DeltaNet rows along each request's accepted path of the last
        verify (paths in its requests' order); nothing for an attention target."""
        if self.states is not None:
            self.states.commit(paths)

    def _prefill(self, reqs: list[Request], new: dict[str, list[int]]) -> None:
        dev = self.target.device
        r = Ragged(tuple(q.slot for q in reqs), (0,) * len(reqs), tuple(len(q.prompt) for q in reqs), "causal", dev)
        ids = torch.tensor([t for q in reqs for t in q.prompt], dtype=torch.long, device=dev)
        out = self.target_forward(ids, r, prefill=True)
        last = torch.tensor([s + c - 1 for s, c in zip(r.starts, r.counts)], device=dev)
        logits = self.target.head(out.x[last])
        first = logits.argmax(-1).tolist()
        for i, q in enumerate(reqs):
            if q.rng is not None:
                first[i] = first_token(logits[i], q.sampling, q.rng)
        if self.kind == "dflash":
            dr = Ragged(r.slots, r.pasts, r.counts, "causal", dev)
            dflash_add_context(self.drafter, self.draft_kv, out.hidden, dr)
        elif self.kind == "pard":
            ragged_forward(self.drafter.model, self.draft_kv, ids.to(self.drafter.model.device), r, self.attention)
        for q, tok in zip(reqs, first):
            n = len(q.prompt)
            self.kv.lengths[q.slot] = n
            if self.draft_kv is not None:
                self.draft_kv.lengths[q.slot] = n
            q.prefilled = True
            new[q.rid] += [tok][:q.out.extend([tok])]
            q.seq.append(tok)
        self.stats.committed += len(reqs)

    def _decode(self, reqs: list[Request], new: dict[str, list[int]]) -> None:
        sampled = {q.rid for q in reqs if q.rng is not None}
        lengths = self.control.lengths([q.rid for q in reqs], sampled) if self.kind != "ar" else \
            {q.rid: 0 for q in reqs}
        drafting = [q for q in reqs if lengths[q.rid] > 0]
        if self.tree is not None:
            return self._decode_tree(reqs, drafting, lengths, new)
        count = {q.rid: 0 for q in reqs}  # drafts each request verifies this step
        tokens, q_rows = None, {}
        limit = {q.rid: 0 for q in reqs}  # drafts a request may accept (its own share; padding is not)
        if drafting:
            tokens, confidence, q_rows = self._draft(drafting, lengths)
            self.stats.drafted_requests += len(drafting)
            share = {q.rid: lengths[q.rid] for q in drafting}
            if self.policy.verify_budget:  # sampled requests keep their own share, priced as load
                shared = [q for q in drafting if q.rid not in sampled]
                survival = []
                for q, conf in zip(drafting, confidence):
                    k = lengths[q.rid]
                    if q.rid not in sampled:
                        survival.append(survival_from_confidence(conf[:k]) if self.policy.survival == "confidence"
                                        else survival_from_rate(self.control.rate(q.rid).alpha, k))
                others = len(reqs) - len(drafting)  # AR rows of this step: one each, no drafts
                fixed = sum(1 + share[rid] for rid in share if rid in sampled)
                cost = self.policy.cost
                choice = choose_verify_budget(survival + [[]] * others, cost.verify_past(fixed))
                share.update({q.rid: k for q, k in zip(shared, choice.per_request)})
            limit.update(share)
            if not self.policy.ragged and share:  # pad every drafting request to the longest share
                longest = max(share.values())
                self.stats.padded_rows += sum(longest - k for k in share.values())
                share = {rid: longest for rid in share}
                limit.update({rid: longest for rid in share if rid not in sampled})
            count.update({rid: min(k, tokens.shape[1]) for rid, k in share.items()})
        if not any(count.values()):
            self.stats.ar_steps += 1
        self._verify(reqs, count, tokens, {q.rid: i for i, q in enumerate(drafting)}, new, limit, q_rows)

    def _draft(self, reqs: list[Request], lengths: dict[str, int]
               ) -> tuple[torch.Tensor, list[list[float]], dict[str, torch.Tensor]]:
        """Drafts [B, k] (on the device: they cross with the verify's result), the drafter's
        probability of each per request (read only for verify-budget's confidence survival: one
        transfer; 1.0 otherwise), and the q [k, V] each sampled request's drafts were drawn from: its
        drafter's distributions at its temperature and top_p, a draw from each with its own uniforms
        (decode.ChainStep's)."""
        logits = self._draft_logits(reqs, lengths)
        top, tok = logits.max(-1)
        q_rows: dict[str, torch.Tensor] = {}
        sampled = [i for i, q in enumerate(reqs) if q.rng is not None]
        if sampled:
            at = torch.tensor(sampled, device=logits.device)
            group = [reqs[i] for i in sampled]
            k, vocab = logits.shape[1], logits.shape[2]
            temp, top_p, key, step = self._sampling_rows(group, logits.device)
            q = probabilities_at(logits[at], temp[:, None], top_p[:, None])  # [S, k, V]
            u = uniforms(key, step, STREAM_DRAFT, k)  # [S, k]
            tok = tok.index_copy(0, at, sample_tokens(q.view(-1, vocab), u.view(-1)).view(len(sampled), k))
            q_rows = {r.rid: q[j] for j, r in enumerate(group)}
        if not (self.policy.verify_budget and self.policy.survival == "confidence"):
            return tok, [[1.0] * tok.shape[1]] * tok.shape[0], q_rows  # no one reads the confidences
        conf = (top.float() - logits.float().logsumexp(-1)).exp()  # the drafter's probability of its token
        return tok, conf.tolist(), q_rows

    @staticmethod
    def _sampling_rows(reqs: list[Request], device: torch.device
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Temperature, top_p (float64), seed key and step (int64) of sampled requests, [S] each."""
        f64 = dict(dtype=torch.float64, device=device)
        return (torch.tensor([q.sampling.temperature for q in reqs], **f64),
                torch.tensor([q.sampling.top_p for q in reqs], **f64),
                torch.stack([q.rng.key for q in reqs]).to(device), torch.stack([q.rng.step for q in reqs]).to(device))

    def _draft_logits(self, reqs: list[Request], lengths: dict[str, int]) -> torch.Tensor:
        """The drafter's logits [B, k, V] at each request's draft positions (one drafter forward)."""
        dev = self.target.device
        if self.kind == "dflash":
            ctx = [q for q in reqs if q.context is not None and q.context.shape[0]]
            if ctx:
                r = Ragged(tuple(q.slot for q in ctx), tuple(self.draft_kv.lengths[q.slot] for q in ctx),
                           tuple(q.context.shape[0] for q in ctx), "full", dev)
                hidden = torch.cat([q.context for q in ctx])
                if self.graphed_draft is None or not self.graphed_draft.context(hidden, r):
                    dflash_add_context(self.drafter, self.draft_kv, hidden, r)
                for q in ctx:
                    self.draft_kv.lengths[q.slot] += q.context.shape[0]
                    q.context = None
            bs = self.block_size
            r = Ragged(tuple(q.slot for q in reqs), tuple(self.draft_kv.lengths[q.slot] for q in reqs), (bs,) * len(reqs),
                       "full", dev)
            mask = self.drafter.mask_token_id
            blocks = torch.tensor([t for q in reqs for t in [q.seq[-1]] + [mask] * (bs - 1)], dtype=torch.long, device=dev)
            if self.graphed_draft is not None:
                logits = self.graphed_draft.block(blocks, r)  # [B, bs-1, V]
            else:
                logits = dflash_draft(self.drafter, self.draft_kv, blocks, r, self.attention, bs)
            first = [len(q.seq) for q in reqs]
        else:
            model = self.drafter.model
            mask = self.drafter.mask_token_id
            fresh = [q.seq[self.draft_kv.lengths[q.slot]:] for q in reqs]
            counts = tuple(len(f) + lengths[q.rid] - 1 for f, q in zip(fresh, reqs))
            r = Ragged(tuple(q.slot for q in reqs), tuple(self.draft_kv.lengths[q.slot] for q in reqs), counts, "causal",
                       model.device)
            ids = torch.tensor([t for f, q in zip(fresh, reqs) for t in f + [mask] * (lengths[q.rid] - 1)],
                               dtype=torch.long, device=model.device)
            k = max(lengths[q.rid] for q in reqs)
            rows = torch.tensor([[s + len(f) - 1 + min(j, lengths[q.rid] - 1) for j in range(k)]
                                 for s, f, q in zip(r.starts, fresh, reqs)], device=model.device)
            logits = None if self.graphed_draft is None else self.graphed_draft.pard(ids, r, rows)
            if logits is None:
                out = ragged_forward(model, self.draft_kv, ids, r, self.attention)
                logits = model.head(out.x[rows])  # [B, k, V] (rows past a request's length repeat its last)
            for q in reqs:
                self.draft_kv.lengths[q.slot] = len(q.seq)
            first = [len(q.seq) for q in reqs]
        if self.draft_hook is not None:
            logits = self.draft_hook(logits, reqs, first)
        return logits

    def _decode_tree(self, reqs: list[Request], drafting: list[Request], lengths: dict[str, int],
                     new: dict[str, list[int]]) -> None:
        """A tree step: each drafting request's best-first tree of `budget` nodes from its drafter's
        top-k (tree.py), all trees verified in one packed forward under their ancestor masks at
        positions past + depth, the longest matching root path accepted per request and its K/V
        compacted in the request's slot (tree_decode.py's step, per request). With `keep`, a
        first level first prunes the trees batch-wide (`keep_batch_wide`, `first_level`)."""
        dev = self.target.device
        budget, topk = self.tree
        trees: dict[str, Tree] = {}
        early = None
        logits = self._draft_logits(drafting, lengths) if drafting else None
        nodes = 0 if logits is None else budget if not self.policy.ragged else \
            best_first_size(budget, logits.shape[1], min(topk, logits.shape[2]))
        rows = len(reqs) + nodes * len(drafting)
        if (self.graphed is not None and self.keep is None and rows <= self.config.buckets[-1]
                and all(q.rng is None for q in reqs)):
            return self._decode_tree_graphed(reqs, drafting, logits, lengths, nodes, new)
        if self.graphed is not None:
            self.graphed.replays["eager"] += 1
        if drafting:
            self.stats.drafted_requests += len(drafting)
            for q, rows in zip(drafting, logits):
                logp, ids = draft_topk(rows, topk)
                trees[q.rid] = best_first_tree(logp.cpu(), ids.cpu(), q.seq[-1], budget=budget)
            if self.first in EXITS:
                early = self.first_level(reqs, trees)
            elif self.keep is not None:
                self.keep_batch_wide(trees, drafting, len(reqs) - len(drafting))
            if not self.policy.ragged:  # every tree padded to the budget, or the longest kept (nodes never accepted)
                width = budget + 1 if self.keep is None else max(t.size for t in trees.values())
                for rid, tree in trees.items():
                    self.stats.padded_rows += width - tree.size
                    trees[rid] = tree.padded(width)
        else:
            self.stats.ar_steps += 1
        one = torch.ones(1, 1, dtype=torch.bool, device=dev)
        masks = [ancestor_mask(trees[q.rid]).to(dev) if q.rid in trees else one for q in reqs]
        tokens = [trees[q.rid].token.tolist() if q.rid in trees else [q.seq[-1]] for q in reqs]
        pasts = tuple(self.kv.lengths[q.slot] for q in reqs)
        positions = torch.cat([p + (trees[q.rid].depth.to(dev) if q.rid in trees else torch.zeros(1, dtype=torch.long,
                                                                                                  device=dev))
                               for q, p in zip(reqs, pasts)])
        r = Ragged(tuple(q.slot for q in reqs), pasts, tuple(len(t) for t in tokens), tuple(masks), dev,
                   positions=positions)
        ids = torch.tensor([t for ts in tokens for t in ts], dtype=torch.long, device=dev)
        if early is None:
            out = self.target_forward(ids, r)
        else:
            out = self.second_level(reqs, trees, r, *early)
        logits = self.target.head(out.x[:r.rows])
        argmax = logits.argmax(-1).tolist()
        self.stats.steps += 1
        self.stats.verify_rows += r.rows
        paths = []
        for i, q in enumerate(reqs):
            start, count = r.starts[i], r.counts[i]
            seg = argmax[start:start + count]
            if q.rng is not None:  # one draw from p a node, followed as greedy follows the argmax
                seg = tree_draws(logits[start:start + count], q.sampling, q.rng).tolist()
                q.rng.advance()
            if q.rid in trees:
                tree = trees[q.rid]
                path, bonus = accept_tree(tree, seg, masks[i].to(tree.device))
            else:
                path, bonus = [0], seg[0]
            span = [tokens[i][j] for j in path[1:]] + [bonus]
            kept = q.out.extend(span)
            new[q.rid] += span[:kept]
            q.seq.extend(span)
            if q.rid in trees:
                self.stats.spec_request_steps += 1
                self.stats.spec_committed += kept
                q.accepted.append(kept - 1)
                self.control.rate(q.rid).observe(lengths[q.rid], len(path) - 1, self.policy.ema)
            q.verified.append(count - 1)
            paths.append(path)
            self.kv.compact(q.slot, pasts[i], [pasts[i] + j for j in path])
            if self.kind == "dflash":
                rows_kept = out.hidden[[start + j for j in path]]  # the anchor and the accepted path
                q.context = rows_kept if q.context is None else torch.cat((q.context, rows_kept))
            self.stats.committed += kept
        self.commit_states(paths)

    def _decode_tree_graphed(self, reqs: list[Request], drafting: list[Request], logits: torch.Tensor | None,
                             lengths: dict[str, int], nodes: int, new: dict[str, list[int]]) -> None:
        """`_decode_tree`'s greedy step as one replay (GraphedVerify.tree): the same trees (the
        builder's, from the same top-k; `nodes` a drafting request, its tree's size past the root as
        the eager step's, the budget without ragged packing), verify, acceptance and compaction, and
        one host read (each request's accepted count, path tokens and bonus)."""
        dev = self.target.device
        topk = self.tree[1]
        where = {q.rid: i for i, q in enumerate(reqs)}
        logp = ids = None
        if drafting:
            self.stats.drafted_requests += len(drafting)
            logp, ids = draft_topk(logits, topk)  # [D, V] rows of every drafting request at once
        else:
            self.stats.ar_steps += 1
        counts = tuple(nodes + 1 if lengths[q.rid] > 0 else 1 for q in reqs)
        pasts = tuple(self.kv.lengths[q.slot] for q in reqs)
        r = Ragged(tuple(q.slot for q in reqs), pasts, counts, "causal", dev, pad_to=self.config.bucket(sum(counts)),
                   pad_slot=self.kv.scratch)
        accept, hidden = self.graphed.tree(r, [q.seq[-1] for q in reqs], logp, ids, [where[q.rid] for q in drafting],
                                           nodes)
        result = accept[:len(reqs)].tolist()
        self.stats.steps += 1
        self.stats.verify_rows += r.rows
        self.stats.padded_rows += r.total - r.rows
        for q, (n, *span), count, past in zip(reqs, result, counts, pasts):
            span = span[:n + 1]
            kept = q.out.extend(span)
            new[q.rid] += span[:kept]
            q.seq.extend(span)
            if count > 1:
                self.stats.spec_request_steps += 1
                self.stats.spec_committed += kept
                q.accepted.append(kept - 1)
                self.control.rate(q.rid).observe(lengths[q.rid], n, self.policy.ema)
            q.verified.append(count - 1)
            self.kv.lengths[q.slot] = past + n + 1  # the graph compacted the path's K/V
            self.stats.committed += kept
        if self.kind == "dflash":  # each request's anchor and accepted path, gathered in one copy
            levels = hidden.shape[1]
            sizes = [n + 1 for n, *_ in result]
            index = torch.tensor([i * levels + j for i, size in enumerate(sizes) for j in range(size)], device=dev)
            kept_rows = hidden.flatten(0, 1)[index].split(sizes)
            for q, rows_kept in zip(reqs, kept_rows):
                q.context = rows_kept if q.context is None else torch.cat((q.context, rows_kept))

    def first_level(self, reqs: list[Request], trees: dict[str, Tree]
                    ) -> tuple[torch.Tensor, dict[int, torch.Tensor], Ragged, dict[str, list[int]]]:
        """An early-exit first level over the batch: the target's first `exit_layer` layers over every
        request's rows in one packed forward (a drafting request's whole drafted tree under its
        ancestor mask, another's anchor), every drafted node scored by `first` on those layers' output
        (two_level.level_scores over the trees as one forest: one head a step), and the trees pruned
        in place to the batch's best nodes (`keep_batch_wide`). Returns what `second_level` continues
        from: the layer outputs, the DFlash hidden layers read below the exit, the forward's Ragged,
        and each drafting request's survivors (node indices of its drafted tree, ascending)."""
        dev = self.target.device
        one = torch.ones(1, 1, dtype=torch.bool, device=dev)
        drafted = [trees.get(q.rid) for q in reqs]
        pasts = tuple(self.kv.lengths[q.slot] for q in reqs)
        r = Ragged(tuple(q.slot for q in reqs), pasts, tuple(t.size if t is not None else 1 for t in drafted),
                   tuple(ancestor_mask(t).to(dev) if t is not None else one for t in drafted), dev,
                   positions=torch.cat([p + (t.depth.to(dev) if t is not None else torch.zeros(1, dtype=torch.long,
                                                                                                device=dev))
                                        for t, p in zip(drafted, pasts)]))
        ids = torch.tensor([tok for t, q in zip(drafted, reqs) for tok in (t.token.tolist() if t is not None
                                                                           else [q.seq[-1]])],
                           dtype=torch.long, device=dev)
        below = tuple(i for i in self.layers if i < self.exit_layer)
        x, picked = ragged_layers(self.target, self.kv, self.target.embed(ids[None]), r, self.attention,
                                  range(self.exit_layer), below)
        drafting = [q for q, t in zip(reqs, drafted) if t is not None]
        both, roots = forest([trees[q.rid] for q in drafting])
        starts = [s for s, t in zip(r.starts, drafted) if t is not None]
        index = torch.cat([s + torch.arange(trees[q.rid].size, device=dev) for s, q in zip(starts, drafting)])
        scores = level_scores(self.first, self.target, both.to(dev), x[:, index], roots.to(dev)).cpu()
        split = dict(zip((q.rid for q in drafting), scores.split([trees[q.rid].size for q in drafting])))
        kept = self.keep_batch_wide(trees, drafting, len(reqs) - len(drafting), split)
        return x, picked, r, kept

    def second_level(self, reqs: list[Request], trees: dict[str, Tree], r: Ragged, x: torch.Tensor,
                     picked: dict[int, torch.Tensor], first: Ragged, kept: dict[str, list[int]]) -> RaggedOutput:
        """The target over the survivors `trees` (packed as `r`) continued from the first level's layer
        L = exit_layer: each request's survivors' layer-L rows and their K/V of layers < L (from the
        first level's forward `first`) gathered into its rows and key slots, then layers L.. over
        them alone (two_level.continue_tree's, per request: exact because survivors are
        ancestor-closed; a padding node computes as the root, so it takes the root's rows)."""
        src = []
        for i, q in enumerate(reqs):
            own = kept.get(q.rid, [0])
            own = own + [0] * (r.counts[i] - len(own))  # padding nodes: the root's rows
            self.kv.gather(q.slot, r.pasts[i], own, self.exit_layer)
            src += [first.starts[i] + j for j in own]
        index = torch.tensor(src, dtype=torch.long, device=x.device)
        above = tuple(i for i in self.layers if i >= self.exit_layer)
        h, more = ragged_layers(self.target, self.kv, x[:, index], r, self.attention,
                                range(self.exit_layer, len(self.target.model.layers)), above)
        rows = {**{i: v[:, index] for i, v in picked.items()}, **more}
        hidden = torch.cat([rows[i] for i in self.layers], dim=-1)[0] if self.layers else None
        return RaggedOutput(self.target.final_norm(h)[0], hidden)

    def keep_batch_wide(self, trees: dict[str, Tree], drafting: list[Request], others: int,
                        scores: dict[str, torch.Tensor] | None = None) -> dict[str, list[int]]:
        """Two-level verification's first level over the whole batch: the batch keeps the best-scoring
        drafted nodes of all requests, keep a drafting request in all (two_level.share_budget). With
        verify-budget the total is the step-cost table's choice (`choose_verify_budget`, at most that
        total) over the drafter's survivals (a node's path confidence product, the exp of its tree
        score), and the first level splits that total across requests by its scores.
        `scores` (rid -> [n]): an early-exit level's; None: the drafter's (a best-first tree lists its
        nodes in non-increasing score, parents first, so each request keeps a prefix). Each request's
        tree becomes its kept nodes, ancestor-closed (two_level.survivors), re-indexed parents first;
        returns their indices in the drafted tree. A sampled request keeps its own `keep` best nodes
        whatever the batch (its tokens must not depend on what shares it), priced as load; the
        batch's budget goes to the greedy ones. `others` requests verify their anchor only this step."""
        sampled = [q for q in drafting if q.rng is not None]
        shared = [q for q in drafting if q.rng is None]
        own = {q.rid: min(self.keep, trees[q.rid].size - 1) for q in sampled}
        total = self.keep * len(shared)
        if self.policy.verify_budget:
            if self.policy.cost is None or self.policy.survival != "confidence":
                raise ValueError("BatchEngine: a batch-wide first level under verify-budget chooses by the drafter's "
                                 "confidences and the step-cost table: expected a cost and survival 'confidence'")
            survival = [trees[q.rid].score[1:].exp().tolist() for q in shared]
            fixed = sum(1 + k for k in own.values())
            cost = self.policy.cost
            per = choose_verify_budget(survival + [[]] * others, cost.verify_past(fixed),
                                       max_total=total).per_request  # the draft and a first level: paid already
            total = sum(per)
        if scores is not None or not self.policy.verify_budget:
            rank = scores or {q.rid: trees[q.rid].score for q in shared}
            per = share_budget([rank[q.rid] for q in shared], total)
        kept = {}
        for rid, k in [*zip((q.rid for q in shared), per), *own.items()]:
            t = trees[rid]
            if scores is None:
                kept[rid] = list(range(k + 1))
                trees[rid] = Tree(t.parent[: k + 1], t.depth[: k + 1], t.token[: k + 1], t.score[: k + 1])
            else:
                kept[rid] = survivors(t, scores[rid], k) if k else [0]
                trees[rid] = subtree(t, kept[rid], scores[rid])
            self.stats.pruned_nodes += t.size - len(kept[rid])
        return kept

    def _verify(self, reqs: list[Request], count: dict[str, int], tokens: torch.Tensor | None, row: dict[str, int],
                new: dict[str, list[int]], limit: dict[str, int] | None = None,
                q_rows: dict[str, torch.Tensor] | None = None) -> None:
        """Verify every request's [last token, its first count[rid] drafts (tokens[row[rid]])] in one
        packed forward; greedy requests accept their argmax prefix, sampled ones by rejection sampling
        of their first limit[rid] drafts (drawn from q_rows[rid]). One transfer: the accepted counts,
        the bonus tokens and the drafts."""
        dev = self.target.device
        sampled = [i for i, q in enumerate(reqs) if q.rng is not None]
        counts = tuple(1 + count[q.rid] for q in reqs)
        rows = sum(counts)
        bucket = self.config.bucket(rows)
        r = Ragged(tuple(q.slot for q in reqs), tuple(self.kv.lengths[q.slot] for q in reqs), counts, "causal", dev,
                   pad_to=bucket, pad_slot=self.kv.scratch)
        ids = self._verify_ids(reqs, count, tokens, row, r)
        if self.graphed is not None and rows <= self.config.buckets[-1] and not sampled:
            accept, hidden = self.graphed(ids, r)  # the forward and the greedy acceptance, one replay
            accept = accept[:, :len(reqs)]
        else:
            if self.graphed is not None:
                self.graphed.replays["eager"] += 1
            out = self.target_forward(ids, r)
            logits = self.target.head(out.x[:rows])
            hidden = out.hidden
            n, bonus = accept_ragged(ids[:rows], logits.argmax(-1), r)
            if sampled:
                n, bonus = self._accept_sampled([reqs[i] for i in sampled], sampled, ids, logits, r, count,
                                                limit or {}, q_rows or {}, n, bonus)
            accept = torch.stack((n, bonus))
        b, k = len(reqs), 0 if tokens is None else tokens.shape[1]
        host = (accept.flatten() if tokens is None else torch.cat((accept.flatten(), tokens.flatten()))).tolist()
        result, flat = (host[:b], host[b:2 * b]), host[2 * b:]
        drafts = {rid: flat[i * k:i * k + count[rid]] for rid, i in row.items()}
        self.stats.steps += 1
        self.stats.verify_rows += rows
        self.stats.padded_rows += r.total - rows
        for i, q in enumerate(reqs):
            k, acc, bonus = count[q.rid], result[0][i], result[1][i]
            if q.rng is not None:  # its own share: padding rows are not its drafts
                k = min(k, (limit or {}).get(q.rid, 0))
            span = drafts.get(q.rid, [])[:acc] + [bonus]
            kept = q.out.extend(span)
            new[q.rid] += span[:kept]
            q.seq.extend(span)
            if k:
                self.stats.spec_request_steps += 1
                self.stats.spec_committed += kept
                q.accepted.append(kept - 1)
                self.control.rate(q.rid).observe(k, acc, self.policy.ema)
            q.verified.append(k)
            self.kv.lengths[q.slot] += 1 + acc
            self.stats.committed += kept
        self.commit_states([range(1 + acc) for acc in result[0][:len(reqs)]])
        if self.kind == "dflash":  # each request's anchor and accepted drafts, gathered in one copy
            sizes = [1 + acc for acc in result[0][:len(reqs)]]
            index = [r.starts[i] + j for i, size in enumerate(sizes) for j in range(size)]
            kept_rows = hidden[torch.tensor(index, device=hidden.device)].split(sizes)
            for q, rows_kept in zip(reqs, kept_rows):
                q.context = rows_kept if q.context is None else torch.cat((q.context, rows_kept))

    def _verify_ids(self, reqs: list[Request], count: dict[str, int], tokens: torch.Tensor | None,
                    row: dict[str, int], r: Ragged) -> torch.Tensor:
        """The verify's packed ids [r.total]: each request's last token and its first count[rid] drafts
        (gathered from tokens [D, k] on the device), padding rows 0."""
        dev = self.target.device
        anchors = [q.seq[-1] for q in reqs] + [0]
        if tokens is None:
            return torch.tensor(anchors[:-1] + [0] * (r.total - r.rows), dtype=torch.long, device=dev)
        b, k = len(reqs), tokens.shape[1]
        index = []
        for i, q in enumerate(reqs):
            index.append(i)
            if count[q.rid]:
                first = b + 1 + row[q.rid] * k
                index += range(first, first + count[q.rid])
        index += [b] * (r.total - r.rows)
        source = torch.cat((torch.tensor(anchors, dtype=torch.long, device=dev), tokens.flatten().long()))
        return source[torch.tensor(index, dtype=torch.long, device=dev)]

    def _accept_sampled(self, group: list[Request], at: list[int], ids: torch.Tensor, logits: torch.Tensor, r: Ragged,
                        count: dict[str, int], limit: dict[str, int], q_rows: dict[str, torch.Tensor],
                        n: torch.Tensor, bonus: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(n, bonus) with the sampled requests' entries (batch indices `at`) from rejection sampling
        (sampling.accept_chains, all at once); each sampled request's step counter moves on."""
        dev = logits.device
        kk = max(r.counts[i] for i in at) - 1
        vocab = logits.shape[-1]
        index = torch.tensor([[min(r.starts[i] + j, r.rows - 1) for j in range(kk + 1)] for i in at], device=dev)
        tok = ids[index[:, 1:]]  # [S, K] the drafts (rows past a request's own: don't-care)
        q = torch.full((len(at), kk, vocab), 1.0 / vocab, dtype=torch.float64, device=dev)
        for j, req in enumerate(group):
            if req.rid in q_rows and count[req.rid]:
                rows = q_rows[req.rid][:count[req.rid]]
                q[j, :rows.shape[0]] = rows.to(dev)
        counts = torch.tensor([limit.get(req.rid, 0) for req in group], device=dev)
        temp, top_p, key, step = self._sampling_rows(group, dev)
        n_s, token = accept_chains(tok, counts, q, logits[index], temp, top_p, key, step)
        for req in group:
            req.rng.advance()
        where = torch.tensor(at, device=dev)
        return n.index_copy(0, where, n_s), bonus.index_copy(0, where, token)


class StaticRagged:
    """A Ragged whose device tensors are preallocated for one (bucket, rows a request) shape and
    refilled each step, so a forward over it can be captured once and replayed. Requests past the
    step's own hold no rows (their cu entries repeat) in the scratch slot; padding rows write there,
    at key slots 0.. wrapped below `capacity` (the scratch row's own slots, and the RoPE table's).
    The host fields (slots, pasts, counts, starts) are the step's, for an attention that reads them
    (the reference, which is never captured). `mask`: "causal" or "full" (DFlash's block pass)."""

    def __init__(self, batch: int, rows: int, max_t: int, scratch: int, device: torch.device, *,
                 capacity: int, mask: str = "causal") -> None:
        self.batch, self.total, self.max_count, self.scratch = batch, rows, max_t, scratch
        self.capacity, self.mask = capacity, mask
        # two buffers, so a step's layout is two copies: [token_slot; token_key; ...], [cu; slots; pasts]
        self.rows_index = torch.zeros(self.row_fields, rows, dtype=torch.long, device=device)
        self.rows_index[0] = scratch
        self.token_slot, self.token_key = self.rows_index[0], self.rows_index[1]
        self.token_position = self.token_key
        self.args = torch.zeros(3, batch + 1, dtype=torch.int32, device=device)
        self.args[1] = scratch
        self.device_args = {"cu": self.args[0], "slots": self.args[1, :-1], "pasts": self.args[2, :-1]}
        self.slots = self.pasts = self.counts = self.starts = ()

    row_fields = 2  # rows of rows_index: token_slot, token_key

    def request_mask(self, i: int) -> str | torch.Tensor:
        return self.mask

    def _rows(self, r: Ragged, fill: int) -> list[list[int]]:
        """rows_index's rows for `r`, each r.rows entries then `fill` of padding."""
        slot = [s for s, c in zip(r.slots, r.counts) for _ in range(c)]
        key = [p + j for p, c in zip(r.pasts, r.counts) for j in range(c)]
        return [slot + [self.scratch] * fill, key + [j % self.capacity for j in range(fill)]]

    def load(self, r: Ragged) -> None:
        """This step's requests (r: at most `batch` of them, at most max_t rows each, `mask`'s kind)."""
        pad = self.batch - len(r.counts)
        self.slots, self.pasts, self.counts, self.starts = r.slots, r.pasts, r.counts, r.starts
        self.rows_index.copy_(torch.tensor(self._rows(r, self.total - r.rows), dtype=torch.long), non_blocking=True)
        self.args.copy_(torch.tensor([[*r.starts, r.rows] + [r.rows] * pad, list(r.slots) + [self.scratch] * pad + [0],
                                      list(r.pasts) + [0] * pad + [0]], dtype=torch.int32), non_blocking=True)

    def load_idle(self) -> None:
        """One row in the scratch slot (what a warm-up and a capture run over)."""
        self.load(Ragged((self.scratch,), (0,), (1,), "causal", self.token_slot.device))


class StaticTreeRagged(StaticRagged):
    """A StaticRagged for a tree verify built inside the graph: request i (the step's i-th) owns
    node row i of the step's trees ([batch, width] arrays, a drafting request all `width` nodes, another
    only node 0, its anchor), its packed rows reading nodes i * width + j (`node`, padding rows node
    0: a root, depth 0). The graph fills `token_position` (the row's past + its node's depth) and
    `tree_masks` ([batch, max_t, max_t], each request's ancestor mask in its top-left corner) before
    the forward; `mask` is that tensor, so attentions take the tree masks."""

    row_fields = 4  # token_slot, token_key, node, the row's past

    def __init__(self, batch: int, rows: int, max_t: int, scratch: int, device: torch.device, *,
                 capacity: int, width: int) -> None:
        super().__init__(batch, rows, max_t, scratch, device, capacity=capacity)
        self.width = width
        self.node, self.row_past = self.rows_index[2], self.rows_index[3]
        self.token_position = torch.zeros(rows, dtype=torch.long, device=device)
        self.tree_masks = torch.zeros(batch, max_t, max_t, dtype=torch.bool, device=device)
        self.mask = self.tree_masks

    def request_mask(self, i: int) -> torch.Tensor:
        return self.tree_masks[i, :self.counts[i], :self.counts[i]]

    def _rows(self, r: Ragged, fill: int) -> list[list[int]]:
        node = [i * self.width + j for i, c in enumerate(r.counts) for j in range(c)]
        past = [p for p, c in zip(r.pasts, r.counts) for _ in range(c)]
        rows = super()._rows(r, fill)
        return rows + [node + [0] * fill, past + rows[1][r.rows:]]


def padded_count(n: int, most: int) -> int:
    """Requests a graphed drafter forward is shaped for: the power of two >= n, at most `most`."""
    return min(most, 1 << max(n - 1, 0).bit_length())


class GraphedVerify:
    """The batched engine's verify forward and greedy acceptance as CUDA-graph replays: one graph a
    (token bucket, rows a request rounded up to a power of two), captured on first use over
    StaticRagged inputs and the engine's caches (graph_decode.GraphedStep; on other devices it simply
    runs). Returns [2, max_batch]: each request's accepted drafts and bonus (accept_rows; entries
    past the step's requests are don't-care), and the hidden rows the drafter reads (None without)."""

    def __init__(self, engine: "BatchEngine") -> None:
        self.engine = engine
        self.steps: dict[tuple, tuple] = {}
        self.replays: Counter[str] = Counter()  # verifies served: "chain", "tree"; "eager" the engine ran itself
        self.pool = torch.cuda.graph_pool_handle() if engine.target.device.type == "cuda" else None

    def __call__(self, ids: torch.Tensor, r: Ragged) -> tuple[torch.Tensor, torch.Tensor | None]:
        from specpilot.runtime.graph_decode import GraphedStep

        e = self.engine
        self.replays["chain"] += 1
        t = 1 << max(r.max_count - 1, 0).bit_length()
        key = (r.total, t)
        if key not in self.steps:
            static = StaticRagged(e.max_batch, r.total, t, e.kv.scratch, e.target.device, capacity=e.kv.capacity)
            ids_buf = torch.zeros(r.total, dtype=torch.long, device=e.target.device)
            out: dict[str, torch.Tensor | None] = {}

            def forward() -> None:
                o = ragged_forward(e.target, e.kv, ids_buf, static, e.attention, e.layers)
                cu = static.device_args["cu"].long()
                n, bonus = accept_rows(ids_buf, e.target.head(o.x).argmax(-1), cu[:-1], cu[1:] - cu[:-1], t)
                out["accept"] = torch.stack((n, bonus))
                out["hidden"] = o.hidden
            static.load_idle()  # warm-up and capture over one row in the scratch slot
            self.steps[key] = (static, ids_buf, out, GraphedStep(forward, e.target.device, self.pool))
        static, ids_buf, out, step = self.steps[key]
        static.load(r)
        ids_buf.copy_(ids)
        step()
        return out["accept"], out["hidden"]

    def tree(self, r: Ragged, anchors: Sequence[int], logp: torch.Tensor | None, ids: torch.Tensor | None,
             at: Sequence[int], nodes: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A greedy tree step of `r`'s requests as one replay: the drafting requests' trees of `nodes`
        nodes past the root (the engine's builder over their top-k logp, ids [len(at), D, K], request
        at[j] the j-th; None: no request drafts) built on the device, the verify over every request's
        rows (a drafting request's nodes + 1 under its ancestor mask at positions past + depth,
        another's anchor), greedy tree acceptance (graph_decode.accept_trees_on_device) and each
        request's accepted path compacted in its KV slot. One graph a (token bucket, nodes a request
        rounded up to a power of two, draft positions D, nodes). Returns [max_batch, 1 + L] (each
        request's accepted drafts n, then its path's drafts and the bonus at n; L = D + 1 levels) and
        the hidden rows of each request's path [max_batch, L, width] (None without)."""
        from specpilot.runtime.graph_decode import GraphedStep

        e = self.engine
        self.replays["tree"] += 1
        d = 0 if logp is None else logp.shape[1]
        width = nodes + 1 if d else 1
        t = 1 << max(r.max_count - 1, 0).bit_length()
        total = r.total
        key = ("tree", total, t, d, width)
        if key not in self.steps:
            dev = e.target.device
            static = StaticTreeRagged(e.max_batch, total, t, e.kv.scratch, dev, capacity=e.kv.capacity, width=width)
            k = 0 if logp is None else logp.shape[2]
            logp_buf = torch.zeros(e.max_batch, d, k, dtype=torch.float32, device=dev)
            ids_buf = torch.zeros(e.max_batch, d, k, dtype=torch.long, device=dev)
            anchor_buf = torch.zeros(e.max_batch, dtype=torch.long, device=dev)
            out: dict[str, torch.Tensor | None] = {}

            def forward() -> None:
                from specpilot.runtime.graph_decode import accept_trees_on_device, ancestor_mask_static

                cu = static.device_args["cu"].long()
                column = torch.arange(width, device=dev)
                if d:
                    parent, depth, token, _ = e.tree_builder(logp_buf, ids_buf, anchor_buf, nodes)
                    live = column < (cu[1:] - cu[:-1])[:, None]  # a request's own nodes (others: hang from nothing)
                    parent, depth = torch.where(live, parent, -1), torch.where(live, depth, 0)
                else:
                    parent = torch.full((e.max_batch, 1), -1, dtype=torch.long, device=dev)
                    depth, token = torch.zeros_like(parent), anchor_buf[:, None]
                ancestors = ancestor_mask_static(parent, d)
                static.tree_masks[:, :width, :width] = ancestors
                static.token_position.copy_(static.row_past + depth.flatten()[static.node])
                o = ragged_forward(e.target, e.kv, token.flatten()[static.node], static, e.attention, e.layers)
                rows = (cu[:-1, None] + column).clamp(max=total - 1)
                argmax = e.target.head(o.x).argmax(-1)[rows]  # [max_batch, width]: the target at each node
                n, path, span = accept_trees_on_device(parent, depth, token, ancestors, argmax, d + 1)
                if d:  # each request's path to key slots past.. (tree.compact_kv); slots past its end keep theirs
                    pasts = static.device_args["pasts"].long()[:, None]
                    slots = static.device_args["slots"].long()[:, None]
                    levels = torch.arange(1, d + 1, device=dev)  # the root stays where it is
                    dst = pasts + levels
                    src = torch.where(levels <= n[:, None], pasts + path[:, 1:], dst)
                    kv = e.kv.cache.stacked  # [2, layers, rows, Hkv, cap, D]
                    kv[:, :, slots, :, dst] = kv[:, :, slots, :, src]
                out["accept"] = torch.cat((n[:, None], span), dim=1)
                out["hidden"] = None if o.hidden is None else o.hidden[(cu[:-1, None] + path).clamp(max=total - 1)]
            static.load_idle()  # warm-up and capture over one row in the scratch slot
            self.steps[key] = (static, logp_buf, ids_buf, anchor_buf, out,
                               GraphedStep(forward, dev, self.pool))
        static, logp_buf, ids_buf, anchor_buf, out, step = self.steps[key]
        static.load(r)
        dev = anchor_buf.device
        host = torch.tensor([list(anchors) + [0] * (e.max_batch - len(anchors)),
                             list(at) + [e.max_batch] * (e.max_batch - len(at))], dtype=torch.long)
        index = host.to(dev, non_blocking=True)
        anchor_buf.copy_(index[0])
        if logp is not None:  # rows of requests that do not draft keep stale values: their nodes are cut
            fill = index[1, :len(at)]
            logp_buf.index_copy_(0, fill, logp.float())
            ids_buf.index_copy_(0, fill, ids)
        step()
        return out["accept"], out["hidden"]


class GraphedDraft:
    """The batched engine's drafter forwards (chains and trees) as CUDA-graph replays, GraphedVerify's way:
    static inputs a shape, each shape captured once over StaticRagged inputs and the drafter's
    SlotKV, nothing inside reading a host value (graph_decode.GraphedStep; elsewhere it runs as is).

      context  DFlash: the requests' new context features (target hidden rows) into their drafter
               slots, one graph a token bucket (`buckets`);
      block    DFlash: the block pass of n requests over their context K/V, one graph a padded
               request count (`padded_count`): logits [n, bs-1, V];
      pard     PARD: the causal forward over each request's fresh committed tokens and masks, one graph
               a (token bucket, rows a request rounded up to a power of two, padded request count),
               the head over each request's k draft rows gathered by a static index: logits [n, k, V].

    A shape past the largest bucket is refused (False, None): the caller runs that forward eagerly.
    `replays` counts the forwards of each kind served, and "eager" the refused ones."""

    def __init__(self, engine: "BatchEngine") -> None:
        self.engine = engine
        self.steps: dict[tuple, tuple] = {}
        self.replays: Counter[str] = Counter()
        self.pool = torch.cuda.graph_pool_handle() if engine.target.device.type == "cuda" else None
        last = engine.config.buckets[-1]
        self.buckets = (*engine.config.buckets, 2 * last)  # a PARD forward holds up to 2k rows a request

    def bucket(self, rows: int) -> int | None:
        return next((b for b in self.buckets if b >= rows), None)

    def _capture(self, key: tuple, static: StaticRagged, forward: Callable[[], None], *buffers) -> tuple:
        from specpilot.runtime.graph_decode import GraphedStep

        if key not in self.steps:
            static.load_idle()  # warm-up and capture over one row in the scratch slot
            self.steps[key] = (static, *buffers, GraphedStep(forward, self.engine.target.device, self.pool))
        return self.steps[key]

    def context(self, hidden: torch.Tensor, r: Ragged) -> bool:
        """DFlash's context update of `r`'s requests from packed hidden rows [r.rows, width]; False
        (nothing done) past the largest bucket."""
        e = self.engine
        total = self.bucket(r.rows)
        self.replays["context" if total else "eager"] += 1
        if total is None:
            return False
        key = ("context", total)
        if key not in self.steps:
            static = StaticRagged(e.max_batch, total, 1, e.draft_kv.scratch, hidden.device,
                                  capacity=e.draft_kv.capacity)
            buf = torch.zeros(total, hidden.shape[-1], dtype=hidden.dtype, device=hidden.device)
            self._capture(key, static, lambda: dflash_add_context(e.drafter, e.draft_kv, buf, static), buf)
        static, buf, step = self.steps[key]
        static.load(r)
        buf[:r.rows].copy_(hidden)
        step()
        return True

    def block(self, blocks: torch.Tensor, r: Ragged) -> torch.Tensor:
        """DFlash's block pass of `r`'s requests (blocks [B * bs] packed, mask "full") -> logits
        [B, bs-1, V] (a view of the graph's output)."""
        e = self.engine
        bs, n = e.block_size, padded_count(len(r.counts), e.max_batch)
        key = ("block", n)
        self.replays["block"] += 1
        if key not in self.steps:
            dev = blocks.device
            static = StaticRagged(e.max_batch, n * bs, bs, e.draft_kv.scratch, dev, capacity=e.draft_kv.capacity,
                                  mask="full")
            buf = torch.full((n * bs,), e.drafter.mask_token_id, dtype=torch.long, device=dev)
            out: dict[str, torch.Tensor] = {}

            def forward() -> None:
                out["logits"] = dflash_draft(e.drafter, e.draft_kv, buf, static, e.attention, bs)
            self._capture(key, static, forward, buf, out)
        static, buf, out, step = self.steps[key]
        static.load(r)
        buf[:r.rows].copy_(blocks)
        step()
        return out["logits"][:len(r.counts)]

    def pard(self, ids: torch.Tensor, r: Ragged, rows: torch.Tensor) -> torch.Tensor | None:
        """PARD's forward over `r`'s packed rows ids [r.rows] (causal) and its head over rows [B, k]
        (indices into the packed rows) -> logits [B, k, V]; None past the largest bucket."""
        e = self.engine
        total = self.bucket(r.rows)
        self.replays["pard" if total else "eager"] += 1
        if total is None:
            return None
        t = 1 << max(r.max_count - 1, 0).bit_length()
        n, k = padded_count(len(r.counts), e.max_batch), e.block_size
        key = ("pard", total, t, n)
        if key not in self.steps:
            model, dev = e.drafter.model, ids.device
            static = StaticRagged(e.max_batch, total, t, e.draft_kv.scratch, dev, capacity=e.draft_kv.capacity)
            buf = torch.zeros(total, dtype=torch.long, device=dev)
            index = torch.zeros(n, k, dtype=torch.long, device=dev)
            out: dict[str, torch.Tensor] = {}

            def forward() -> None:
                x = ragged_forward(model, e.draft_kv, buf, static, e.attention).x
                out["logits"] = model.head(x[index])
            self._capture(key, static, forward, buf, index, out)
        static, buf, index, out, step = self.steps[key]
        static.load(r)
        buf[:r.rows].copy_(ids)
        index[:rows.shape[0], :rows.shape[1]].copy_(rows)
        step()
        return out["logits"][:rows.shape[0], :rows.shape[1]]


def accept_ragged(ids: torch.Tensor, argmax: torch.Tensor, r: Ragged) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy chain acceptance of every request at once, on the device: request i's rows are
    [anchor, d_1..d_k]; d_j is kept while it equals the target's argmax at the row before it.
    Returns (accepted drafts [B], bonus token [B]): the target's argmax at the row after the last
    kept draft."""
    dev = ids.device
    return accept_rows(ids, argmax, torch.tensor(r.starts, device=dev), torch.tensor(r.counts, device=dev),
                       r.max_count)


def accept_rows(ids: torch.Tensor, argmax: torch.Tensor, starts: torch.Tensor, counts: torch.Tensor,
                t: int) -> tuple[torch.Tensor, torch.Tensor]:
    """accept_ragged over device starts and counts [B] (a count of 0: n 0, the bonus don't-care) and
    a host bound t >= every count: no host read, so a graph captures it (GraphedVerify)."""
    dev = ids.device
    b = starts.shape[0]
    j = torch.arange(t, device=dev)
    valid = j[None] < counts[:, None]  # [B, T]
    index = (starts[:, None] + j[None]).clamp(max=ids.shape[0] - 1)
    tok = ids[index]
    arg = argmax[index]
    # draft at row j+1 against the argmax at row j
    match = (tok[:, 1:] == arg[:, :-1]) & valid[:, 1:] if t > 1 else torch.zeros(b, 0, dtype=torch.bool, device=dev)
    n = match.long().cumprod(1).sum(1) if t > 1 else torch.zeros(b, dtype=torch.long, device=dev)
    bonus = arg.gather(1, n[:, None])[:, 0]
    return n, bonus


def graph_buckets(max_rows: int, smallest: int = 8) -> tuple[int, ...]:
    """Token-count buckets for graphed verifies: powers of two from `smallest`, the last >= max_rows."""
    out, b = [], smallest
    while True:
        out.append(b)
        if b >= max_rows:
            return tuple(out)
        b *= 2


def generate_batched(engine: BatchEngine, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                     arrivals: Sequence[int] | None = None) -> list[list[int]]:
    """Every prompt through `engine`: prompt i is admitted at step arrivals[i] (default 0, as slots
    allow; a request waits while all slots are taken) and released when done. Outputs in order."""
    arrivals = list(arrivals) if arrivals is not None else [0] * len(prompts)
    pending = sorted(range(len(prompts)), key=lambda i: (arrivals[i], i))
    outputs: dict[int, list[int]] = {}
    step = 0
    params = RequestParams(max_new_tokens=max_new_tokens)
    while pending or engine.active():
        while pending and arrivals[pending[0]] <= step and len(engine.active()) < engine.max_batch:
            i = pending.pop(0)
            engine.admit(str(i), list(prompts[i]), params)
        engine.step()
        for rid in engine.active():
            if engine.done(rid):
                outputs[int(rid)] = engine.output(rid)
                engine.release(rid)
        step += 1
        if step > 100_000:
            raise RuntimeError("generate_batched: no progress")
    return [outputs[i] for i in range(len(prompts))]


@torch.inference_mode()
def profile_step_cost(engine: BatchEngine, *, tokens: Sequence[int], requests: Sequence[int] = (),
                      past: int = 256, repeats: int = 3,
                      clock: Callable[[], float] | None = None) -> StepCost:
    """The step-cost table of `engine` measured on its own forwards: verify forwards of `tokens`
    rows (spread over min(rows, max_batch) requests with `past` cached keys each), and drafter
    forwards of `requests` requests; median of `repeats` after one warm-up. A graphed engine's
    forwards are timed as it runs them: graph replays (GraphedVerify, GraphedDraft) where the shape
    has a graph. Run while no request is active (it writes scratch K/V into the slots; lengths are
    left as they are)."""
    import statistics

    from specpilot.runtime.decode import DecodeClock

    if engine.active():
        raise RuntimeError("profile_step_cost: requests are active; profile an idle engine")
    clock = clock or DecodeClock(engine.target.device)
    dev = engine.target.device
    cap = engine.config.capacity
    past = max(0, min(past, cap - math.ceil(max(tokens) / engine.max_batch) - 1))

    def timed(fn) -> float:
        fn()
        samples = []
        for _ in range(repeats):
            t0 = clock()
            fn()
            samples.append(1e3 * (clock() - t0))
        return statistics.median(samples)

    verify = {}
    for n in tokens:
        b = min(n, engine.max_batch)
        counts = tuple(n // b + (1 if i < n % b else 0) for i in range(b))
        if engine.graphed is not None and n <= engine.config.buckets[-1]:
            r = Ragged(tuple(range(b)), (past,) * b, counts, "causal", dev, pad_to=engine.config.bucket(n),
                       pad_slot=engine.kv.scratch)
            ids = torch.zeros(r.total, dtype=torch.long, device=dev)
            verify[n] = timed(lambda: engine.graphed(ids, r))
            continue
        r = Ragged(tuple(range(b)), (past,) * b, counts, "causal", dev)
        ids = torch.zeros(n, dtype=torch.long, device=dev)
        verify[n] = timed(lambda: engine.target.head(engine.target_forward(ids, r).x).argmax(-1))
    if engine.states is not None:
        engine.states.drop()  # nothing of the profile's verifies is committed
    graphed = engine.graphed_draft

    def dflash_block(blocks: torch.Tensor, r: Ragged) -> None:
        if graphed is not None:
            graphed.block(blocks, r)
        else:
            dflash_draft(engine.drafter, engine.draft_kv, blocks, r, engine.attention, engine.block_size)

    def pard_forward(ids: torch.Tensor, r: Ragged, rows: torch.Tensor) -> None:
        if graphed is None or graphed.pard(ids, r, rows) is None:
            model = engine.drafter.model
            model.head(ragged_forward(model, engine.draft_kv, ids, r, engine.attention).x[rows])

    draft = {0: 0.0}
    for b in requests if engine.kind == "dflash" else ():
        bs = engine.block_size
        r = Ragged(tuple(range(b)), (past,) * b, (bs,) * b, "full", dev)
        blocks = torch.zeros(b * bs, dtype=torch.long, device=dev)
        draft[b] = timed(lambda: dflash_block(blocks, r))
    for b in requests if engine.kind == "pard" else ():
        k = engine.block_size
        r = Ragged(tuple(range(b)), (past,) * b, (k + 1,) * b, "causal", dev)
        ids = torch.zeros(b * (k + 1), dtype=torch.long, device=dev)
        rows = torch.tensor([[s + j for j in range(k)] for s in r.starts], device=dev)
        draft[b] = timed(lambda: pard_forward(ids, r, rows))
    return StepCost.from_table(verify, draft)

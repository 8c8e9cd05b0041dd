"""Hybrid targets (Gated DeltaNet + gated attention, hybrid.py) in the batched engine (batch.py).

The attention layers keep their K/V in the engine's SlotKV as an attention target's do (a row a
request, rollback a pointer move, tree paths compacted). The Gated DeltaNet layers cannot drop
tokens by moving a pointer, so each request owns a row of `SlotStates`: per layer its recurrent
state [v_heads, dk, dv] (float32) and the conv inputs of its last kernel-1 committed tokens.

A step over packed rows (`hybrid_ragged_forward`):

  prefill  each request's prompt from a zeroed row (`SlotStates.reset` at admission: a reused slot
           starts empty), in the form the batch-1 forward takes for that many tokens (one token the
           recurrence, 2..RECORD_LIMIT one WY solve, longer ones chunked); the rows are written at once;
  verify   every request's rows as a tree (a chain is a tree whose every node hangs from the one
           before), the requests batched: rows gathered into [B, T] (T the longest request; a
           shorter one's padding nodes hang alone, so nothing reads them), the conv and the delta
           rule along each node's own path from its own row (hybrid_tree.conv_tree,
           GatedDeltaNet.tree_rule with an ancestor mask a request: the gdn_tree kernel where a
           backend installed it). The committed rows are not touched: the forward leaves per-node
           vectors pending (hybrid_tree.TreePending, a request a batch row);
  commit   after acceptance, `SlotStates.commit` moves each request's row along its accepted path
           only (hybrid_tree.commit_paths, one rank-(n+1) update a request and layer): nothing of a
           rejected draft or branch reaches the committed state (the stale-state class of bug).
           A forward nobody commits (`drop`, or the next forward) leaves the rows as they were.

The projections, norms and MLPs run over all packed rows at once, as for attention targets.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from specpilot.runtime.cache import KVCache
from specpilot.runtime.hybrid import RECORD_LIMIT, GatedAttention, GatedDeltaNet, HybridTransformer
from specpilot.runtime.hybrid_tree import TreePending, commit_paths, commit_state, conv_sources, conv_tree

if TYPE_CHECKING:
    from specpilot.runtime.batch import Ragged, RaggedAttention, SlotKV


class SlotStates:
    """A row a request slot of every Gated DeltaNet layer's recurrent state and conv inputs, and
    the last verify forward's pending per-node vectors (`pending`, its requests' slots in
    `pending_slots`) until `commit`."""

    def __init__(self, model: HybridTransformer, rows: int) -> None:
        cfg = model.cfg
        conv_dim = 2 * cfg.linear_num_key_heads * cfg.linear_key_head_dim + \
            cfg.linear_num_value_heads * cfg.linear_value_head_dim
        self.kernel = cfg.linear_conv_kernel_dim
        layers, dev = len(cfg.linear_layers), model.device
        self.conv = [torch.zeros(rows, conv_dim, self.kernel - 1, dtype=model.dtype, device=dev) for _ in range(layers)]
        shape = (rows, cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim)
        self.state = [torch.zeros(shape, dtype=torch.float32, device=dev) for _ in range(layers)]
        self.pending: list[TreePending] | None = None
        self.pending_slots: tuple[int, ...] = ()

    def reset(self, slot: int) -> None:
        """Row `slot` empty (zero state and conv inputs): a request admitted there starts from nothing."""
        for x in (*self.state, *self.conv):
            x[slot].zero_()

    def drop(self) -> None:
        """Forget the last verify forward: the rows stay as committed."""
        self.pending, self.pending_slots = None, ()

    def commit(self, paths: Sequence[Sequence[int]]) -> None:
        """After the last verify forward: request i (its order in that forward) keeps the root path
        paths[i] (node indices, root first; a chain's accepted prefix is 0..n): every layer's row
        moves along that path only. Then nothing is pending."""
        if self.pending is None or len(paths) != len(self.pending_slots):
            raise ValueError(f"SlotStates.commit: {len(paths)} paths for a verify forward of "
                             f"{len(self.pending_slots) if self.pending is not None else 'no'} requests")
        dev = self.state[0].device if self.state else torch.device("cpu")
        longest = max(len(p) for p in paths)
        path = torch.tensor([list(p) + [0] * (longest - len(p)) for p in paths], dtype=torch.long, device=dev)
        n = torch.tensor([len(p) - 1 for p in paths], dtype=torch.long, device=dev)
        slots = torch.tensor(self.pending_slots, dtype=torch.long, device=dev)
        for state, conv, pending in zip(self.state, self.conv, self.pending):
            moved, inputs = commit_paths(state.index_select(0, slots), pending, path, n)
            state.index_copy_(0, slots, moved)
            conv.index_copy_(0, slots, inputs.to(conv.dtype))
        self.drop()


def hybrid_slots(model: HybridTransformer, rows: int, capacity: int) -> tuple[KVCache, SlotStates]:
    """The engine's caches for a hybrid target: the attention layers' K/V as one stacked buffer of
    `rows` request rows (what SlotKV compacts tree paths in), and the Gated DeltaNet rows."""
    cfg = model.cfg
    stacked = torch.zeros((2, len(cfg.attention_layers), rows, cfg.num_kv_heads, capacity, cfg.head_dim),
                          dtype=model.dtype, device=model.device)
    return KVCache(list(stacked[0]), list(stacked[1]), capacity, stacked), SlotStates(model, rows)


def request_trees(r: Ragged) -> torch.Tensor:
    """[B, T, T] bool (T the longest request): request i's ancestor mask in its top-left corner (its
    tree, or a chain's lower triangle), every padding node its own only ancestor."""
    t = r.max_count
    out = torch.eye(t, dtype=torch.bool, device=r.device).repeat(len(r.counts), 1, 1)
    for i, c in enumerate(r.counts):
        mask = r.request_mask(i)
        out[i, :c, :c] = torch.ones(c, c, dtype=torch.bool, device=r.device).tril() if isinstance(mask, str) \
            else mask.to(r.device)
    return out


def gated_attention_rows(attn: GatedAttention, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: SlotKV,
                         index: int, r: Ragged, attention: RaggedAttention) -> torch.Tensor:
    """GatedAttention.forward over packed rows h [1, N, hidden]: K/V into attention layer `index` of
    each row's slot and key slot, each request attending as the mask says."""
    b, t, _ = h.shape
    q, gate, k, v = attn.project(h, cos, sin)
    kv.write(index, r, k, v)
    o = attention(q[0].transpose(0, 1), kv.cache.k[index], kv.cache.v[index], r).reshape(b, t, -1)
    return attn.o_proj(o * torch.sigmoid(gate.reshape(b, t, -1)))


def _prefill_rows(mixer: GatedDeltaNet, h: torch.Tensor, states: SlotStates, layer: int, r: Ragged) -> torch.Tensor:
    """Each request's prompt rows from its row of layer `layer`, in the batch-1 forward's form for
    that many tokens (HybridTransformer.run_layers); the rows move to the state after the prompt."""
    out = []
    state, conv = states.state[layer], states.conv[layer]
    for slot, start, count in zip(r.slots, r.starts, r.counts):
        x = h[:, start:start + count]
        c0, s0 = conv[slot:slot + 1], state[slot:slot + 1]
        if 2 <= count <= RECORD_LIMIT:
            chain = torch.ones(count, count, dtype=torch.bool, device=h.device).tril()
            y, p = mixer.forward_tree(x, c0, s0, chain)
            path = torch.arange(count, device=h.device)
            moved, window = commit_state(s0, p.k, p.w, p.cum_g, path, path >= 0), p.window
        else:
            y, window, moved = mixer(x, c0, s0, record=count <= RECORD_LIMIT)
            moved = moved[-1] if count <= RECORD_LIMIT else moved
        state[slot] = moved[0]
        conv[slot] = window[0, :, window.shape[-1] - (states.kernel - 1):]
        out.append(y)
    return torch.cat(out, dim=1)


def _verify_rows(mixer: GatedDeltaNet, h: torch.Tensor, states: SlotStates, layer: int, r: Ragged,
                 trees: torch.Tensor, where: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
                 ) -> tuple[torch.Tensor, TreePending]:
    """Every request's rows as its tree over its own row of layer `layer`, all requests at once
    ([B, T] gathered by where[0], trees [B, T, T]). Returns the output rows packed back [1, N,
    hidden] (where[1:]: each row's request and node) and the per-node vectors; the rows are not
    touched."""
    gather, row_b, row_j = where
    inputs, z, beta, a = mixer.mix_inputs(h)  # [1, C, N], [1, N, Hv, dv], [1, N, Hv] x 2
    slots = torch.tensor(r.slots, dtype=torch.long, device=h.device)
    c0, s0 = states.conv[layer].index_select(0, slots), states.state[layer].index_select(0, slots)
    x = inputs[0][:, gather].transpose(0, 1)  # [B, C, T]
    sources = conv_sources(trees, mixer.kernel)  # [B, T, kernel]
    weight = mixer.conv1d.weight
    mixed = F.silu(conv_tree(c0, x, weight, sources)).to(weight.dtype).to(h.dtype).transpose(1, 2)
    q, k, v, g, b = mixer.rule_inputs(mixed, beta[0][gather], a[0][gather], h.dtype)
    out, k, w, cum_g = mixer.tree_rule(q, k, v, g, b, s0, trees)
    y = mixer.gated_output(out, z[0][gather], h.dtype)  # [B, T, hidden]
    return y[row_b, row_j][None], TreePending(k, w, cum_g, torch.cat([c0, x], dim=-1), sources)


def hybrid_ragged_forward(model: HybridTransformer, kv: SlotKV, states: SlotStates, ids: torch.Tensor, r: Ragged,
                          attention: RaggedAttention, hidden_layers: tuple[int, ...] = (), *, prefill: bool = False
                          ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The hybrid's layers over packed rows ids [r.total] (batch.ragged_forward's, for a hybrid):
    attention K/V land at each row's slot and key slot (lengths are the caller's to move); Gated
    DeltaNet layers run each request from its own row, committed at once (`prefill`) or left
    pending for `SlotStates.commit` (a verify; masks "causal" or a tree a request). Padding rows
    past r.rows pass the Gated DeltaNet layers as zeros. Returns (the final norm's output [N,
    hidden], the `hidden_layers` outputs [N, len * hidden] or None)."""
    rows, dev = r.rows, ids.device
    cos, sin = model.rope(r.token_position[None])
    if not prefill:
        trees = request_trees(r)
        t = r.max_count
        j = torch.arange(t, device=dev)
        starts = torch.tensor(r.starts, device=dev)
        counts = torch.tensor(r.counts, device=dev)
        gather = starts[:, None] + torch.minimum(j[None], counts[:, None] - 1)  # [B, T]: padding nodes repeat a row
        row_b = torch.repeat_interleave(torch.arange(len(r.counts), device=dev), counts)
        row_j = torch.arange(rows, device=dev) - starts[row_b]
        pending = []
    x = model.embed(ids[None])
    picked = {}
    for i, layer in enumerate(model.model.layers):
        h = layer.input_layernorm(x)
        slot = model.layer_slot[i]
        if layer.layer_type == "linear_attention":
            if prefill:
                y = _prefill_rows(layer.linear_attn, h[:, :rows], states, slot, r)
            else:
                y, p = _verify_rows(layer.linear_attn, h[:, :rows], states, slot, r, trees, (gather, row_b, row_j))
                pending.append(p)
            if r.total > rows:
                y = torch.cat([y, y.new_zeros(1, r.total - rows, y.shape[-1])], dim=1)
        else:
            y = gated_attention_rows(layer.self_attn, h, cos, sin, kv, slot, r, attention)
        x = x + y
        x = x + layer.mlp(layer.post_attention_layernorm(x))
        if i in hidden_layers:
            picked[i] = x
    if prefill:
        states.drop()
    else:
        states.pending, states.pending_slots = pending, tuple(r.slots)
    hidden = torch.cat([picked[i] for i in hidden_layers], dim=-1)[0] if hidden_layers else None
    return model.final_norm(x)[0], hidden

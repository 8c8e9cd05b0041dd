"""Tree verification for Gated DeltaNet layers: the delta rule and the causal conv along each node's
ancestor chain, with the committed state moved along the accepted path only.

A tree of n nodes (node 0 the anchor, parents before children, `ancestors[i, j]` true when j is i
or one of its ancestors) is verified in one forward. For a Gated DeltaNet layer, node i must see
exactly what a chain over its root path would: its conv window is its own inputs and those of its
kernel-1 nearest ancestors, reaching into the committed conv inputs where the path is shorter; its
state is the committed one S0 moved by the delta rule along its path.

The rule in WY form along paths (what chunk kernels do inside a chunk, with the causal mask
replaced by the ancestor mask). With G_i the log decay summed along i's path (ancestors @ g),
k, q l2-normalised (q scaled by dk^-1/2), and w_i the state update's value row:

    S_i = exp(G_i) S0 + sum_{j anc-or-self of i} exp(G_i - G_j) k_j w_j^T
    w_i + beta_i sum_{j strict anc of i} exp(G_i - G_j) (k_i . k_j) w_j = beta_i (v_i - exp(G_i) S0^T k_i)
    o_i = exp(G_i) S0^T q_i + sum_{j anc-or-self of i} exp(G_i - G_j) (q_i . k_j) w_j

The system is unit lower triangular (ancestors precede), one triangular solve for all nodes. No
per-node state [dk, dv] is ever formed: what the step keeps until the commit (`TreePending`) is per
node one k row, one w row and one G, plus its conv inputs — (dk + dv + 1) floats per value head
against dk * dv for a per-node snapshot (the vLLM / SGLang design): 1/64 of it at dk = dv = 128.

Commit (`commit_state`): the accepted path p_0 .. p_n (the root and n accepted drafts) gives
S = exp(G_pn) S0 + sum_m exp(G_pn - G_pm) k_pm w_pm^T, one rank-(n+1) update; w of a path node
depends on its ancestors only, so it is the value a chain over the path computes. Nothing of a
rejected branch enters. The path may be padded past n with don't-care nodes and n a device
tensor (graphed loops): `valid` masks them, no host read.

`delta_rule_tree_recurrent` is the per-node-snapshot design (a state per node, each from its
parent's): the comparator for memory and a second reference for the tests.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def tree_depth(ancestors: torch.Tensor) -> torch.Tensor:
    """Depth of every node [n] (int64) from the inclusive ancestor mask [n, n]."""
    return ancestors.long().sum(dim=-1) - 1


def conv_sources(ancestors: torch.Tensor, kernel: int) -> torch.Tensor:
    """[n, kernel] column indices into [committed conv inputs (kernel-1 columns) ; the n nodes' inputs]:
    column m of row i is the input m steps before node i along its path (m = 0: i itself), the
    oldest first, as a causal conv of width `kernel` over i's root path reads it. Ancestors
    [B, n, n] (a tree a request) give [B, n, kernel].

    Node i at depth d: m <= d is its ancestor at depth d - m (node column kernel-1 + that index),
    m > d reaches into the committed inputs (column kernel-1 - (m - d)). Device ops only."""
    depth = tree_depth(ancestors)
    cols = []
    for m in range(kernel - 1, -1, -1):
        want = depth - m  # [..., n]
        hit = ancestors & (depth[..., None, :] == want[..., :, None])  # the ancestor at depth d - m, if any
        node = hit.int().argmax(dim=-1)
        cols.append(torch.where(want >= 0, kernel - 1 + node, (kernel - 1) + want))
    return torch.stack(cols, dim=-1)


def chain_sources(t: int, kernel: int, device: torch.device | str) -> torch.Tensor:
    """`conv_sources` of a chain of t nodes (each the previous one's child), in closed form: column m
    of row i is i - m steps along, kernel - 1 + i - m in the window, committed inputs included."""
    return kernel - 1 + torch.arange(t, device=device)[:, None] - torch.arange(kernel - 1, -1, -1, device=device)


def conv_tree(conv_state: torch.Tensor, inputs: torch.Tensor, weight: torch.Tensor, sources: torch.Tensor
              ) -> torch.Tensor:
    """The depthwise causal conv (no activation) of every node over its own path.

    conv_state [B, C, kernel-1] (committed inputs, oldest first), inputs [B, C, n], weight
    [C, 1, kernel], sources from `conv_sources` ([n, kernel], or [B, n, kernel]: a tree a row)
    -> [B, C, n] float32 (summed in float32)."""
    window = torch.cat([conv_state, inputs], dim=-1)  # [B, C, kernel-1+n]
    if sources.dim() == 2:
        gathered = window[:, :, sources].float()  # [B, C, n, kernel]
    else:
        b, n, width = sources.shape
        index = sources.reshape(b, 1, n * width).expand(-1, window.shape[1], -1)
        gathered = window.gather(2, index).view(b, -1, n, width).float()
    return (gathered * weight[:, 0].float()[None, :, None, :]).sum(dim=-1)


@dataclass
class TreePending:
    """What a tree forward leaves for the commit, per Gated DeltaNet layer: the nodes' normalised
    keys k [B, H, n, dk] and update rows w [B, H, n, dv], G [B, H, n] (log decay summed along each
    path), the conv window [B, C, kernel-1+n] (committed inputs, then the nodes') and the
    `conv_sources` table [n, kernel] ([B, n, kernel] for a tree a batch row)."""

    k: torch.Tensor
    w: torch.Tensor
    cum_g: torch.Tensor
    window: torch.Tensor
    sources: torch.Tensor

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.k, self.w, self.cum_g, self.window))


def delta_rule_tree(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                    state: torch.Tensor, ancestors: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gated delta rule over a tree in WY form (module docstring), float32.

    q, k [B, H, n, dk] (not yet normalised), v [B, H, n, dv], g (log decay) and beta [B, H, n],
    state S0 [B, H, dk, dv], ancestors [n, n] bool (inclusive; ancestors precede), or [B, n, n]: a
    tree a batch row (the batched engine's requests). Returns (o [B, H, n, dv], k normalised
    [B, H, n, dk], w [B, H, n, dv], G [B, H, n])."""
    q = l2norm(q) / (q.shape[-1] ** 0.5)
    k = l2norm(k)
    anc = ancestors.to(q.device)
    if anc.dim() == 2:
        cum_g = g @ anc.to(g.dtype).transpose(0, 1)  # G_i = sum of g over i's ancestors and itself
    else:
        anc = anc[:, None]  # [B, 1, n, n] against [B, H, ...]
        cum_g = (g[..., None, :] @ anc.to(g.dtype).transpose(-1, -2))[..., 0, :]
    strict = anc & ~torch.eye(anc.shape[-1], dtype=torch.bool, device=anc.device)
    diff = cum_g[..., :, None] - cum_g[..., None, :]
    decay_strict = diff.masked_fill(~strict, float("-inf")).exp()
    decay_incl = diff.masked_fill(~anc, float("-inf")).exp()
    kk = k @ k.transpose(-1, -2)
    system = beta[..., None] * kk * decay_strict
    rhs = beta[..., None] * (v - cum_g.exp()[..., None] * (k @ state))
    eye = torch.eye(anc.shape[-1], dtype=q.dtype, device=q.device)
    w = torch.linalg.solve_triangular(system + eye, rhs, upper=False, unitriangular=True)
    o = cum_g.exp()[..., None] * (q @ state) + ((q @ k.transpose(-1, -2)) * decay_incl) @ w
    return o, k, w, cum_g


def commit_state(state: torch.Tensor, k: torch.Tensor, w: torch.Tensor, cum_g: torch.Tensor,
                 path: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """The state after the accepted path: state [B, H, dk, dv], k/w/cum_g of the tree's nodes,
    path [L] node indices (root first), valid [L] bool (true for the root and the accepted nodes,
    a prefix). Returns S = exp(G_last) S0 + sum_m exp(G_last - G_pm) k_pm w_pm^T."""
    kp, wp, gp = k.index_select(2, path), w.index_select(2, path), cum_g.index_select(2, path)
    last = valid.long().sum().sub(1).clamp(min=0).view(1)
    g_last = gp.index_select(2, last)  # [B, H, 1]
    scale = (g_last - gp).masked_fill(~valid, float("-inf")).exp()  # [B, H, L]
    return g_last.exp()[..., None] * state + (kp * scale[..., None]).transpose(-1, -2) @ wp


def commit_paths(state: torch.Tensor, pending: TreePending, path: torch.Tensor, n: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """`commit_state` and `commit_conv` for a batch of trees, one a row (the batched engine's
    requests, `pending` from a forward over ancestors [B, n, n]): path [B, L] node indices (root
    first, padded past n), n [B] each row's accepted count. Returns (state [B, H, dk, dv], conv
    inputs [B, C, kernel-1]) after each row's accepted path."""
    b, h, _, dk = pending.k.shape
    dv, length = pending.w.shape[-1], path.shape[1]
    index = path[:, None, :].expand(b, h, length)
    kp = pending.k.gather(2, index[..., None].expand(-1, -1, -1, dk))
    wp = pending.w.gather(2, index[..., None].expand(-1, -1, -1, dv))
    gp = pending.cum_g.gather(2, index)  # [B, H, L]
    valid = torch.arange(length, device=path.device)[None] <= n[:, None]  # [B, L]
    g_last = gp.gather(2, n[:, None, None].expand(-1, h, 1))  # [B, H, 1]
    scale = (g_last - gp).masked_fill(~valid[:, None], float("-inf")).exp()
    moved = g_last.exp()[..., None] * state + (kp * scale[..., None]).transpose(-1, -2) @ wp
    last = path.gather(1, n[:, None])  # [B, 1]
    sources = pending.sources.gather(1, last[..., None].expand(-1, -1, pending.sources.shape[-1]))
    cols = sources[:, 0, 1:]  # drop the oldest: kernel-1 columns
    conv = pending.window.gather(2, cols[:, None, :].expand(-1, pending.window.shape[1], -1))
    return moved, conv


def commit_conv(pending: TreePending, last: torch.Tensor, kernel: int) -> torch.Tensor:
    """The committed conv inputs after accepting up to node `last` (a 1-element index tensor): its
    own input and those of its kernel-2 nearest ancestors (or committed ones), oldest first."""
    cols = pending.sources.index_select(0, last.view(1))[0, 1:]  # drop the oldest: kernel-1 columns
    return pending.window.index_select(2, cols)


def delta_rule_tree_recurrent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                              beta: torch.Tensor, state: torch.Tensor, parent: list[int]
                              ) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-node-snapshot design: node by node, each state from its parent's (the root's from
    `state`), as `hybrid.delta_rule_recurrent` steps a chain. Returns (o [B, H, n, dv], the states
    after every node [n, B, H, dk, dv]): the memory a snapshot design holds through the step."""
    q = l2norm(q) / (q.shape[-1] ** 0.5)
    k = l2norm(k)
    states, out = [], []
    for i, p in enumerate(parent):
        s = (state if p < 0 else states[p]) * g[:, :, i].exp()[..., None, None]
        k_i = k[:, :, i].unsqueeze(-1)
        delta = (v[:, :, i] - (s * k_i).sum(dim=-2)) * beta[:, :, i].unsqueeze(-1)
        s = s + k_i * delta.unsqueeze(-2)
        out.append((s * q[:, :, i].unsqueeze(-1)).sum(dim=-2))
        states.append(s)
    return torch.stack(out, dim=2), torch.stack(states)


def parents_from_ancestors(ancestors: torch.Tensor) -> list[int]:
    """Parent of every node (-1 for roots) from the inclusive ancestor mask (host lists; tests and
    the snapshot comparator)."""
    depth = tree_depth(ancestors)
    hit = ancestors & (depth[None, :] == (depth - 1)[:, None])
    return torch.where(depth > 0, hit.int().argmax(dim=1), -1).tolist()



def tree_state_bytes(*, nodes: int, v_heads: int, k_heads: int, dk: int, dv: int, kernel: int, linear_layers: int,
                     conv_bytes: int = 4) -> tuple[int, int]:
    """Bytes one request keeps from a tree verify of `nodes` nodes to its commit, all Gated DeltaNet
    layers: (this design's `TreePending`: per node a k row, a w row and G per value head in float32,
    the conv inputs; per-node snapshots: a float32 state [v_heads, dk, dv] and kernel-1 conv inputs
    per node). `conv_bytes`: the model dtype's size (the conv inputs are activations)."""
    conv_dim = 2 * k_heads * dk + v_heads * dv
    ours = nodes * v_heads * (dk + dv + 1) * 4 + conv_dim * (kernel - 1 + nodes) * conv_bytes
    snapshots = nodes * (v_heads * dk * dv * 4 + conv_dim * (kernel - 1) * conv_bytes)
    return linear_layers * ours, linear_layers * snapshots

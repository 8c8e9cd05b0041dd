"""Qwen3-Next-family hybrid causal LM over our own cache: Gated DeltaNet and gated full attention.

Follows HF transformers' `modeling_qwen3_next` op for op (the tests compare logits in fp32):
zero-centred RMSNorm (x̂ · (1 + w)), full-attention layers whose q_proj also yields a sigmoid output
gate, per-head q/k norms and partial RoPE; linear-attention layers (Gated DeltaNet): in_proj_qkvz /
in_proj_ba, a depthwise causal conv1d + SiLU over [q, k, v], l2-normalised q/k, the gated delta rule
over a [dk, dv] state per value head, a SiLU-gated RMSNorm and out_proj. Dense MLPs or sparse MoE blocks (SparseMoE).
Parameters live under HF's weight names, so an HF safetensors state dict loads directly.

Speculative rollback through the decode loops' interface (`cache.length`, `cache.rollback(n)`):
a recurrence cannot drop tokens by moving a pointer, so a forward of at most `RECORD_LIMIT` tokens
keeps what it takes to recompute the state after any of its positions: a single token (decode) runs
the recurrent form and keeps its two states; 2..RECORD_LIMIT tokens (verify) run as a tree whose
every node hangs from the one before, in WY form (hybrid_tree.py: one triangular solve a layer, the
Triton kernel on GPUs), keeping the state before the forward and per token a key row, an update row
and a decay sum. `rollback(n)` to any n inside the last forward recomputes the state after position
n from those (one rank-n update). Longer forwards (prefill) run the chunked form and keep only their
final state.

Trees (a bool ancestor mask and the nodes' positions, as tree loops pass them): the Gated DeltaNet
layers run `forward_tree` (hybrid_tree.py: the conv and the delta rule along each node's ancestor
chain, in WY form, with no per-node state), the cache keeps per-node vectors until
`HybridCache.commit_path` moves the committed state along the accepted path. Block non-causal masks
have no meaning for a recurrence and are refused. A device-length cache (`new_cache(device_length=
True)`) serves graphed steps: states update in place, rollbacks and commits take device indices.

Numerics (fp32, tiny random models): at T=23 the WY form is 3.9e-5 from a float64 run in the logits,
the recurrent form 1.9e-5, the chunked form (HF's prefill) 1.6e-4.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from specpilot.runtime.cache import DeviceKVCache, KVCache
from specpilot.hf.config import HybridConfig
from specpilot.runtime.hybrid_tree import (
    TreePending,
    chain_sources,
    commit_conv,
    commit_state,
    conv_sources,
    conv_tree,
    delta_rule_tree,
    l2norm,
)
from specpilot.runtime.model import (
    ATTENTION_PROJ,
    MLP,
    MLP_PROJ,
    ModelOutput,
    Visibility,
    fill_tied_head,
    apply_rope,
    attend_visible,
    rope_cos_sin,
    swap_projection,
)

DELTANET_PROJ = ("in_proj_qkvz", "in_proj_ba", "out_proj")
# Forwards of at most this many tokens can roll back to any of their positions (a verify is
# block_size + 1 tokens). Longer ones (prefill) keep only the final state.
RECORD_LIMIT = 64
CHUNK = 64  # chunk length of the chunked delta rule (HF's default)


class CenteredRMSNorm(nn.Module):
    """Qwen3-Next RMSNorm: weight stored zero-centred, y = x̂ · (1 + w), all in float32."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).type_as(x)


class GatedRMSNorm(nn.Module):
    """RMSNorm of the DeltaNet output per value head (plain weight), then times SiLU(z)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        h = self.weight * h.to(dtype)
        return (h * F.silu(gate.float())).to(dtype)


def delta_rule_recurrent(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule token by token, in float32.

    q, k [B, H, T, dk] and v [B, H, T, dv] (q and k not yet normalised), g (log decay, <= 0) and
    beta [B, H, T], state [B, H, dk, dv]. Returns the output [B, H, T, dv] and the states
    [T + 1, B, H, dk, dv]: index 0 is the input state, index t the state after token t.
    """
    q = l2norm(q)
    k = l2norm(k)
    q = q / (q.shape[-1] ** 0.5)
    states = [state]
    out = []
    for t in range(q.shape[2]):
        s = states[-1] * g[:, :, t].exp()[..., None, None]
        k_t = k[:, :, t].unsqueeze(-1)
        remembered = (s * k_t).sum(dim=-2)
        delta = (v[:, :, t] - remembered) * beta[:, :, t].unsqueeze(-1)
        s = s + k_t * delta.unsqueeze(-2)
        out.append((s * q[:, :, t].unsqueeze(-1)).sum(dim=-2))
        states.append(s)
    return torch.stack(out, dim=2), torch.stack(states)


def delta_rule_chunked(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor,
    chunk: int = CHUNK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The same rule over chunks of `chunk` tokens (a UT transform inside each chunk, a scan over
    chunks), as HF's torch_chunk_gated_delta_rule. Returns the output and the final state only."""
    b, h, t, dk = k.shape
    dv = v.shape[-1]
    q = l2norm(q)
    k = l2norm(k)
    q = q * dk**-0.5
    pad = (chunk - t % chunk) % chunk
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    beta, g = (F.pad(x, (0, pad)) for x in (beta, g))
    n = (t + pad) // chunk
    v_beta = v * beta.unsqueeze(-1)
    k_beta = k * beta.unsqueeze(-1)
    q, k, k_beta, v_beta = (x.reshape(b, h, n, chunk, x.shape[-1]) for x in (q, k, k_beta, v_beta))
    g = g.reshape(b, h, n, chunk)
    upper = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    cum = g.cumsum(dim=3)
    decay = (cum.unsqueeze(4) - cum.unsqueeze(3)).masked_fill(upper, float("-inf")).exp()
    system = (k_beta @ k.transpose(-1, -2)) * decay
    intra = (q @ k.transpose(-1, -2)) * decay
    new_values = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    k_cumdecay = torch.linalg.solve_triangular(
        system, k_beta * cum.exp().unsqueeze(-1), upper=False, unitriangular=True
    )
    q = q * cum.exp().unsqueeze(-1)
    k = k * (cum[..., -1:] - cum).exp().unsqueeze(-1)
    chunk_decay = cum[..., -1].exp()[..., None, None]
    s = state
    out = []
    for i in range(n):
        v_new = new_values[:, :, i] - k_cumdecay[:, :, i] @ s
        out.append(q[:, :, i] @ s + intra[:, :, i] @ v_new)
        s = s * chunk_decay[:, :, i] + k[:, :, i].transpose(-1, -2) @ v_new
    return torch.stack(out, dim=2).reshape(b, h, -1, dv)[:, :, :t], s


class GatedDeltaNet(nn.Module):
    """The linear-attention token mixer of one layer (HF: `linear_attn`)."""

    def __init__(self, cfg: HybridConfig) -> None:
        super().__init__()
        self.k_heads, self.v_heads = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.dk, self.dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.key_dim, self.value_dim = self.k_heads * self.dk, self.v_heads * self.dv
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.kernel = cfg.linear_conv_kernel_dim
        h = cfg.hidden_size
        # HF's module, for its weight name and shape [conv_dim, 1, kernel]; forward calls F.conv1d over
        # [cached inputs ; new inputs] itself, so no padding is used.
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, self.kernel, groups=self.conv_dim, bias=False,
                                padding=self.kernel - 1)
        self.in_proj_qkvz = nn.Linear(h, 2 * self.key_dim + 2 * self.value_dim, bias=False)
        self.in_proj_ba = nn.Linear(h, 2 * self.v_heads, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(self.v_heads))
        self.A_log = nn.Parameter(torch.zeros(self.v_heads))
        self.norm = GatedRMSNorm(self.dv, cfg.rms_norm_eps)
        self.out_proj = nn.Linear(self.value_dim, h, bias=False)
        # the tree form of the rule (hybrid_tree.delta_rule_tree's signature): a backend may install a kernel
        self.tree_rule = delta_rule_tree

    def _split(self, qkvz: torch.Tensor, ba: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """HF's grouped layout: per key head [q, k, v x r, z x r] and [b x r, a x r], r = v_heads / k_heads."""
        b, t, _ = qkvz.shape
        r = self.v_heads // self.k_heads
        q, k, v, z = torch.split(qkvz.view(b, t, self.k_heads, -1), [self.dk, self.dk, r * self.dv, r * self.dv], dim=3)
        beta, a = torch.split(ba.view(b, t, self.k_heads, 2 * r), [r, r], dim=3)
        return (q.reshape(b, t, -1), k.reshape(b, t, -1), v.reshape(b, t, -1), z.reshape(b, t, self.v_heads, self.dv),
                beta.reshape(b, t, self.v_heads), a.reshape(b, t, self.v_heads))

    def mix_inputs(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """x [B, T, hidden] -> (conv inputs [B, conv_dim, T], z, beta, a)."""
        q, k, v, z, beta, a = self._split(self.in_proj_qkvz(x), self.in_proj_ba(x))
        return torch.cat([q, k, v], dim=-1).transpose(1, 2), z, beta, a

    def rule_inputs(self, mixed: torch.Tensor, beta: torch.Tensor, a: torch.Tensor, dtype: torch.dtype
                     ) -> tuple[torch.Tensor, ...]:
        """The conv's output [B, T, conv_dim] (after SiLU) and the gates -> q, k, v, g, beta as the
        delta rule takes them ([B, H, T, ...] float32, q and k repeated to the value heads)."""
        b, t, _ = mixed.shape
        q, k, v = torch.split(mixed, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q, k = q.reshape(b, t, -1, self.dk), k.reshape(b, t, -1, self.dk)
        v = v.reshape(b, t, -1, self.dv)
        beta = beta.sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        if self.v_heads > self.k_heads:
            q = q.repeat_interleave(self.v_heads // self.k_heads, dim=2)
            k = k.repeat_interleave(self.v_heads // self.k_heads, dim=2)
        return tuple(y.transpose(1, 2).float() for y in (q, k, v, g, beta))

    def gated_output(self, out: torch.Tensor, z: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        b, _, t, _ = out.shape
        out = out.transpose(1, 2).to(dtype)
        return self.out_proj(self.norm(out.reshape(-1, self.dv), z.reshape(-1, self.dv)).reshape(b, t, -1))

    def forward(
        self, x: torch.Tensor, conv_state: torch.Tensor, state: torch.Tensor, *, record: bool
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [B, T, hidden] after the conv inputs `conv_state` [B, conv_dim, kernel-1] and the state
        [B, v_heads, dk, dv] -> (output [B, T, hidden], conv inputs [B, conv_dim, kernel-1+T],
        states [T+1, B, ...] if `record` else the final state [B, ...])."""
        inputs, z, beta, a = self.mix_inputs(x)
        window = torch.cat([conv_state, inputs], dim=-1)
        weight = self.conv1d.weight
        mixed = F.silu(F.conv1d(window.to(weight.dtype), weight, groups=self.conv_dim)).to(x.dtype).transpose(1, 2)
        q, k, v, g, beta = self.rule_inputs(mixed, beta, a, x.dtype)
        if record:
            out, states = delta_rule_recurrent(q, k, v, g, beta, state)
        else:
            out, states = delta_rule_chunked(q, k, v, g, beta, state)
        return self.gated_output(out, z, x.dtype), window, states

    def forward_tree(
        self, x: torch.Tensor, conv_state: torch.Tensor, state: torch.Tensor, ancestors: torch.Tensor,
        sources: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, TreePending]:
        """x [B, n, hidden], the nodes of a tree (ancestors [n, n], inclusive; parents first) ->
        (output [B, n, hidden], what the commit needs). conv_state and state are read, not changed:
        every node sees its own root path only (hybrid_tree.py). `sources`: conv_sources(ancestors,
        kernel), where the caller built it once for all layers."""
        inputs, z, beta, a = self.mix_inputs(x)
        if sources is None:
            sources = conv_sources(ancestors, self.kernel)
        window = torch.cat([conv_state, inputs], dim=-1)
        mixed = F.silu(conv_tree(conv_state, inputs, self.conv1d.weight, sources)).to(self.conv1d.weight.dtype)
        mixed = mixed.to(x.dtype).transpose(1, 2)
        q, k, v, g, beta = self.rule_inputs(mixed, beta, a, x.dtype)
        out, k, w, cum_g = self.tree_rule(q, k, v, g, beta, state, ancestors)
        return self.gated_output(out, z, x.dtype), TreePending(k, w, cum_g, window, sources)


def apply_partial_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on the leading cos.shape[-1] dims of each head; the rest pass through."""
    r = cos.shape[-1]
    return torch.cat([apply_rope(x[..., :r], cos, sin), x[..., r:]], dim=-1)


class GatedAttention(nn.Module):
    """Full attention with an output gate (HF: `self_attn`): q_proj yields [query, gate] per head,
    the attention output is multiplied by sigmoid(gate) before o_proj. `attention(q, k, v, vis)` is
    the slot a backend may fill with another kernel, as on `model.Attention`."""

    def __init__(self, cfg: HybridConfig) -> None:
        super().__init__()
        self.attention = attend_visible
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        h, q_out, kv_out = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.q_proj = nn.Linear(h, 2 * q_out, bias=False)
        self.k_proj = nn.Linear(h, kv_out, bias=False)
        self.v_proj = nn.Linear(h, kv_out, bias=False)
        self.o_proj = nn.Linear(q_out, h, bias=False)
        self.q_norm = CenteredRMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = CenteredRMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [B, T, hidden] -> q [B, H, T, D] (normed, rotated), the output gate [B, T, H, D], and the
        new k (normed, rotated) and v [B, KV, T, D]."""
        b, t, _ = x.shape
        q, gate = torch.chunk(self.q_proj(x).view(b, t, self.num_heads, 2 * self.head_dim), 2, dim=-1)
        q = apply_partial_rope(self.q_norm(q).transpose(1, 2), cos, sin)
        k = self.k_norm(self.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim)).transpose(1, 2)
        k = apply_partial_rope(k, cos, sin)
        v = self.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        return q, gate, k, v

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache, index: int, vis: Visibility
    ) -> torch.Tensor:
        """Writes the new K/V at slots [cache.length, +T) of attention layer `index` (length moves later)."""
        b, t, _ = x.shape
        q, gate, k, v = self.project(x, cos, sin)
        start = cache.length
        cache.write(index, start, k, v)
        k_all, v_all = cache.view(index, start + t)
        o = self.attention(q, k_all, v_all, vis).transpose(1, 2).reshape(b, t, -1)
        return self.o_proj(o * torch.sigmoid(gate.reshape(b, t, -1)))


class HybridCache:
    """The attention layers' `KVCache` plus, per linear-attention layer, the recurrent state
    [B, v_heads, dk, dv] (float32) and the conv inputs of the last kernel-1 tokens.

    `length` and `rollback(n)` behave as KVCache's for any n from the start of the last forward
    to `length`; earlier targets raise ValueError (the states before the last forward are gone).
    After a tree forward, `commit_path` keeps a root path (or `rollback` to its start drops it).

    States and conv inputs are buffers updated in place, so that a captured CUDA graph, which
    replays raw pointers, reads and writes the same memory each step. With a `DeviceKVCache`
    (`device_length`), the length, the rollback target and a committed path's length are device
    tensors and nothing here reads them on the host (no checks either: callers size the capacity).
    """

    def __init__(self, kv: KVCache, conv: list[torch.Tensor], state: list[torch.Tensor], kernel: int) -> None:
        self.kv = kv
        self.conv = conv
        self.state = state
        self.kernel = kernel
        self.on_device = isinstance(kv, DeviceKVCache)
        self._start: int | torch.Tensor = 0  # where the last forward began
        self._windows: list[torch.Tensor | None] = [None] * len(state)  # conv inputs seen by the last forward
        self._states: list[torch.Tensor | None] = [None] * len(state)  # [T+1, ...] after each position, or None
        # a chain forward in WY form: the state before it and its per-token vectors (rollback recomputes)
        self._chain: list[tuple[torch.Tensor, TreePending] | None] = [None] * len(state)
        self.tree_pending: list[TreePending | None] = [None] * len(state)  # a tree forward's, until commit_path

    @classmethod
    def for_model(
        cls, cfg: HybridConfig, batch: int, max_len: int, dtype: torch.dtype, device: torch.device | str,
        device_length: bool = False,
    ) -> HybridCache:
        shape = (batch, cfg.num_kv_heads, max_len, cfg.head_dim)
        n_attn, n_linear = len(cfg.attention_layers), len(cfg.linear_layers)
        kind = DeviceKVCache if device_length else KVCache
        kv = kind([torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_attn)],
                  [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_attn)], max_len)
        conv_dim = 2 * cfg.linear_num_key_heads * cfg.linear_key_head_dim + cfg.linear_num_value_heads * cfg.linear_value_head_dim
        k = cfg.linear_conv_kernel_dim
        conv = [torch.zeros(batch, conv_dim, k - 1, dtype=dtype, device=device) for _ in range(n_linear)]
        state_shape = (batch, cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim)
        state = [torch.zeros(state_shape, dtype=torch.float32, device=device) for _ in range(n_linear)]
        return cls(kv, conv, state, k)

    @property
    def length(self) -> int | torch.Tensor:
        return self.kv.length

    @property
    def max_len(self) -> int:
        return self.kv.max_len

    def key_slots(self, t: int) -> int:
        return self.kv.key_slots(t)

    def reset(self) -> None:
        """Empty: length 0, zero states, nothing of the last forward kept (a device-length cache's
        tensors are zeroed in place, so captured graphs still read them)."""
        self.kv.reset()
        for x in (*self.state, *self.conv):
            x.zero_()
        if isinstance(self._start, torch.Tensor):
            self._start.zero_()
        else:
            self._start = 0
        n = len(self.state)
        self._windows, self._states, self._chain, self.tree_pending = [None] * n, [None] * n, [None] * n, [None] * n

    def begin(self, t: int) -> None:
        """A forward of t tokens starts: check capacity before any layer's state changes."""
        if not self.on_device and self.length + t > self.max_len:
            raise ValueError(f"KV cache overflow: length {self.length} + {t} > capacity {self.max_len}")
        self._start = self.length.clone() if self.on_device else self.length
        self._windows = [None] * len(self.state)
        self._states = [None] * len(self.state)
        self._chain = [None] * len(self.state)
        self.tree_pending = [None] * len(self.state)

    def update_chain(self, layer: int, pending: TreePending) -> None:
        """Linear layer `layer` ran a chain forward in WY form (a chain is a tree whose every node
        is the previous one's child): the state moves to the end of the chain now, and a rollback
        recomputes the state after any prefix from the state before and the per-token vectors."""
        s0 = self.state[layer].clone()
        self._windows[layer] = pending.window
        self._chain[layer] = (s0, pending)
        t = pending.k.shape[2]
        path = torch.arange(t, device=s0.device)
        self.state[layer].copy_(commit_state(s0, pending.k, pending.w, pending.cum_g, path, path >= 0))
        self.conv[layer].copy_(pending.window[:, :, pending.window.shape[-1] - (self.kernel - 1):])

    def _chain_state(self, layer: int, i: int | torch.Tensor) -> torch.Tensor:
        """The state after the first i tokens of the last (WY) chain forward (i a host int, or a
        0-dim device tensor: no host value is made into a device tensor, so graphs capture it)."""
        s0, p = self._chain[layer]
        if not isinstance(i, torch.Tensor) and i == 0:
            return s0
        path = torch.arange(p.k.shape[2], device=s0.device)
        moved = commit_state(s0, p.k, p.w, p.cum_g, path, path < i)
        return torch.where(i > 0, moved, s0) if isinstance(i, torch.Tensor) else moved

    def _recorded(self) -> bool:
        return all(s is not None or c is not None for s, c in zip(self._states, self._chain))

    def update_linear(self, layer: int, window: torch.Tensor, states: torch.Tensor, recorded: bool) -> None:
        """Linear layer `layer` ran the current forward: its conv inputs and states (see GatedDeltaNet)."""
        self._windows[layer] = window
        self._states[layer] = states if recorded else None
        self.conv[layer].copy_(window[:, :, window.shape[-1] - (self.kernel - 1):])
        self.state[layer].copy_(states[-1] if recorded else states)

    def update_tree(self, layer: int, pending: TreePending) -> None:
        """Linear layer `layer` ran a tree forward: its state and conv inputs stay as committed
        until `commit_path` picks the accepted path."""
        self.tree_pending[layer] = pending

    def keep_tree_nodes(self, src: torch.Tensor, ancestors: torch.Tensor, kv_layers: Sequence[int]) -> None:
        """After layers of a tree forward ran over a larger tree: keep its nodes `src` only, as a tree
        whose node j is node src[j] and whose ancestor mask is `ancestors`. The pending per-node
        vectors of the linear layers that ran and the K/V of attention slots `kv_layers` (at slots
        start + src) move into that tree's order, as if it had been the forward's tree: exact when
        the kept nodes are closed under ancestors (a node's vectors depend on its own path only)."""
        if not self.pending_tree:
            raise ValueError("keep_tree_nodes needs a pending tree forward")
        c = self.kernel - 1
        cols = torch.cat([torch.arange(c, device=src.device), c + src])
        for j, p in enumerate(self.tree_pending):
            if p is not None:
                self.tree_pending[j] = TreePending(p.k.index_select(2, src), p.w.index_select(2, src),
                                            p.cum_g.index_select(2, src), p.window.index_select(2, cols.to(p.window.device)),
                                            conv_sources(ancestors.to(p.window.device), self.kernel))
        start, end = self._start, self._start + src.shape[0]
        for j in kv_layers:
            for buf in (self.kv.k[j], self.kv.v[j]):
                buf[:, :, start:end] = buf[:, :, start + src.to(buf.device)]  # gathered first

    @property
    def pending_tree(self) -> bool:
        return any(p is not None for p in self.tree_pending)

    def pending_bytes(self) -> int:
        """Bytes the last tree forward keeps for its commit, all linear layers (per-node vectors)."""
        return sum(p.nbytes() for p in self.tree_pending if p is not None)

    def commit_path(self, start: int | torch.Tensor, path: torch.Tensor | list[int],
                    n: torch.Tensor | int | None = None) -> None:
        """After a tree forward from `start`: keep the root path `path` (node indices, root first;
        the first n + 1 of them, all when n is None; n may be a device tensor, the path padded past
        it). Linear layers take the state and conv inputs after the path's last node
        (hybrid_tree.commit_state); attention layers' K/V of the path move to slots start..; the
        length becomes start + n + 1."""
        if not self.pending_tree or (not self.on_device and start != self._start):
            raise ValueError(f"commit_path({start}, ...) needs the tree forward that began at {start}; "
                             f"the last forward began at {self._start} and was {'a tree' if self.pending_tree else 'not a tree'}")
        device = self.state[0].device if self.state else torch.device("cpu")
        path = torch.as_tensor(path, dtype=torch.long, device=device)  # graphed steps pass a device tensor
        if not isinstance(n, torch.Tensor):  # filled on the device, not copied from the host
            n = torch.full((), path.shape[0] - 1 if n is None else n, dtype=torch.long, device=device)
        valid = torch.arange(path.shape[0], device=device) <= n
        last = path.index_select(0, n.view(1))
        for j, pending in enumerate(self.tree_pending):
            self.state[j].copy_(commit_state(self.state[j], pending.k, pending.w, pending.cum_g, path, valid))
            self.conv[j].copy_(commit_conv(pending, last, self.kernel))
        if self.on_device:
            src, dst = start + path, start + torch.arange(path.shape[0], device=device)
            for k, v in zip(self.kv.k, self.kv.v):
                k.index_copy_(2, dst, k.index_select(2, src))  # gathered first: overlapping moves are safe
                v.index_copy_(2, dst, v.index_select(2, src))
            self.kv.rollback(start + n + 1)
        else:
            from specpilot.runtime.tree import compact_kv

            compact_kv(self.kv, start, (start + path[: int(n) + 1]).tolist())
        self.tree_pending = [None] * len(self.state)
        self._states = [None] * len(self.state)
        self._chain = [None] * len(self.state)
        self._start = self.length.clone() if self.on_device else self.length

    def advance(self, n: int) -> None:
        self.kv.advance(n)

    def rollback(self, n: int | torch.Tensor) -> None:
        """Keep the first `n` tokens: select the linear layers' states after position n of the last forward."""
        if self.on_device:
            return self._rollback_on_device(torch.as_tensor(n, device=self.kv.length.device))
        if not 0 <= n <= self.length:
            raise ValueError(f"cannot roll back a hybrid cache of length {self.length} to {n}")
        if n == self.length and not self.pending_tree:
            return
        if self.pending_tree:
            if n != self._start:
                raise ValueError(f"cannot roll back a hybrid cache to {n} after a tree forward from {self._start}: "
                                 "keep a root path with commit_path, or drop the whole tree (rollback to its start)")
            self.tree_pending = [None] * len(self.state)  # the committed state was never touched
            self.kv.rollback(n)
            return
        if n < self._start:
            raise ValueError(
                f"cannot roll back a hybrid cache of length {self.length} to {n}: the linear-attention layers "
                f"keep their recurrent state only for positions {self._start}..{self.length} (the last forward)"
            )
        if not self._recorded():
            raise ValueError(
                f"cannot roll back a hybrid cache of length {self.length} to {n}: the last forward ran "
                f"{self.length - self._start} tokens, more than the {RECORD_LIMIT} whose per-position states are kept"
            )
        i = n - self._start
        for j, (window, states) in enumerate(zip(self._windows, self._states)):
            self.state[j].copy_(states[i] if states is not None else self._chain_state(j, i))
            self.conv[j].copy_(window[:, :, i : i + self.kernel - 1])
        self.kv.rollback(n)

    def _rollback_on_device(self, n: torch.Tensor) -> None:
        """rollback with a device target inside the last (recorded) forward, or to a tree's start."""
        if not self.pending_tree and self.state and self._recorded():
            i = (n - self._start).view(1)
            cols = i + torch.arange(self.kernel - 1, device=n.device)
            for j, (window, states) in enumerate(zip(self._windows, self._states)):
                self.state[j].copy_(states.index_select(0, i)[0] if states is not None else self._chain_state(j, i[0]))
                self.conv[j].copy_(window.index_select(2, cols))
        self.tree_pending = [None] * len(self.state)
        self.kv.rollback(n)


class ExpertMLP(nn.Module):
    """A SwiGLU MLP of a given width (an expert, or the shared expert)."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class SparseMoE(nn.Module):
    """Qwen3-Next's sparse MoE block, as HF computes it: softmax (fp32) over `gate` logits, top-k
    experts per token (renormalised if norm_topk_prob), each expert's SwiGLU output scaled by its
    weight and summed in expert order, plus the shared expert scaled by sigmoid(shared_expert_gate).
    Weight names as the checkpoints store them: mlp.gate, mlp.experts.{e}.*, mlp.shared_expert.*.

    Experts run one by one over the tokens routed to them (which experts are hit is read on the
    host): a reference implementation, not a grouped-GEMM kernel, and not CUDA-graph capturable."""

    def __init__(self, cfg: HybridConfig) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.top_k, self.norm_topk_prob = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.gate = nn.Linear(h, cfg.num_experts, bias=False)
        self.experts = nn.ModuleList(ExpertMLP(h, cfg.moe_intermediate_size) for _ in range(cfg.num_experts))
        self.shared_expert = ExpertMLP(h, cfg.shared_expert_intermediate_size)
        self.shared_expert_gate = nn.Linear(h, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        shared = self.shared_expert(flat)
        logits = self.gate(flat)
        weights, chosen = torch.softmax(logits, dim=-1, dtype=torch.float).topk(self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        weights = weights.to(logits.dtype)
        out = torch.zeros_like(flat)
        for e in chosen.unique().tolist():  # ascending, as HF's loop over the experts hit
            token, slot = torch.where(chosen == e)
            y = self.experts[e](flat[token]) * weights[token, slot, None]
            out.index_add_(0, token, y.to(out.dtype))
        out = out + torch.sigmoid(self.shared_expert_gate(flat)) * shared
        return out.reshape(x.shape)


def unfuse_experts(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF transformers 5 keeps experts fused in memory (experts.gate_up_proj [E, 2I, H],
    experts.down_proj [E, H, I]); checkpoints on disk, and this runtime, name them one by one."""
    out = {}
    for name, t in state_dict.items():
        if name.endswith(".experts.gate_up_proj"):
            base, half = name.removesuffix("gate_up_proj"), t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{base}{e}.gate_proj.weight"] = t[e, :half]
                out[f"{base}{e}.up_proj.weight"] = t[e, half:]
        elif name.endswith(".experts.down_proj"):
            base = name.removesuffix("down_proj")
            for e in range(t.shape[0]):
                out[f"{base}{e}.down_proj.weight"] = t[e]
        else:
            out[name] = t
    return out


class HybridLayer(nn.Module):
    """One decoder layer: a Gated DeltaNet (`linear_attn`) or gated attention (`self_attn`), then
    the MLP (dense, or the sparse MoE block)."""

    def __init__(self, cfg: HybridConfig, layer_type: str, moe: bool = False) -> None:
        super().__init__()
        self.layer_type = layer_type
        self.input_layernorm = CenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if layer_type == "linear_attention":
            self.linear_attn = GatedDeltaNet(cfg)
        else:
            self.self_attn = GatedAttention(cfg)
        self.post_attention_layernorm = CenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = SparseMoE(cfg) if moe else MLP(cfg)  # MLP reads only hidden_size and intermediate_size


class HybridBackbone(nn.Module):
    """The `model.` prefix of HF weight names."""

    def __init__(self, cfg: HybridConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(HybridLayer(cfg, t, i in cfg.moe_layers) for i, t in enumerate(cfg.layer_types))
        self.norm = CenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class HybridTransformer(nn.Module):
    """A Qwen3-Next-family causal LM with the interface of `model.Transformer` (forward, new_cache,
    embed / final_norm / head, linear_modules / set_linear)."""

    def __init__(self, cfg: HybridConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.model = HybridBackbone(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
            self.register_load_state_dict_pre_hook(fill_tied_head)
        # layer index -> its index among the attention layers (KV slots) or the linear layers (states)
        self.layer_slot = {i: cfg.attention_layers.index(i) if t == "full_attention" else cfg.linear_layers.index(i)
                      for i, t in enumerate(cfg.layer_types)}
        self._inv_freq: dict[torch.device, torch.Tensor] = {}

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    def new_cache(self, batch: int, max_len: int, *, device_length: bool = False) -> HybridCache:
        """A static cache; `device_length` keeps its length (and rollback targets) on the device, for
        CUDA graphs. Sparse MoE layers read routed experts on the host: not with `device_length`."""
        if device_length and self.cfg.moe_layers:
            raise ValueError("a device-length cache is for graphed steps, which a sparse MoE layer cannot be part of "
                             "(it reads the experts a step routes to on the host)")
        return HybridCache.for_model(self.cfg, batch, max_len, self.dtype, self.device, device_length)

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [B, 1, T, rotary_dim] for positions [B, T]."""
        device = positions.device
        if device not in self._inv_freq:
            dim = self.cfg.rotary_dim
            exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(device, torch.float) / dim
            self._inv_freq[device] = 1.0 / (self.cfg.rope_theta**exponents)
        return rope_cos_sin(self._inv_freq[device], positions, self.dtype)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens.weight[ids]  # as Transformer.embed: indexing, not index_select

    def final_norm(self, h: torch.Tensor) -> torch.Tensor:
        return self.model.norm(h)

    def head(self, h: torch.Tensor) -> torch.Tensor:
        """Already-normalised hidden states [..., hidden] -> float32 logits [..., V] (no final norm here)."""
        return self.lm_head(h).float()

    def forward(
        self,
        input_ids: torch.Tensor,
        cache: HybridCache,
        *,
        mask: str | torch.Tensor = "causal",
        hidden_layers: tuple[int, ...] = (),
        positions: torch.Tensor | None = None,
        positions_in_cache: bool = False,
        only_last: bool = False,
    ) -> ModelOutput:
        """Run T new tokens [B, T] after the cache's `length` tokens, then advance the cache by T
        (the arguments and output of `Transformer.forward`; `mask` must be "causal"; RoPE is
        computed, so `positions_in_cache` changes nothing here)."""
        tree = isinstance(mask, torch.Tensor)
        if not tree and mask != "causal":
            raise ValueError(
                f"a hybrid (Gated DeltaNet) target runs causal masks or trees (an ancestor mask tensor), got "
                f"mask={mask!r}: its linear-attention layers are a left-to-right recurrence along each path"
            )
        if tree and (mask.dim() != 2 or mask.dtype != torch.bool or positions is None):
            raise ValueError(f"a tree forward of a hybrid target takes the ancestor mask [n, n] (bool) and the nodes' "
                             f"positions; got a {mask.dtype} mask of shape {tuple(mask.shape)}, positions {positions is not None}")
        if not isinstance(cache, HybridCache):
            raise TypeError(f"a hybrid target needs its own cache (target.new_cache), got {type(cache).__name__}")
        b, t = input_ids.shape
        bad = [i for i in hidden_layers if not 0 <= i < len(self.model.layers)]
        if bad:
            raise ValueError(f"hidden_layers {bad} out of range for {len(self.model.layers)} layers")
        cache.begin(t)
        if positions is None:
            positions = (torch.arange(t, device=input_ids.device) + cache.length).expand(b, t)
        cos, sin = self.rope(positions)
        vis = Visibility(mask, cache.length, t, input_ids.device, cache.key_slots(t))
        x, picked = self.run_layers(self.embed(input_ids), cache, cos, sin, vis, len(self.model.layers), hidden_layers)
        cache.advance(t)
        hidden = torch.cat([picked[i] for i in hidden_layers], dim=-1) if hidden_layers else None
        if only_last:
            x = x[:, -1:]
        return ModelOutput(logits=self.head(self.final_norm(x)), hidden=hidden)

    def run_layers(self, x: torch.Tensor, cache: HybridCache, cos: torch.Tensor, sin: torch.Tensor, vis: Visibility,
                   upto: int, hidden_layers: tuple[int, ...] = (), first: int = 0
                   ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """Decoder layers first..upto-1 over x [B, T, hidden] (embedded, or layer first-1's output)
        after `cache.begin(T)`: a chain (vis.new "causal") or a tree (an ancestor mask). Returns the
        last layer's output and the outputs of `hidden_layers` it ran. The cache's length does not move."""
        t = x.shape[1]
        tree = isinstance(vis.new, torch.Tensor)
        record = t <= RECORD_LIMIT
        # a verify-sized chain runs as a tree whose nodes each hang from the one before (one WY solve a
        # layer instead of t recurrent steps; no per-position states kept); one token keeps the recurrence
        chain = torch.ones(t, t, dtype=torch.bool, device=x.device).tril() if 2 <= t <= RECORD_LIMIT and not tree else None
        # every linear layer's conv reads the same columns: one table a forward, not one a layer (about
        # 30 small kernels each, which a graph replays one by one); a chain's is node i - m, in closed form
        kernel = self.cfg.linear_conv_kernel_dim
        sources = None
        if tree:
            sources = conv_sources(vis.new, kernel)
        elif chain is not None:
            sources = chain_sources(t, kernel, x.device)
        picked: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(self.model.layers[:upto]):
            if i < first:
                continue
            h = layer.input_layernorm(x)
            slot = self.layer_slot[i]
            if layer.layer_type == "linear_attention":
                if tree:
                    y, pending = layer.linear_attn.forward_tree(h, cache.conv[slot], cache.state[slot], vis.new, sources)
                    cache.update_tree(slot, pending)
                elif chain is not None:
                    y, pending = layer.linear_attn.forward_tree(h, cache.conv[slot], cache.state[slot], chain, sources)
                    cache.update_chain(slot, pending)
                else:
                    y, window, states = layer.linear_attn(h, cache.conv[slot], cache.state[slot], record=record)
                    cache.update_linear(slot, window, states, record)
            else:
                y = layer.self_attn(h, cos, sin, cache.kv, slot, vis)
            x = x + y
            x = x + layer.mlp(layer.post_attention_layernorm(x))
            if i in hidden_layers:
                picked[i] = x
        return x, picked

    def linear_modules(self) -> dict[str, nn.Module]:
        """Every projection by its weight name ("model.layers.0.linear_attn.in_proj_qkvz.weight", ...)."""
        out: dict[str, nn.Module] = {}
        for i, layer in enumerate(self.model.layers):
            if layer.layer_type == "linear_attention":
                for name in DELTANET_PROJ:
                    out[f"model.layers.{i}.linear_attn.{name}.weight"] = getattr(layer.linear_attn, name)
            else:
                for name in ATTENTION_PROJ:
                    out[f"model.layers.{i}.self_attn.{name}.weight"] = getattr(layer.self_attn, name)
            mlp, prefix = layer.mlp, f"model.layers.{i}.mlp"
            if isinstance(mlp, SparseMoE):  # the shared expert's projections; experts stay as loaded
                mlp, prefix = mlp.shared_expert, prefix + ".shared_expert"
            for name in MLP_PROJ:
                out[f"{prefix}.{name}.weight"] = getattr(mlp, name)
        out["lm_head.weight"] = self.lm_head
        return out

    def set_linear(self, weight_name: str, module: nn.Module) -> None:
        """Replace the projection owning `weight_name` by any module with forward(x) (same in/out features)."""
        swap_projection(self, weight_name, module)

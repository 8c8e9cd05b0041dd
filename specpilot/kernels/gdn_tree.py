"""Tree verification of a Gated DeltaNet layer: the gated delta rule over a tree of nodes in WY form.

`gdn_tree(q, k, v, g, beta, state, ancestors)`: q, k [B, H, n, dk] (not yet normalised), v
[B, H, n, dv], g (log decay) and beta [B, H, n], all float32, state S0 [B, H, dk, dv] float32,
ancestors [n, n] bool (inclusive; ancestors precede), or [B, n, n]: a tree a batch row (the
batched engine's requests, each padded to n nodes). Returns (o [B, H, n, dv], k normalised
[B, H, n, dk], w [B, H, n, dv], G [B, H, n]) as `gdn_tree_reference` (= the runtime's
`hybrid_tree.delta_rule_tree`) does:

    G_i = sum of g over i's path;  (I + A) w = beta (v - exp(G) K S0),
    A[i, j] = beta_i exp(G_i - G_j) (k_i . k_j) for j a strict ancestor of i;
    o_i = exp(G_i) q_i S0 + sum_{j anc-or-self} exp(G_i - G_j) (q_i . k_j) w_j.

One program per (batch, value head, block of dv columns): the [n, n] system is built with one
`tl.dot`, inverted by recursive block inversion (log2 n levels of two dots: the system is unit
lower triangular, ancestors precede), w is one dot with that inverse, and the outputs two more.
The state is read, never written, and no per-node state exists: the accepted path's state is committed afterwards
from k, w and G (hybrid_tree.commit_state). Dots run in IEEE fp32 (no TF32): the outputs decide
which tokens a greedy verify accepts. Rows and columns are padded to powers of two >= 16 (tl.dot).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .registry import KernelSpec, register


@triton.jit
def _gdn_tree_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, s_ptr, anc_ptr,
    o_ptr, kn_ptr, w_ptr, cg_ptr,
    n, dk, dv, H, scale, anc_stride,
    N: tl.constexpr, DK: tl.constexpr, BV: tl.constexpr, LOG_N: tl.constexpr,
):
    bh = tl.program_id(0)
    vb = tl.program_id(1)
    rows = tl.arange(0, N)
    cols_n = tl.arange(0, N)
    ck = tl.arange(0, DK)
    cv = vb * BV + tl.arange(0, BV)
    row_ok = rows < n
    k_ok = row_ok[:, None] & (ck[None, :] < dk)
    v_ok = row_ok[:, None] & (cv[None, :] < dv)
    qk_base = bh * n * dk
    v_base = bh * n * dv
    q = tl.load(q_ptr + qk_base + rows[:, None] * dk + ck[None, :], mask=k_ok, other=0.0)
    k = tl.load(k_ptr + qk_base + rows[:, None] * dk + ck[None, :], mask=k_ok, other=0.0)
    q = q * tl.rsqrt(tl.sum(q * q, axis=1) + 1e-6)[:, None]
    q = q / scale
    k = k * tl.rsqrt(tl.sum(k * k, axis=1) + 1e-6)[:, None]
    v = tl.load(v_ptr + v_base + rows[:, None] * dv + cv[None, :], mask=v_ok, other=0.0)
    g = tl.load(g_ptr + bh * n + rows, mask=row_ok, other=0.0)
    beta = tl.load(beta_ptr + bh * n + rows, mask=row_ok, other=0.0)
    anc = tl.load(anc_ptr + (bh // H) * anc_stride + rows[:, None] * n + cols_n[None, :],
                  mask=row_ok[:, None] & (cols_n[None, :] < n), other=0) != 0
    g_cols = tl.sum(tl.where(rows[:, None] == cols_n[None, :], g[:, None], 0.0), axis=0)  # g as a row vector
    cum = tl.sum(tl.where(anc, g_cols[None, :], 0.0), axis=1)  # G_i
    cum_cols = tl.sum(tl.where(rows[:, None] == cols_n[None, :], cum[:, None], 0.0), axis=0)
    diff = cum[:, None] - cum_cols[None, :]
    strict = anc & (rows[:, None] != cols_n[None, :])
    decay_strict = tl.where(strict, tl.exp(tl.where(strict, diff, 0.0)), 0.0)
    decay_incl = tl.where(anc, tl.exp(tl.where(anc, diff, 0.0)), 0.0)
    s0 = tl.load(s_ptr + bh * dk * dv + ck[:, None] * dv + cv[None, :],
                 mask=(ck[:, None] < dk) & (cv[None, :] < dv), other=0.0)
    kt = tl.trans(k)
    system = beta[:, None] * tl.dot(k, kt, input_precision="ieee") * decay_strict
    rhs = beta[:, None] * (v - tl.exp(cum)[:, None] * tl.dot(k, s0, input_precision="ieee"))
    # (I + A)^-1 by recursive block inversion, bottom up: with T the inverses of the diagonal blocks of
    # size b, those of size 2b are [[T1, 0], [-T2 A21 T1, T2]] = T - T A_off T, A_off the A21 blocks.
    # log2(N) levels of two dots, no loop over nodes; as accurate as a substitution (each T is an exact
    # sub-inverse), unlike a Neumann product whose powers of A cancel catastrophically for close keys.
    inv = tl.where(rows[:, None] == cols_n[None, :], 1.0, 0.0)
    for level in tl.static_range(LOG_N):
        half = 1 << level
        off = ((rows[:, None] // (2 * half)) == (cols_n[None, :] // (2 * half))) & (
            (rows[:, None] // half) != (cols_n[None, :] // half))
        step = tl.dot(inv, tl.where(off, system, 0.0), input_precision="ieee")
        inv = inv - tl.dot(step, inv, input_precision="ieee")
    w = tl.dot(inv, rhs, input_precision="ieee")
    attn = tl.dot(q, kt, input_precision="ieee") * decay_incl
    o = tl.exp(cum)[:, None] * tl.dot(q, s0, input_precision="ieee") + tl.dot(attn, w, input_precision="ieee")
    tl.store(o_ptr + v_base + rows[:, None] * dv + cv[None, :], o, mask=v_ok)
    tl.store(w_ptr + v_base + rows[:, None] * dv + cv[None, :], w, mask=v_ok)
    if vb == 0:
        tl.store(kn_ptr + qk_base + rows[:, None] * dk + ck[None, :], k, mask=k_ok)
        tl.store(cg_ptr + bh * n + rows, cum, mask=row_ok)


def gdn_tree(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
             state: torch.Tensor, ancestors: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(o, k normalised, w, G); see the module docstring."""
    b, h, n, dk = q.shape
    dv = v.shape[-1]
    if ancestors.shape not in ((n, n), (b, n, n)) or state.shape != (b, h, dk, dv):
        raise ValueError(f"gdn_tree: ancestors must be [{n}, {n}] or [{b}, {n}, {n}] and state [{b}, {h}, {dk}, {dv}], "
                         f"got {list(ancestors.shape)} and {list(state.shape)}")
    q, k, v, g, beta, state = (x.float().contiguous() for x in (q, k, v, g, beta, state))
    anc = ancestors.to(torch.int8).contiguous()
    o, w = torch.empty_like(v), torch.empty_like(v)
    kn, cum = torch.empty_like(k), torch.empty_like(g)
    big = max(16, triton.next_power_of_2(n))
    block_v = min(32, max(16, triton.next_power_of_2(dv)))
    grid = (b * h, triton.cdiv(dv, block_v))
    stride = n * n if anc.dim() == 3 else 0  # a tree a batch row, or one shared
    _gdn_tree_kernel[grid](q, k, v, g, beta, state, anc, o, kn, w, cum, n, dk, dv, h, dk**0.5, stride,
                           N=big, DK=max(16, triton.next_power_of_2(dk)), BV=block_v, LOG_N=big.bit_length() - 1)
    return o, kn, w, cum


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def gdn_tree_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                       state: torch.Tensor, ancestors: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The same in torch: a triangular solve for w (the runtime's hybrid_tree.delta_rule_tree)."""
    q = _l2norm(q.float()) / (q.shape[-1] ** 0.5)
    k = _l2norm(k.float())
    v, g, beta, state = v.float(), g.float(), beta.float(), state.float()
    anc = ancestors.to(q.device, torch.bool)
    if anc.dim() == 2:
        cum = g @ anc.to(g.dtype).transpose(0, 1)
    else:
        anc = anc[:, None]  # [B, 1, n, n]
        cum = (g[..., None, :] @ anc.to(g.dtype).transpose(-1, -2))[..., 0, :]
    strict = anc & ~torch.eye(anc.shape[-1], dtype=torch.bool, device=anc.device)
    diff = cum[..., :, None] - cum[..., None, :]
    system = beta[..., None] * (k @ k.transpose(-1, -2)) * diff.masked_fill(~strict, float("-inf")).exp()
    rhs = beta[..., None] * (v - cum.exp()[..., None] * (k @ state))
    eye = torch.eye(anc.shape[-1], dtype=q.dtype, device=q.device)
    w = torch.linalg.solve_triangular(system + eye, rhs, upper=False, unitriangular=True)
    attn = (q @ k.transpose(-1, -2)) * diff.masked_fill(~anc, float("-inf")).exp()
    o = cum.exp()[..., None] * (q @ state) + attn @ w
    return o, k, w, cum


# --- registry entry -------------------------------------------------------------------------


def _make_inputs(case, device, seed):
    g = torch.Generator().manual_seed(seed)
    b, h, n, dk, dv = case["B"], case["H"], case["n"], case["dk"], case["dv"]
    parent = [-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, n)]
    if case.get("chain"):  # every node the previous one's child: the deepest system
        parent = list(range(-1, n - 1))
    if case.get("padding"):  # the last two nodes hang from nothing, as a padded tree's
        parent[-2:] = [-1, -1]
    anc = torch.eye(n, dtype=torch.bool)
    for i in range(1, n):
        if parent[i] >= 0:
            anc[i] |= anc[parent[i]]
    if case.get("per_row"):  # a tree a batch row: row r keeps the first n - r nodes' links, the rest hang alone
        anc = torch.stack([anc & (torch.arange(n) < n - r)[:, None] | torch.eye(n, dtype=torch.bool)
                           for r in range(b)])
    q, k, v = (torch.randn(b, h, n, d, generator=g) for d in (dk, dk, dv))
    decay, beta = -torch.rand(b, h, n, generator=g) * 3, torch.rand(b, h, n, generator=g)
    if case.get("close_keys"):  # keys near one direction, little decay, beta near 1: the system's
        # powers grow by orders of magnitude along a chain, where an inverse by a product of powers fails
        k = k[:, :, :1] + 0.05 * k
        decay, beta = decay * 0.003, 0.9 + 0.1 * beta
    args = (q, k, v, decay, beta, torch.randn(b, h, dk, dv, generator=g), anc)
    return tuple(x.to(device) for x in args)


def _flat(outs) -> torch.Tensor:
    return torch.cat([x.reshape(-1) for x in outs])


def _run(*inputs):
    return _flat(gdn_tree(*inputs))


def _reference(*inputs):
    return _flat(gdn_tree_reference(*inputs))


def _plant(inputs):
    *rest, anc = inputs
    anc = anc.clone()
    last = anc.shape[-1] - 1
    anc[..., last, 0] = ~anc[..., last, 0]  # one ancestor link of the last node flips
    return (*rest, anc)


register(KernelSpec(
    name="gdn_tree",
    run=_run,
    reference=_reference,
    make_inputs=_make_inputs,
    cases=[
        dict(B=1, H=2, n=5, dk=16, dv=16),
        dict(B=2, H=3, n=17, dk=12, dv=20),
        dict(B=1, H=1, n=33, dk=33, dv=40, padding=True),
        dict(B=1, H=2, n=1, dk=8, dv=5),
        dict(B=3, H=2, n=9, dk=12, dv=20, per_row=True),
        dict(B=1, H=2, n=33, dk=24, dv=36, chain=True, close_keys=True),
        dict(B=1, H=1, n=64, dk=16, dv=16, chain=True, close_keys=True),
    ],
    tolerance={torch.float32: (5e-5, 1e-4)},
    corrupt=_plant,
    description="gated delta rule over a tree (WY form, ancestor mask, block-recursive inverse), "
                "one program per head and dv block",
))

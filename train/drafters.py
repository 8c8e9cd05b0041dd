"""Training-time forwards of the two drafter kinds: many drafting steps of a sequence in one pass.

At inference a drafter drafts one block per step (specpilot/runtime/dflash.py, decode.py). To
train, every step of a sequence is laid out at once with an attention mask that gives each query
exactly what it would see at inference; tests/test_zoo.py checks the logits equal the runtime's.

DFlash (`dflash_block_logits`): for anchors a_1..a_N of a token sequence x, block n is
[x_{a_n}, mask x (S-1)] at positions a_n .. a_n+S-1; it sees the projected target hidden states of
positions [0, a_n) and its own block (non-causal), and predicts x_{a_n+1} .. x_{a_n+S-1}.

PARD (`pard_layout`): the sequence x is followed by k-1 streams of mask tokens. Mask stream j at
position p stands for the j-th mask after the real prefix x_0..x_{p-j}: it sees those real tokens
and masks 1..j of that same prefix, as [x_0..x_t, mask x (k-1)] shows them at inference
(t = p - j), and predicts x_{p+1}; the real stream is the plain causal LM (draft 1).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specpilot.runtime.dflash import DFlashDrafter
from specpilot.runtime.model import rope_cos_sin, rope_inv_freq


# --- DFlash ---------------------------------------------------------------------------------


def dflash_block_mask(anchors: torch.Tensor, context_len: int, block_size: int) -> torch.Tensor:
    """Bool [B, 1, N*S, L + N*S]: block n's tokens see context positions < a_n and all of block n."""
    b, n = anchors.shape
    device = anchors.device
    query_anchor = anchors.repeat_interleave(block_size, dim=1)  # [B, N*S]
    sees_context = torch.arange(context_len, device=device)[None, None, :] < query_anchor[:, :, None]
    block_of = torch.arange(n, device=device).repeat_interleave(block_size)
    sees_block = (block_of[:, None] == block_of[None, :]).expand(b, -1, -1)
    return torch.cat([sees_context, sees_block], dim=-1)[:, None]


def dflash_block_inputs(tokens: torch.Tensor, anchors: torch.Tensor, block_size: int, mask_token_id: int) -> torch.Tensor:
    """Block ids [B, N, S] = [x_a, mask x (S-1)] for each anchor a."""
    ids = torch.full((*anchors.shape, block_size), mask_token_id, dtype=tokens.dtype, device=tokens.device)
    ids[:, :, 0] = tokens.gather(1, anchors)
    return ids


def dflash_block_labels(tokens: torch.Tensor, anchors: torch.Tensor, block_size: int) -> torch.Tensor:
    """[B, N, S-1]: x_{a+1} .. x_{a+S-1} (every anchor needs a + S - 1 < len(x))."""
    offsets = torch.arange(1, block_size, device=tokens.device)
    index = (anchors[:, :, None] + offsets).flatten(1)
    return tokens.gather(1, index).view(*anchors.shape, block_size - 1)


def dflash_loss_weights(block_size: int, gamma: float, device: torch.device | str) -> torch.Tensor:
    """[S-1] weights exp(-(k-1)/gamma) for draft k: an early draft's error costs every later one
    (the DFlash paper's decay; gamma 7 for block 16)."""
    return torch.exp(-torch.arange(block_size - 1, device=device, dtype=torch.float32) / gamma)


def _attend_gqa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """SDPA with K/V heads repeated (not enable_gqa), so a masked call can use the fused kernels."""
    device = q.device.type
    if torch.is_autocast_enabled(device):  # q, k (qk-norm, RoPE in float32) and v in one dtype
        dtype = torch.get_autocast_dtype(device)
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    rep = q.shape[1] // k.shape[1]
    if rep > 1:
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=q.shape[-1] ** -0.5)


def dflash_block_logits(
    drafter: DFlashDrafter, context_hidden: torch.Tensor, tokens: torch.Tensor, anchors: torch.Tensor
) -> torch.Tensor:
    """Logits [B, N, S-1, V] of N blocks per sequence in one pass.

    context_hidden [B, L, len(target_layer_ids) * H] are the target's hidden states of x at the
    drafter's target layers (as the runtime collects them); tokens [B, L] is x; anchors [B, N]
    (each in [0, L - S + 1)). Equals DFlashDrafter.forward(block, context_hidden[:, :a], fresh cache)
    for each anchor a.
    """
    cfg = drafter.cfg
    s = cfg.block_size
    b, length, _ = context_hidden.shape
    n = anchors.shape[1]
    device, dtype = context_hidden.device, drafter.dtype
    inv_freq = rope_inv_freq(cfg.model, device)
    cos_c, sin_c = rope_cos_sin(inv_freq, torch.arange(length, device=device).expand(b, length), dtype)
    block_pos = (anchors[:, :, None] + torch.arange(s, device=device)).flatten(1)
    cos_b, sin_b = rope_cos_sin(inv_freq, block_pos, dtype)
    mask = dflash_block_mask(anchors, length, s)

    ctx = drafter.encoder(context_hidden.to(dtype))
    x = drafter.embed(dflash_block_inputs(tokens, anchors, s, cfg.mask_token_id).flatten(1)).to(dtype)
    for layer in drafter.layers:
        attn = layer.self_attn
        k_ctx, v_ctx = attn.keys_values(ctx, cos_c, sin_c)
        h = layer.input_layernorm(x)
        k_blk, v_blk = attn.keys_values(h, cos_b, sin_b)
        q = attn.queries(h, cos_b, sin_b)
        k = torch.cat([k_ctx.to(q.dtype), k_blk.to(q.dtype)], dim=2)
        v = torch.cat([v_ctx.to(q.dtype), v_blk.to(q.dtype)], dim=2)
        x = x + attn.output(_attend_gqa(q, k, v, mask))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    x = x.view(b, n, s, -1)[:, :, 1:]
    return drafter.head(drafter.norm(x))


def accepted_prefix(correct: torch.Tensor) -> torch.Tensor:
    """Number of leading True along the last dim: the drafts greedy verification would accept."""
    return correct.long().cumprod(dim=-1).sum(dim=-1)


# --- PARD -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class PardLayout:
    """One sequence of `length` tokens followed by k-1 mask streams, and what to train on.

    Tokens x_start.. are the target's greedy chain (x_0..x_{start-1} the prompt), so a draft is a
    label only where the whole chain it belongs to is greedy: t = p - j >= start - 1.
    """

    length: int
    k: int
    start: int
    source: torch.Tensor  # [T] index into x for the real stream, -1 for mask tokens
    positions: torch.Tensor  # [T] RoPE position of each layout token
    mask: torch.Tensor  # [T, T] bool, True where the query (row) sees the key (column)
    queries: torch.Tensor  # [Q] layout indices whose outputs are trained
    labels: torch.Tensor  # [Q] index into x of each query's label
    depth: torch.Tensor  # [Q] 0: the real stream (draft 1); j: mask stream j (draft j+1)
    chains: torch.Tensor  # [C, k] query indices (into `queries`) of the k drafts of each step t

    def inputs(self, tokens: torch.Tensor, mask_token_id: int) -> torch.Tensor:
        """Layout ids [B, T] for sequences tokens [B, length]."""
        real = tokens[:, self.source.clamp(min=0)]
        return torch.where(self.source >= 0, real, torch.full_like(real, mask_token_id))


def pard_layout(length: int, k: int, start: int, device: torch.device | str = "cpu") -> PardLayout:
    """Mask streams cover positions [start, length-1) (only there can a mask have a greedy label)."""
    if not 1 <= start < length - 1 or k < 1:
        raise ValueError(f"need 1 <= start < length - 1 and k >= 1, got length={length}, start={start}, k={k}")
    span = torch.arange(start, length - 1)
    stream = torch.cat([torch.zeros(length, dtype=torch.long)] + [torch.full_like(span, j) for j in range(1, k)])
    pos = torch.cat([torch.arange(length)] + [span] * (k - 1))
    hangs = pos - stream  # the last real position each token's drafting step sees (t)
    is_mask = stream >= 1
    sees_real = ~is_mask[None, :] & (pos[None, :] <= hangs[:, None])
    sees_mask = (
        is_mask[:, None] & is_mask[None, :] & (stream[None, :] <= stream[:, None]) & (hangs[None, :] == hangs[:, None])
    )
    label = pos + 1
    trained = (hangs >= start - 1) & (label <= length - 1)
    queries = trained.nonzero().squeeze(1)
    # chains: steps t whose k drafts (t+1..t+k) all lie in x; draft j+1 sits at (stream j, t + j)
    slot = {(int(stream[q]), int(hangs[q])): i for i, q in enumerate(queries.tolist())}
    steps = range(start - 1, length - k)
    chains = torch.tensor([[slot[(j, t)] for j in range(k)] for t in steps], dtype=torch.long).view(-1, k)
    return PardLayout(
        length=length,
        k=k,
        start=start,
        source=torch.where(is_mask, -1, pos).to(device),
        positions=pos.to(device),
        mask=(sees_real | sees_mask).to(device),
        queries=queries.to(device),
        labels=label[queries].to(device),
        depth=stream[queries].to(device),
        chains=chains.to(device),
    )

"""From the fused q|k|v projection to the attention output, in one launch: rope_qkv + attention_split_kv.

`rope_attention(qkv, cos, sin, k_cache, v_cache, past=..., num_heads=H, num_kv_heads=Hkv)`:
qkv [B, T, (H + 2·Hkv)·D] as rope_qkv takes it (q heads, then k heads, then v heads); cos, sin
the [B or 1, 1, T, D] tables of model.rope(positions). It returns what rope_qkv followed by
attention_split_kv over the cache returns, [B, H, T, D], and leaves the cache as rope_qkv leaves
it: roped k and raw v of the T new tokens at slots past..past+T-1 (a chain's and a tree's slots;
a tree's depths are in cos/sin).

At batch 1 both are latency-bound kernels of a few microseconds each, 32 of each in a
Llama-3.1-8B step. Here the split-KV kernel (kernels/attention_split_kv.py) does RoPE itself:
every program ropes its query rows on load (and qk-norms them, qwen3), and the program of the new
tokens, the one that reads them anyway, ropes their keys from qkv and, in the first row block of
each kv head, writes k and v into the cache; the programs of the cached slots read slots below
`past` only, so no program waits on another's write. The math is rope_qkv's op for op
(kernels/rope_kv.py's `head_norm` and `rope_halves`): the cache gets the same bits, and the
output is attention_split_kv's on those values, bit for bit on the same splits (qk-norm's Σx²
is reduced in another order: within a step of the dtype there). No fp fusion: a bf16 FMA would
skip the rounding of a RoPE product (the H200 wrote roped keys one step off rope_qkv's with it).

Measured on the H200 (bench/results/attention_variants_h200.json, 32 layers' calls in one CUDA
graph, the rule's splits over a 4160-slot cache): an AR layer over 512 cached tokens 8.2 µs
against 10.5 with rope_qkv apart, verify(16) 11.3 against 13.6; the Llama-3.1-8B AR step 4.10 ms
against 4.22 (step_times_h200_llama.json).

`past`: an int (the caches hold S >= past + T slots) or an int32/int64 device tensor [], [1] or
[B] (CUDA graphs; past + T <= S is the caller's to keep). `mask`, `scale`, `splits` as
attention_split_kv takes them.
"""

from __future__ import annotations

import torch

from .attention_split_kv import attention_split_kv_reference, check_past, launch_split_kv
from .overlap import Launch
from .registry import KernelSpec, register
from .rope_kv import check_rope_args, rope_qkv_reference, rope_table, rope_table_reference

_WHO = "rope_attention"


def rope_attention(
    qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, *,
    past: int | torch.Tensor, num_heads: int, num_kv_heads: int, mask: str | torch.Tensor = "causal",
    q_norm_weight: torch.Tensor | None = None, k_norm_weight: torch.Tensor | None = None, eps: float = 1e-6,
    scale: float | None = None, splits: int | None = None, launch: Launch | None = None,
) -> torch.Tensor:
    """Attention output [B, H, T, D] of the T tokens of qkv; their K/V written into the caches
    (module docstring). `launch`: PDL (kernels/overlap.py)."""
    if num_heads < 1:
        raise ValueError(f"{_WHO}: num_heads must be >= 1, got {num_heads}")
    b, t, d = check_rope_args(qkv, cos, sin, k_cache, v_cache, None, num_heads, num_kv_heads, q_norm_weight,
                          k_norm_weight, who=_WHO)
    if num_heads % num_kv_heads:
        raise ValueError(f"{_WHO}: num_heads={num_heads} must be a multiple of num_kv_heads={num_kv_heads}")
    if k_cache.shape != v_cache.shape or k_cache.device != qkv.device or v_cache.device != qkv.device:
        raise ValueError(f"{_WHO}: k_cache {list(k_cache.shape)} on {k_cache.device} and v_cache "
                         f"{list(v_cache.shape)} on {v_cache.device} must match, on qkv's {qkv.device}")
    check_past(past, b, k_cache.shape[2], t, qkv.device, exact=False, who=_WHO)
    cos, sin = rope_table(cos, "cos", b, t, d, _WHO), rope_table(sin, "sin", b, t, d, _WHO)
    if cos.shape != sin.shape:
        raise ValueError(f"{_WHO}: cos {list(cos.shape)} and sin {list(sin.shape)} differ")
    if cos.stride() != sin.stride():  # the kernel indexes both with cos's strides
        cos, sin = cos.contiguous(), sin.contiguous()
    if qkv.stride(-1) != 1:
        qkv = qkv.contiguous()
    rope = dict(cos=cos, sin=sin, q_norm=q_norm_weight, k_norm=k_norm_weight, eps=eps)
    return launch_split_kv(qkv, (qkv.stride(0), d, qkv.stride(1)), k_cache, v_cache, heads=num_heads, t=t,
                           past=past, mask=mask, scale=scale, splits=splits, rope=rope, launch=launch)


def rope_attention_reference(
    qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, *,
    past: int | torch.Tensor, num_heads: int, num_kv_heads: int, mask: str | torch.Tensor = "causal",
    q_norm_weight: torch.Tensor | None = None, k_norm_weight: torch.Tensor | None = None, eps: float = 1e-6,
    scale: float | None = None, splits: int | None = None, launch: Launch | None = None,
) -> torch.Tensor:
    """rope_qkv_reference at slots past + t, then attention_split_kv_reference over the cache
    (`splits` and `launch` are the kernel's arguments, unused here)."""
    b, t = qkv.shape[:2]
    base = past.reshape(-1, 1).expand(b, 1) if isinstance(past, torch.Tensor) else torch.full((b, 1), past)
    slots = base.to(qkv.device) + torch.arange(t, device=qkv.device)
    q = rope_qkv_reference(qkv, cos, sin, k_cache, v_cache, slots, num_heads=num_heads, num_kv_heads=num_kv_heads,
                           q_norm_weight=q_norm_weight, k_norm_weight=k_norm_weight, eps=eps)
    if isinstance(past, torch.Tensor):
        return attention_split_kv_reference(q, k_cache, v_cache, past=past, mask=mask, scale=scale)
    end = past + t
    return attention_split_kv_reference(q, k_cache[:, :, :end], v_cache[:, :, :end], past=past, mask=mask, scale=scale)


# --- registry entry -------------------------------------------------------------------------

def _make_inputs(case, device, seed):
    """qkv ~ N(0, 1); caches N(0, 1) up to past + T, NaN beyond (never to be read, except the new
    tokens' slots, which the kernel writes); positions around 1000 + past (chain) or past + depth
    (tree); past an int, or a device tensor of kind `past` as attention_split_kv's cases."""
    g = torch.Generator().manual_seed(seed)
    b, t, hkv, d, s, cap, dtype = case["B"], case["T"], case["Hkv"], case["D"], case["S"], case["cap"], case["dtype"]
    h = hkv * case["group"]
    qkv = torch.randn(b, t, (h + 2 * hkv) * d, generator=g)
    pasts = [max(0, s - t - 7 * i) for i in range(b)] if case["past"] == "batch" else [s - t] * b
    k_cache, v_cache = (torch.randn(b, hkv, cap, d, generator=g) for _ in range(2))
    for i, p in enumerate(pasts):
        k_cache[i, :, p + t:] = v_cache[i, :, p + t:] = float("nan")
    mask, depth = case["mask"], torch.arange(t).expand(b, t)
    if mask == "tree":
        mask = torch.eye(t, dtype=torch.bool).repeat(b, 1, 1)
        depth = torch.zeros(b, t, dtype=torch.int64)
        for row in range(b):
            for u in range(1, t):
                parent = int(torch.randint(0, u, (1,), generator=g))
                mask[row, u] |= mask[row, parent]
                depth[row, u] = depth[row, parent] + 1
        mask = mask.to(device)
    cos, sin = rope_table_reference(1000 + torch.tensor(pasts)[:, None] + depth, d, dtype)
    norm = [(1 + 0.2 * torch.randn(d, generator=g)).to(dtype).to(device) for _ in range(2)] if case["qk_norm"] else [None, None]
    kind = case["past"]
    past = pasts[0] if kind == "int" else torch.tensor(pasts[0] if kind == "scalar" else pasts, dtype=torch.int32).to(device)
    return (qkv.to(dtype).to(device), cos.to(device), sin.to(device), k_cache.to(dtype).to(device),
            v_cache.to(dtype).to(device), past, h, hkv, mask, *norm, case["splits"])


def _flat(fn, inputs):
    """The output and both caches (written on copies; NaN as a number), flattened into one tensor."""
    qkv, cos, sin, k_cache, v_cache, past, h, hkv, mask, qw, kw, splits = inputs
    k_cache, v_cache = k_cache.clone(), v_cache.clone()
    o = fn(qkv, cos, sin, k_cache, v_cache, past=past, num_heads=h, num_kv_heads=hkv, mask=mask, q_norm_weight=qw,
           k_norm_weight=kw, eps=1e-6, splits=splits)
    return torch.cat([o.flatten(), k_cache.flatten(), v_cache.flatten()]).nan_to_num(nan=1234.0)


def _run(*inputs):
    return _flat(rope_attention, inputs)


def _reference(*inputs):
    return _flat(rope_attention_reference, inputs)


def _plant(inputs):
    """The sign of the largest cos entry of the first row's last new token flipped: that token's
    roped k (written, and seen by the others) and its query change."""
    qkv, cos, *rest = inputs
    cos = cos.clone()
    last = cos.view(cos.shape[0], -1, cos.shape[-1])[0, -1]
    last[last.abs().argmax()] *= -1
    return qkv, cos, *rest


def _case(b, hkv, group, t, s, d, mask, dtype, qk_norm=0, splits=None, cap=None, past="int"):
    """S = past + T keys in use of a cache of `cap` slots (default S); past an int or a device
    tensor ("scalar" int32 [], "batch" int32 [B], row i's past 7·i less)."""
    return {"B": b, "Hkv": hkv, "group": group, "T": t, "S": s, "D": d, "mask": mask, "dtype": dtype,
            "qk_norm": qk_norm, "splits": splits, "cap": cap or s, "past": past}


F32, BF16 = torch.float32, torch.bfloat16

register(KernelSpec(
    name="rope_attention",
    run=_run,
    reference=_reference,
    make_inputs=_make_inputs,
    cases=[
        _case(1, 2, 4, 1, 300, 128, "causal", BF16),  # a decode step: the rule's splits
        _case(1, 1, 2, 3, 40, 64, "causal", F32, qk_norm=1, cap=50),  # qk-norm; slots past S unused
        _case(2, 2, 2, 5, 100, 32, "tree", BF16, splits=3, cap=140, past="batch"),
        _case(1, 1, 4, 16, 16, 64, "full", BF16, qk_norm=1),  # nothing cached: one program a row block
        _case(1, 2, 1, 70, 200, 16, "causal", F32, splits=2, cap=260, past="scalar"),  # 2 tiles of new tokens
        _case(1, 1, 3, 7, 90, 18, "tree", BF16),  # D/2 = 9: ragged halves; 21 rows
    ],
    # attention_split_kv's tolerances (the output); the caches are rope_qkv's bits, or one step of
    # the dtype with qk-norm (rope_qkv's tolerance covers both)
    tolerance={F32: (1e-5, 1e-5), BF16: (2 ** -5, 2 ** -6)},
    corrupt=_plant,
    description="rope_qkv and attention_split_kv in one launch: roped q, new K/V roped and written, attention",
))

"""From the fused q|k|v projection to roped q and a written KV cache, in one launch.

`rope_qkv(qkv, cos, sin, k_cache, v_cache, slots, num_heads=H, num_kv_heads=Hkv)`:
qkv [B, T, (H + 2·Hkv)·D] holds q heads, then k heads, then v heads. Per token and head it
applies the optional per-head RMSNorm of q and k (qwen3's q_norm / k_norm: weight [D], eps), then
RoPE (rotate-half: x·cos + rotate_half(x)·sin), writes roped k and raw v into k_cache / v_cache
[B, Hkv, S, D] (one layer) at slot `slots[b, t]`, and returns roped q as [B, H, T, D] contiguous.
With num_heads=0, qkv is [k|v] only ([B, T, 2·Hkv·D]: a DFlash drafter's context K/V, which have
no queries): k is normed (k_norm_weight, if given) and roped, both are written, and q is empty.

cos, sin are the [B, 1, T, D] (or [B, T, D]; batch 1 broadcasts) tables of model.rope(positions),
which the runtime computes once a forward for all layers: taking them rather than positions keeps
the kernel bit-exact with rope_cos_sin (fp32 cos/sin of the hardware and torch differ in the last
ulp, which a bf16 cast can turn into a step) and saves the trig in every layer.
Slots: a chain writes at past + t, a tree at past + node index (positions past + depth are in cos/sin).

Numerics: model.Attention.queries / keys_values op for op, rounding to the dtype where torch does
(norm cast, weight product, each rope product, the sum; no fma on the GPU: fp fusion is off).
Without qk-norm the output is bit-exact in every dtype. With it, the norm's sum of squares (a tree
reduction) and rsqrt (the hardware's) can move the normalised value one step of the dtype where it
sits on a rounding boundary, and that step carries through the rope products (not bit-exact there).

Launch: grid (B·T, H + Hkv), one program per token and q or k head (a k program also copies its v
head); BLOCK = next power of two >= D/2, 1 warp. Untuned: no GPU measurement yet.
CUDA graphs: slots are read on the device, no host sync; the grid depends on shapes only. The
caller keeps slots < S (not checked: that would sync).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .overlap import Launch, overlap_enter, pdl_args, prefetch_args
from .registry import KernelSpec, register
from .rounding import to_dtype
from .target import native as on_native


@triton.jit
def head_norm(x1, x2, w1, w2, inv, dt: tl.constexpr, ROUND_BF16: tl.constexpr):
    """qk-norm of a head's fp32 halves: dt(w · dt(x · inv)), inv = rsqrt(mean(x²) + eps) of its head."""
    return (to_dtype(w1 * to_dtype(x1 * inv, dt, ROUND_BF16), dt, ROUND_BF16),
            to_dtype(w2 * to_dtype(x2 * inv, dt, ROUND_BF16), dt, ROUND_BF16))


@triton.jit
def rope_halves(x1, x2, c1, c2, s1, s2, dt: tl.constexpr, ROUND_BF16: tl.constexpr):
    """Rotate-half RoPE of fp32 halves (any one shape): x·cos + rotate_half(x)·sin, each product
    and the sum rounded to dt as torch rounds them. Shared with kernels/attention_split_kv.py."""
    return (to_dtype(to_dtype(x1 * c1, dt, ROUND_BF16) - to_dtype(x2 * s1, dt, ROUND_BF16), dt, ROUND_BF16),
            to_dtype(to_dtype(x2 * c2, dt, ROUND_BF16) + to_dtype(x1 * s2, dt, ROUND_BF16), dt, ROUND_BF16))


@triton.jit
def _rope_qkv_kernel(
    qkv_ptr, cos_ptr, sin_ptr, qw_ptr, kw_ptr, slots_ptr, q_ptr, kc_ptr, vc_ptr,
    T, H, HKV, eps, inv_d, pf_addr0, pf_bytes0, pf_addr1, pf_bytes1,
    s_qkv_b, s_qkv_t, s_cs_b, s_cs_t, s_sl_b, s_sl_t,
    s_q_b, s_q_h, s_q_t, s_kc_b, s_kc_h, s_kc_s, s_vc_b, s_vc_h, s_vc_s,
    HALF: tl.constexpr, BLOCK: tl.constexpr, QK_NORM: tl.constexpr,
    ROUND_BF16: tl.constexpr,  # bf16 under the interpreter: round before casting
    PDL: tl.constexpr,  # programmatic dependent launch (kernels/overlap.py)
    PREFETCH: tl.constexpr,  # 0-2 ranges of the next GEMV's weight into L2 (kernels/overlap.py)
):
    bt = tl.program_id(0)
    head = tl.program_id(1)  # q heads 0..H-1, then k heads
    overlap_enter(PDL, PREFETCH, pf_addr0, pf_bytes0, pf_addr1, pf_bytes1, bt * tl.num_programs(1) + head,
                  tl.num_programs(0) * tl.num_programs(1), 32)
    b = (bt // T).to(tl.int64)
    t = bt % T
    dt = qkv_ptr.dtype.element_ty
    offs = tl.arange(0, BLOCK)
    ok = offs < HALF
    row = qkv_ptr + b * s_qkv_b + t * s_qkv_t + head * (2 * HALF)
    x1 = tl.load(row + offs, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(row + HALF + offs, mask=ok, other=0.0).to(tl.float32)
    if QK_NORM:
        inv = tl.math.rsqrt((tl.sum(x1 * x1, 0) + tl.sum(x2 * x2, 0)) * inv_d + eps)
        if head < H:
            w1 = tl.load(qw_ptr + offs, mask=ok, other=0.0).to(tl.float32)
            w2 = tl.load(qw_ptr + HALF + offs, mask=ok, other=0.0).to(tl.float32)
        else:
            w1 = tl.load(kw_ptr + offs, mask=ok, other=0.0).to(tl.float32)
            w2 = tl.load(kw_ptr + HALF + offs, mask=ok, other=0.0).to(tl.float32)
        x1, x2 = head_norm(x1, x2, w1, w2, inv, dt, ROUND_BF16)
    cs = b * s_cs_b + t * s_cs_t
    c1 = tl.load(cos_ptr + cs + offs, mask=ok, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + cs + HALF + offs, mask=ok, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + cs + offs, mask=ok, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + cs + HALF + offs, mask=ok, other=0.0).to(tl.float32)
    o1, o2 = rope_halves(x1, x2, c1, c2, s1, s2, dt, ROUND_BF16)
    if head < H:
        out = q_ptr + b * s_q_b + head * s_q_h + t * s_q_t
        tl.store(out + offs, o1.to(dt), mask=ok)
        tl.store(out + HALF + offs, o2.to(dt), mask=ok)
    else:
        kvh = head - H
        slot = tl.load(slots_ptr + b * s_sl_b + t * s_sl_t).to(tl.int64)
        kout = kc_ptr + b * s_kc_b + kvh * s_kc_h + slot * s_kc_s
        tl.store(kout + offs, o1.to(dt), mask=ok)
        tl.store(kout + HALF + offs, o2.to(dt), mask=ok)
        vrow = row + HKV * (2 * HALF)  # v head kvh sits Hkv heads after k head kvh
        vout = vc_ptr + b * s_vc_b + kvh * s_vc_h + slot * s_vc_s
        tl.store(vout + offs, tl.load(vrow + offs, mask=ok), mask=ok)
        tl.store(vout + HALF + offs, tl.load(vrow + HALF + offs, mask=ok), mask=ok)


def rope_table(x: torch.Tensor, name: str, b: int, t: int, d: int, who: str = "rope_qkv") -> torch.Tensor:
    """cos or sin as [B or 1, T, D] with unit last stride."""
    if x.dim() == 4 and x.shape[1] == 1:
        x = x[:, 0]
    if x.dim() != 3 or x.shape[0] not in (1, b) or x.shape[1:] != (t, d):
        raise ValueError(f"{who}: {name} must be [B, 1, T, D] or [B, T, D] (B may be 1) with B={b}, T={t}, "
                         f"D={d}, got {list(x.shape)}")
    return x if x.stride(-1) == 1 else x.contiguous()


def check_rope_args(qkv, cos, sin, k_cache, v_cache, slots, num_heads, num_kv_heads, q_norm_weight, k_norm_weight,
           who="rope_qkv"):
    """(B, T, D) of valid arguments (slots None: the caller places the new K/V), else ValueError."""
    if qkv.dim() != 3 or num_kv_heads < 1 or num_heads < 0 or qkv.shape[-1] % (num_heads + 2 * num_kv_heads):
        raise ValueError(f"{who}: qkv must be [B, T, (H + 2·Hkv)·D] with H={num_heads} >= 0, Hkv={num_kv_heads} "
                         f">= 1, got {list(qkv.shape)}")
    b, t, width = qkv.shape
    d = width // (num_heads + 2 * num_kv_heads)
    if d % 2:
        raise ValueError(f"{who}: head_dim must be even for rotate-half RoPE, got {d}")
    if qkv.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"{who}: qkv must be float32/bfloat16/float16, got {qkv.dtype}")
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        if c.dim() != 4 or c.shape[0] != b or c.shape[1] != num_kv_heads or c.shape[3] != d or c.dtype != qkv.dtype:
            raise ValueError(f"{who}: {name} must be [{b}, {num_kv_heads}, S, {d}] {qkv.dtype}, got "
                             f"{list(c.shape)} {c.dtype}")
        if c.stride(-1) != 1:
            raise ValueError(f"{who}: {name} must have unit stride in its last dim")
    if slots is not None and (slots.shape != (b, t) or slots.dtype not in (torch.int32, torch.int64)):
        raise ValueError(f"{who}: slots must be int32/int64 [{b}, {t}], got {slots.dtype} {list(slots.shape)}")
    if num_heads and (q_norm_weight is None) != (k_norm_weight is None):
        raise ValueError(f"{who}: give both q_norm_weight and k_norm_weight, or neither")
    if not num_heads and q_norm_weight is not None:
        raise ValueError(f"{who}: q_norm_weight without q heads (num_heads=0)")
    for name, w in (("q_norm_weight", q_norm_weight), ("k_norm_weight", k_norm_weight)):
        if w is not None and (w.shape != (d,) or w.dtype != qkv.dtype):
            raise ValueError(f"{who}: {name} must be [{d}] {qkv.dtype}, got {list(w.shape)} {w.dtype}")
    for name, x in (("cos", cos), ("sin", sin)):
        if x.dtype != qkv.dtype:
            raise ValueError(f"{who}: {name} must be {qkv.dtype} (model.rope's tables), got {x.dtype}")
    return b, t, d


def rope_qkv(
    qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    slots: torch.Tensor, *, num_heads: int, num_kv_heads: int,
    q_norm_weight: torch.Tensor | None = None, k_norm_weight: torch.Tensor | None = None, eps: float = 1e-6,
    prefetch: torch.Tensor | tuple[torch.Tensor, ...] | None = None, launch: Launch | None = None,
) -> torch.Tensor:
    """Roped q [B, H, T, D]; roped k and v written into k_cache, v_cache at `slots` (module docstring).
    `prefetch`: weights (up to two tensors) the next kernels read, asked into L2 meanwhile where
    `launch` says (kernels/overlap.py)."""
    b, t, d = check_rope_args(qkv, cos, sin, k_cache, v_cache, slots, num_heads, num_kv_heads, q_norm_weight, k_norm_weight)
    cos, sin = rope_table(cos, "cos", b, t, d), rope_table(sin, "sin", b, t, d)
    if cos.shape != sin.shape:
        raise ValueError(f"rope_qkv: cos {list(cos.shape)} and sin {list(sin.shape)} differ")
    if cos.stride() != sin.stride():  # the kernel indexes both with cos's strides
        cos, sin = cos.contiguous(), sin.contiguous()
    q = torch.empty((b, num_heads, t, d), dtype=qkv.dtype, device=qkv.device)
    if b * t * d == 0:
        return q
    if qkv.stride(-1) != 1:
        qkv = qkv.contiguous()
    # stand-ins for pointers the kernel never follows: the norm weights without the norm, q without
    # q heads (an empty tensor is no pointer)
    norm = k_norm_weight is not None
    kw = k_norm_weight if norm else qkv
    qw = q_norm_weight if q_norm_weight is not None else kw
    q_out = q if num_heads else qkv
    native = on_native(qkv)
    pf, *pf_ranges = prefetch_args(qkv.device, prefetch, launch)
    _rope_qkv_kernel[(b * t, num_heads + num_kv_heads)](
        qkv, cos, sin, qw, kw, slots, q_out, k_cache, v_cache,
        t, num_heads, num_kv_heads, eps, 1.0 / d, *pf_ranges,
        qkv.stride(0), qkv.stride(1), cos.stride(0) if cos.shape[0] > 1 else 0, cos.stride(1),
        slots.stride(0), slots.stride(1),
        q.stride(0), q.stride(1), q.stride(2),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        HALF=d // 2, BLOCK=triton.next_power_of_2(d // 2), QK_NORM=norm,
        ROUND_BF16=not native and qkv.dtype == torch.bfloat16, PREFETCH=pf,
        **(dict(num_warps=1, enable_fp_fusion=False) if native else {}), **pdl_args(qkv.device, launch),
    )
    return q


def _rmsnorm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """model.RMSNorm."""
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def rotate_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE by halves (HF's rotate_half): x · cos + [-x₂, x₁] · sin."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def rope_table_reference(positions: torch.Tensor, head_dim: int, dtype: torch.dtype, theta: float = 10000.0
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [B, 1, T, head_dim] of positions [B, T], in float32 then cast to `dtype`."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2).float() / head_dim))
    freqs = positions.float()[..., None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)[:, None]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rope_qkv_reference(
    qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    slots: torch.Tensor, *, num_heads: int, num_kv_heads: int,
    q_norm_weight: torch.Tensor | None = None, k_norm_weight: torch.Tensor | None = None, eps: float = 1e-6,
    prefetch: torch.Tensor | tuple[torch.Tensor, ...] | None = None, launch: Launch | None = None,
) -> torch.Tensor:
    """model.Attention.queries / keys_values on the split projection, then the cache writes
    (`prefetch` and `launch` are the kernel's arguments, unused here)."""
    b, t, d = check_rope_args(qkv, cos, sin, k_cache, v_cache, slots, num_heads, num_kv_heads, q_norm_weight, k_norm_weight)
    cos, sin = rope_table(cos, "cos", b, t, d)[:, None], rope_table(sin, "sin", b, t, d)[:, None]
    q, k, v = qkv.view(b, t, -1, d).split([num_heads, num_kv_heads, num_kv_heads], dim=2)
    if q_norm_weight is not None:
        q = _rmsnorm_reference(q, q_norm_weight, eps)
    if k_norm_weight is not None:
        k = _rmsnorm_reference(k, k_norm_weight, eps)
    q, k, v = rotate_reference(q.transpose(1, 2), cos, sin), rotate_reference(k.transpose(1, 2), cos, sin), v.transpose(1, 2)
    for row in range(b):
        k_cache[row][:, slots[row].long()] = k[row]
        v_cache[row][:, slots[row].long()] = v[row]
    return q.contiguous()


# --- registry entry -------------------------------------------------------------------------

def _make_inputs(case, device, seed):
    """qkv ~ N(0, 1); positions past + depth with past around 1000 (a chain's depth is t, a tree's a
    random parent's + 1) and slots past + t; cos, sin from rope_table_reference; caches random, so
    that a write to a wrong slot shows."""
    g = torch.Generator().manual_seed(seed)
    b, t, h, hkv, d, s, dtype = case["B"], case["T"], case["H"], case["Hkv"], case["D"], case["S"], case["dtype"]
    qkv = torch.randn(b, t, (h + 2 * hkv) * d, generator=g)
    past = torch.randint(0, s - t + 1, (b, 1), generator=g)
    depth = torch.zeros(b, t, dtype=torch.int64)
    for u in range(1, t):
        depth[:, u] = depth[torch.arange(b), torch.randint(0, u, (b,), generator=g)] + 1 if case["tree"] else u
    positions = 1000 + past + depth
    cos, sin = rope_table_reference(positions, d, dtype)
    k_cache, v_cache = (torch.randn(b, hkv, s, d, generator=g).to(dtype).to(device) for _ in range(2))
    slots = (past + torch.arange(t)).to(torch.int32)
    norm = [(1 + 0.2 * torch.randn(d, generator=g)).to(dtype).to(device) for _ in range(2)] if case["qk_norm"] else [None, None]
    if h == 0:  # no q heads: no q norm
        norm[0] = None
    return (qkv.to(dtype).to(device), cos.to(device), sin.to(device), k_cache, v_cache, slots.to(device),
            h, hkv, *norm)


def _flat(fn, inputs):
    """q and both caches (written on copies), flattened into one tensor for the registry."""
    qkv, cos, sin, k_cache, v_cache, slots, h, hkv, qw, kw = inputs
    k_cache, v_cache = k_cache.clone(), v_cache.clone()
    q = fn(qkv, cos, sin, k_cache, v_cache, slots, num_heads=h, num_kv_heads=hkv, q_norm_weight=qw,
           k_norm_weight=kw, eps=1e-6)
    return torch.cat([q.flatten(), k_cache.flatten(), v_cache.flatten()])


def _run(*inputs):
    return _flat(rope_qkv, inputs)


def _reference(*inputs):
    return _flat(rope_qkv_reference, inputs)


def _plant(inputs):
    """The sign of the first token's largest cos entry flipped."""
    qkv, cos, sin, *rest = inputs
    cos = cos.clone()
    first = cos[0, 0, 0]
    first[first.abs().argmax()] *= -1
    return qkv, cos, sin, *rest


def _case(b, t, h, hkv, d, s, qk_norm, dtype, tree=0):
    return {"B": b, "T": t, "H": h, "Hkv": hkv, "D": d, "S": s, "qk_norm": qk_norm, "dtype": dtype, "tree": tree}


F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16

register(KernelSpec(
    name="rope_qkv",
    run=_run,
    reference=_reference,
    make_inputs=_make_inputs,
    cases=[
        _case(1, 1, 8, 1, 128, 21, 0, BF16),  # llama-like decode step
        _case(2, 3, 2, 1, 64, 37, 1, BF16, tree=1),  # qwen3-like qk-norm, tree positions
        _case(1, 5, 3, 3, 32, 11, 1, F32),
        _case(1, 2, 2, 1, 18, 9, 0, F16),  # D/2 = 9: a ragged block
        _case(2, 3, 0, 3, 18, 13, 1, BF16),  # [k|v] only (a DFlash drafter's context), k-norm, ragged
        _case(1, 5, 0, 1, 32, 7, 0, F32),
    ],
    # with qk-norm, one step of the dtype in the normalised value (module docstring), carried
    # through a rope product and the sum: ~2 steps of values up to ~4.
    tolerance={F32: (1e-5, 1e-5), BF16: (2 ** -5, 2 ** -6), F16: (2 ** -8, 2 ** -9)},
    corrupt=_plant,
    description="qk-norm, RoPE and KV-cache writes from the fused q|k|v projection; roped q out",
))

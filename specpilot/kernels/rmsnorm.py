"""RMSNorm of rows, optionally fused with the residual add before it, one program per row.

`rmsnorm(x, weight, eps)` is model.RMSNorm: y = weight · (x.float() · rsqrt(mean(x.float()²) + eps))
cast to x.dtype, the product weight · that rounded once to the promoted dtype (a bf16 multiply for
bf16 weights). With `residual` it is the decoder's `x = x + attn_out; h = post_norm(x)`:
h = x + residual rounded to the dtype (a torch add), returns (rmsnorm(h), h) from one kernel.

Numerics: the add, the cast of the normalised row and the weight product round where torch does.
The sum of squares is a tree reduction in fp32 (torch's order differs) and rsqrt is PTX's
rsqrt.approx (torch's CUDA rsqrtf may differ in the last ulp), so the fp32 normalised row can differ from torch's by a few ulp; in bf16 that rounds to the
same value except where it sits on a rounding boundary, where it lands one bf16 step away
(not bit-exact, though no element differed in the interpreter cases; h is bit-exact). fp fusion
is off so that sum · (1/H) + eps rounds twice, as torch's mean and add do.

Launch: BLOCK = next power of two >= H (the row is held in registers; H <= 16384), num_warps
4/8/16 for BLOCK <= 1024/4096/more. Untuned: no GPU measurement yet.
CUDA graphs: no host sync; the grid is the row count.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .bf16_words import bf16x4_to_fp32
from .overlap import Launch, pdl_args, pdl_enter
from .registry import KernelSpec, register
from .rounding import round_bf16, to_dtype
from .target import native as on_native

MAX_H = 16384
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


# --- the norm prologue pieces of kernels/fused_linear.py and kernels/u12/ ----------------------

@triton.jit
def normalize(v, inv, nw, DTYPE: tl.constexpr, ROUND_BF16: tl.constexpr):
    """rmsnorm's two roundings: dtype(nw · dtype(v · inv))."""
    return to_dtype(nw * to_dtype(v * inv, DTYPE, ROUND_BF16), DTYPE, ROUND_BF16)


@triton.jit
def row_inv(x_ptr, rows, stride_xm, K, inv_k, eps, BLOCK_M: tl.constexpr, BLOCK: tl.constexpr):
    """rsqrt(Σ x² · fp32(1/K) + eps) for the rows `rows` [BLOCK_M] of x (fp fusion is off in the
    launch, so the product and the add round apart, as torch's mean and add do)."""
    acc = tl.zeros((BLOCK_M, BLOCK), dtype=tl.float32)
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xm
    for k0 in range(0, K, BLOCK):
        k = k0 + tl.arange(0, BLOCK)[None, :]
        v = tl.load(x_rows + k, mask=k < K, other=0.0).to(tl.float32)
        acc = tl.fma(v, v, acc)
    return tl.math.rsqrt(tl.sum(acc, axis=1) * inv_k + eps)


@triton.jit
def row_inv_words(x_ptr, rows, stride_words, n_words, inv_k, eps, BLOCK_M: tl.constexpr, BLOCK_W: tl.constexpr):
    """``row_inv`` for bf16 rows read as int64 words of 4 (K % 4 == 0, 8-byte aligned rows),
    BLOCK_W words a chunk. A chunk's load is waited on before the next is issued, so a GEMV
    prologue takes the whole row in one (``norm_words``): one memory round trip before its main
    loop. The words hold half the registers of fp32 elements and the four planes share one
    accumulator."""
    x_rows = x_ptr.to(tl.pointer_type(tl.int64)) + rows.to(tl.int64)[:, None] * stride_words
    acc = tl.zeros((BLOCK_M, BLOCK_W), dtype=tl.float32)
    for w0 in range(0, n_words, BLOCK_W):
        w = w0 + tl.arange(0, BLOCK_W)[None, :]
        p0, p1, p2, p3 = bf16x4_to_fp32(tl.load(x_rows + w, mask=w < n_words, other=0))
        acc = tl.fma(p0, p0, acc)
        acc = tl.fma(p1, p1, acc)
        acc = tl.fma(p2, p2, acc)
        acc = tl.fma(p3, p3, acc)
    return tl.math.rsqrt(tl.sum(acc, axis=1) * inv_k + eps)


def norm_words(k: int, block_m: int, num_warps: int, per_thread: int = 16) -> int:
    """``row_inv_words``' chunk: the whole row's K / 4 words (a power of two), up to per_thread
    words (4 bf16 each) a thread across the program's block_m rows."""
    return max(1, min(triton.next_power_of_2(k // 4), per_thread * 32 * num_warps // block_m))


@triton.jit
def row_inv_parts(sq_ptr, rows, M, parts, inv_k, eps, BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr):
    """rsqrt(Σ x² · fp32(1/K) + eps) for `rows` from a writer's parts of Σ x² ([parts, M] fp32:
    fused_linear's RowSquares, u12's NormHandoff), summed in a fixed order (a tree within BLOCK_P
    parts, chunks in order): one load of a few KB where the prologue would read every row of x."""
    acc = tl.zeros((BLOCK_P, BLOCK_M), dtype=tl.float32)
    for p0 in range(0, parts, BLOCK_P):
        p = p0 + tl.arange(0, BLOCK_P)[:, None]
        acc += tl.load(sq_ptr + p * M + rows[None, :], mask=p < parts, other=0.0)
    return parts_inv(acc, inv_k, eps)


@triton.jit
def parts_inv(acc, inv_k, eps):
    """``row_inv_parts``' last step: rsqrt(Σ over the parts axis of acc [BLOCK_P, BM] · inv_k + eps)."""
    return tl.math.rsqrt(tl.sum(acc, axis=0) * inv_k + eps)


@triton.jit
def _rmsnorm_kernel(
    x_ptr, r_ptr, w_ptr, y_ptr, h_ptr,
    H, inv_h, eps, stride_x, stride_r, stride_y, stride_h,
    BLOCK: tl.constexpr, RESIDUAL: tl.constexpr,
    ROUND_X: tl.constexpr, ROUND_Y: tl.constexpr,  # bf16 under the interpreter: round before casting
    PDL: tl.constexpr,  # programmatic dependent launch (kernels/overlap.py)
):
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < H
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
    if RESIDUAL:
        r = tl.load(r_ptr + row * stride_r + cols, mask=ok, other=0.0)
        h = x.to(tl.float32) + r.to(tl.float32)
        if ROUND_X:
            h = round_bf16(h)
        x = h.to(x_ptr.dtype.element_ty)
        tl.store(h_ptr + row * stride_h + cols, x, mask=ok)
    xf = x.to(tl.float32)
    inv = tl.math.rsqrt(tl.sum(xf * xf, 0) * inv_h + eps)  # CUDA torch's mean: sum · fp32(1/H)
    n = xf * inv
    if ROUND_X:
        n = round_bf16(n)
    n = n.to(x_ptr.dtype.element_ty).to(tl.float32)
    y = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32) * n
    if ROUND_Y:
        y = round_bf16(y)
    tl.store(y_ptr + row * stride_y + cols, y.to(y_ptr.dtype.element_ty), mask=ok)


def _rows(t: torch.Tensor, h: int) -> torch.Tensor:
    return t.reshape(-1, h) if t.stride(-1) == 1 else t.contiguous().view(-1, h)


def rmsnorm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None, *,
    launch: Launch | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """x [..., H], weight [H] -> y [..., H] in promote(weight, x) dtype; with `residual` (x's shape
    and dtype) -> (y of h, h = x + residual in x.dtype). Leading dims that do not flatten to rows
    without a copy are copied. `launch`: PDL (kernels/overlap.py)."""
    hdim = x.shape[-1]
    if weight.shape != (hdim,):
        raise ValueError(f"rmsnorm: weight must be [{hdim}] for x {list(x.shape)}, got {list(weight.shape)}")
    if x.dtype not in _DTYPES or weight.dtype not in _DTYPES:
        raise ValueError(f"rmsnorm: x and weight must be float32/bfloat16/float16, got {x.dtype}, {weight.dtype}")
    if not 0 < hdim <= MAX_H:
        raise ValueError(f"rmsnorm: H must be in 1..{MAX_H}, got {hdim}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(f"rmsnorm: residual must match x {list(x.shape)} {x.dtype}, got "
                         f"{list(residual.shape)} {residual.dtype}")
    out_dtype = torch.promote_types(weight.dtype, x.dtype)
    x2 = _rows(x, hdim)
    y = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    h = torch.empty_like(x) if residual is not None else None
    rows = x2.shape[0]
    if rows:
        r2 = _rows(residual, hdim) if residual is not None else x2
        y2, h2 = y.view(-1, hdim), (h.view(-1, hdim) if h is not None else y.view(-1, hdim))
        native = on_native(x)
        block = triton.next_power_of_2(hdim)
        warps = 4 if block <= 1024 else 8 if block <= 4096 else 16
        opts = dict(num_warps=warps, enable_fp_fusion=False) if native else {}  # torch: no fma in sum·(1/H) + eps
        _rmsnorm_kernel[(rows,)](
            x2, r2, weight, y2, h2, hdim, 1.0 / hdim, eps, x2.stride(0), r2.stride(0), y2.stride(0), h2.stride(0),
            BLOCK=block, RESIDUAL=residual is not None,
            ROUND_X=not native and x.dtype == torch.bfloat16, ROUND_Y=not native and out_dtype == torch.bfloat16,
            **opts, **pdl_args(x.device, launch),
        )
    return y if residual is None else (y, h)


def rmsnorm_reference(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None, *,
    launch: Launch | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """model.RMSNorm op for op (after the torch add x + residual, if given); `launch` is the
    kernel's argument, unused here."""
    h = x if residual is None else x + residual
    hf = h.float()
    y = weight * (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)).to(h.dtype)
    return y if residual is None else (y, h)


# --- registry entry -------------------------------------------------------------------------

def _make_inputs(case, device, seed):
    """x ~ N(0, 1) (a few rows scaled by 30, as hidden states are), weight ~ 1 + N(0, 0.1), and a
    residual ~ N(0, 1) if the case asks for one."""
    g = torch.Generator().manual_seed(seed)
    rows, hdim, dtype = case["rows"], case["H"], case["dtype"]
    x = torch.randn(rows, hdim, generator=g)
    x[::3] *= 30
    w = 1 + 0.1 * torch.randn(hdim, generator=g)
    r = torch.randn(rows, hdim, generator=g).to(dtype).to(device) if case["residual"] else None
    return x.to(dtype).to(device), w.to(dtype).to(device), 1e-6, r


def _both(y_h):
    """The registry compares one tensor: y and h side by side."""
    return torch.cat(y_h, -1) if isinstance(y_h, tuple) else y_h


def _run(x, w, eps, r):
    return _both(rmsnorm(x, w, eps, r))


def _reference(x, w, eps, r):
    return _both(rmsnorm_reference(x, w, eps, r))


def _plant(inputs):
    """One weight element 10% off: every row's output there moves by 10%."""
    x, w, eps, r = inputs
    w = w.clone()
    w[len(w) // 2] *= 1.1
    return x, w, eps, r


F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16

register(KernelSpec(
    name="rmsnorm",
    run=_run,
    reference=_reference,
    make_inputs=_make_inputs,
    cases=[
        {"rows": 3, "H": 200, "dtype": F32, "residual": 0},
        {"rows": 5, "H": 384, "dtype": BF16, "residual": 0},
        {"rows": 5, "H": 384, "dtype": BF16, "residual": 1},
        {"rows": 2, "H": 4096, "dtype": BF16, "residual": 1},
        {"rows": 1, "H": 8192, "dtype": F32, "residual": 1},
        {"rows": 7, "H": 33, "dtype": F16, "residual": 1},
    ],
    # the normalised row one step of the dtype off where it sits on a rounding boundary (module
    # docstring), times the weight and rounded again: up to 1.5 steps; fp32: reduction order, rsqrt.
    tolerance={F32: (1e-5, 1e-5), BF16: (0.0, 2 ** -6), F16: (0.0, 2 ** -9)},
    corrupt=_plant,
    description="weight · rmsnorm(x [+ residual]) per row, with the sum h when fused with the residual add",
))

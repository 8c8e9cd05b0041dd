"""Escapes: the weights outside a u12 tensor's exponent window, added exactly after the loop.

Escapes (code 0, sign/mantissa byte 0) decode to +0.0 in the scaled decode and to 2^-15 in the
biased one; after the sum, the program that stores an output block adds the exact contributions
x[:, k] · w[n, k] of its rows' escapes (and, biased, takes back the x · 2^-15 the loop added,
before the scale). Two ways to find them:

- The table (``U12Tensor.esc_row_ptr``, ``esc_idx``, ``esc_val``: CSR row pointers, then indices
  and values, then x at their columns, three dependent loads; scattered by a one-hot product, one
  escape at a time where a block holds inf/NaN contributions). The block kernels (tile, mma,
  hmma) walk it after their loops; the GEMVs where a weight has no lanes, loading the row pointers
  before their loop (``escape_stage``) and the rest after it.
- The lanes (``U12Tensor.esc_lanes``: every escape of a row in that row's lanes, ``column | bf16
  bits << 16``, as many as the fullest row needs rounded up to a power of two, none past 16 a row
  or K past 65535). The GEMVs load their rows' lanes before their loop at addresses they know up
  front (``lanes_load``), gather x at their columns after it (``lanes_gather``: one round trip) and
  reduce both escape sums in one pass (``lanes_finish``): each lane belongs to one row, so inf/NaN
  stay in it. Lanes are derived on first use with a host sync, so a launch captured in a CUDA
  graph before any eager one walks the table (``lanes_args``).

Which way each kernel takes, and what else was tried: docs/experiments/u12-escapes.md.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specpilot.formats.u12 import U12Tensor

from ..rmsnorm import normalize
from .decode import ESC_DECODED

ESC_BLOCK = 16  # table escapes loaded and scattered at a time


def nonempty(t: torch.Tensor) -> torch.Tensor:
    """t, or one zero where t is empty: kernels take a pointer even when the escape table is empty."""
    return t if t.numel() else torch.zeros(1, dtype=t.dtype, device=t.device)


def lanes_args(t: U12Tensor) -> tuple[torch.Tensor, int]:
    """(the lanes pointer, the launch's LANES) of a GEMV on t: its lanes, or LANES 0 (the table; a
    pointer the kernel does not read) where t has none or has not derived them yet inside a CUDA
    graph capture (deriving them syncs, which a capture does not allow)."""
    capturing = t.device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    lanes = t.esc_lanes if not capturing or "esc_lanes" in t.__dict__ else None
    return (t.esc_row_ptr, 0) if lanes is None else (lanes, lanes.shape[1])


@triton.jit
def _scatter_escapes(acc, contrib, rows, offs_n, USE_DOT: tl.constexpr):
    """acc[:, n] += sum of contrib[:, e] over escapes e in row n, for finite contrib [BM, EB]."""
    hit = rows[:, None] == offs_n[None, :]  # [EB, BN]
    if USE_DOT:
        # One-hot product: exact in fp32 (each output gets one nonzero term per escape).
        return tl.dot(contrib, hit.to(tl.float32), acc, input_precision="ieee")
    else:
        return acc + tl.sum(tl.where(hit[None, :, :], contrib[:, :, None], 0.0), axis=1)


@triton.jit
def _escape_range(esc_row_ptr, n0, N, BLOCK_N: tl.constexpr):
    """[start, end): the escapes of rows [n0, min(n0 + BLOCK_N, N)) of W in its side table (CSR row pointers)."""
    return tl.load(esc_row_ptr + n0), tl.load(esc_row_ptr + tl.minimum(n0 + BLOCK_N, N))


@triton.jit
def _escape_load(esc_idx_ptr, esc_val_ptr, offs_e, mask_e):
    """The flat indices and fp32 values of escapes offs_e (0 where not mask_e)."""
    idx = tl.load(esc_idx_ptr + offs_e, mask=mask_e, other=0)
    val = (tl.load(esc_val_ptr + offs_e, mask=mask_e, other=0).to(tl.int32) << 16).to(tl.float32, bitcast=True)
    return idx, val


@triton.jit
def _escape_gather(x_ptr, nw_ptr, idx, mask_e, offs_m, mask_m, K, stride_xm, stride_xk,
                   ESC_BLOCK: tl.constexpr, NORM: tl.constexpr):
    """x [BM, ESC_BLOCK] (fp32) at the columns of the escapes idx (``_escape_load``), and NORM
    the norm weight there (else zeros)."""
    cols = idx % K
    xg = tl.load(
        x_ptr + offs_m[:, None] * stride_xm + cols[None, :] * stride_xk,
        mask=mask_m[:, None] & mask_e[None, :], other=0.0,
    ).to(tl.float32)
    if NORM:
        nw = tl.load(nw_ptr + cols, mask=mask_e, other=0.0).to(tl.float32)
    else:
        nw = tl.zeros((ESC_BLOCK,), dtype=tl.float32)
    return xg, nw


@triton.jit
def _escape_block(
    esc, spur, idx, val, xg, nw, e0, end, x_ptr, esc_idx_ptr, esc_val_ptr, offs_m, mask_m, offs_n, K,
    stride_xm, stride_xk, ESC_BLOCK: tl.constexpr, USE_DOT: tl.constexpr,
    nw_ptr, inv, NORM: tl.constexpr, DTYPE: tl.constexpr, ROUND_BF16: tl.constexpr, BIASED: tl.constexpr,
):
    """Escapes e0 .. e0 + ESC_BLOCK - 1 (< end), loaded and gathered (``_escape_load``,
    ``_escape_gather``), into esc (Σ x · w) and, BIASED, spur (Σ x · 2^-15), both [BM, BN] by the
    rows offs_n. One escape at a time, reloaded, when the block holds inf/NaN contributions."""
    mask_e = e0 + tl.arange(0, ESC_BLOCK) < end
    rows = tl.where(mask_e, idx // K, -1)
    if NORM:
        xg = normalize(xg, inv[:, None], nw[None, :], DTYPE, ROUND_BF16)
    contrib = xg * val[None, :]
    n_nonfinite = tl.sum(tl.sum((contrib - contrib != 0).to(tl.int32), axis=1), axis=0)
    if n_nonfinite == 0:
        esc = _scatter_escapes(esc, contrib, rows, offs_n, USE_DOT)
        if BIASED:  # finite too: x is finite wherever x · w is
            spur = _scatter_escapes(spur, xg * ESC_DECODED, rows, offs_n, USE_DOT)
    else:
        for e in range(e0, tl.minimum(e0 + ESC_BLOCK, end)):
            i = tl.load(esc_idx_ptr + e)
            v = (tl.load(esc_val_ptr + e).to(tl.int32) << 16).to(tl.float32, bitcast=True)
            xcol = tl.load(x_ptr + offs_m * stride_xm + (i % K) * stride_xk, mask=mask_m, other=0.0).to(tl.float32)
            if NORM:
                xcol = normalize(xcol, inv, tl.load(nw_ptr + i % K).to(tl.float32), DTYPE, ROUND_BF16)
            hit = offs_n[None, :] == i // K
            esc += tl.where(hit, (xcol * v)[:, None], 0.0)
            if BIASED:
                spur += tl.where(hit, (xcol * ESC_DECODED)[:, None], 0.0)
    return esc, spur


@triton.jit
def _escape_blocks(
    esc, spur, first, end, x_ptr, esc_idx_ptr, esc_val_ptr, offs_m, mask_m, offs_n, K,
    stride_xm, stride_xk, ESC_BLOCK: tl.constexpr, USE_DOT: tl.constexpr,
    nw_ptr, inv, NORM: tl.constexpr, DTYPE: tl.constexpr, ROUND_BF16: tl.constexpr, BIASED: tl.constexpr,
):
    """``_escape_block`` over escapes first .. end - 1, ESC_BLOCK at a time, each loaded and gathered in turn."""
    for e0 in range(first, end, ESC_BLOCK):
        offs_e = e0 + tl.arange(0, ESC_BLOCK)
        idx, val = _escape_load(esc_idx_ptr, esc_val_ptr, offs_e, offs_e < end)
        xg, nw = _escape_gather(x_ptr, nw_ptr, idx, offs_e < end, offs_m, mask_m, K, stride_xm, stride_xk,
                                ESC_BLOCK, NORM)
        esc, spur = _escape_block(
            esc, spur, idx, val, xg, nw, e0, end, x_ptr, esc_idx_ptr, esc_val_ptr, offs_m, mask_m, offs_n, K,
            stride_xm, stride_xk, ESC_BLOCK, USE_DOT, nw_ptr, inv, NORM, DTYPE, ROUND_BF16, BIASED,
        )
    return esc, spur


@triton.jit
def _escape_sums(acc, BIASED: tl.constexpr):
    """The escape step's two sums, esc and spur (``_escape_block``): zeros for the biased decode;
    else esc is acc itself (y's units already, the escapes decoded to +0.0) and spur unused."""
    if BIASED:
        return tl.zeros_like(acc), tl.zeros_like(acc)
    else:
        return acc, acc


@triton.jit
def _escape_finish(acc, esc, spur, y_scale, BIASED: tl.constexpr):
    """y from the loop's sums and the escape sums: (acc - spur) · y_scale + esc for the biased
    decode (the scale exact: a power of two), else esc (acc with the escapes added)."""
    if BIASED:
        return (acc - spur) * y_scale + esc
    else:
        return esc


@triton.jit
def escape_ahead_init(idx_ptr, BLOCK_M: tl.constexpr, ESC_BLOCK: tl.constexpr):
    """The first escape block's registers before its loads (``escape_stage``): offs_e, end, idx, val, x, nw."""
    zeros = tl.zeros((ESC_BLOCK,), dtype=tl.int32)
    return (zeros, zeros, tl.zeros((ESC_BLOCK,), dtype=idx_ptr.dtype.element_ty),
            tl.zeros((ESC_BLOCK,), dtype=tl.float32), tl.zeros((BLOCK_M, ESC_BLOCK), dtype=tl.float32),
            tl.zeros((ESC_BLOCK,), dtype=tl.float32))


@triton.jit
def escape_stage(
    step, offs_e, end, idx, val, xg, nw, esc_row_ptr, n0, N, esc_idx_ptr, esc_val_ptr, x_ptr, nw_ptr, offs_m,
    mask_m, K, stride_xm, stride_xk, BLOCK_N: tl.constexpr, ESC_BLOCK: tl.constexpr, NORM: tl.constexpr,
):
    """Step ``step`` of the loads of the first ESC_BLOCK escapes of rows [n0, min(n0 + BLOCK_N, N)),
    three dependent round trips: 0 the row pointers (offs_e, the first escape's offset in the table,
    and end, each an [ESC_BLOCK] tensor), 1 the indices and values (``_escape_load``), 2 x and NORM
    the norm weight at their columns (``_escape_gather``). The GEMVs issue step 0 before their loop
    and the rest after it (``escape_stages_left``); the steps stay apart because folding them into
    two plain helpers changed the kernels' sm_90 SASS. The row pointers are tensors, not scalars: a
    scalar goes to a uniform register, whose move waited for the load on the spot (sm_90 SASS)."""
    if step == 0:
        zero = tl.zeros((ESC_BLOCK,), dtype=tl.int32)
        offs_e = tl.load(esc_row_ptr + n0 + zero)
        end = tl.load(esc_row_ptr + tl.minimum(n0 + BLOCK_N, N) + zero)
    if step == 1:
        offs = offs_e + tl.arange(0, ESC_BLOCK)
        idx, val = _escape_load(esc_idx_ptr, esc_val_ptr, offs, offs < end)
    if step == 2:
        xg, nw = _escape_gather(x_ptr, nw_ptr, idx, offs_e + tl.arange(0, ESC_BLOCK) < end, offs_m, mask_m, K,
                                stride_xm, stride_xk, ESC_BLOCK, NORM)
    return offs_e, end, idx, val, xg, nw


@triton.jit
def escape_stages_left(
    FIRST: tl.constexpr, offs_e, end, idx, val, xg, nw, esc_row_ptr, n0, N, esc_idx_ptr, esc_val_ptr, x_ptr, nw_ptr, offs_m,
    mask_m, K, stride_xm, stride_xk, BLOCK_N: tl.constexpr, ESC_BLOCK: tl.constexpr, NORM: tl.constexpr,
):
    """The ``escape_stage`` steps from ``FIRST`` on (those the kernel did not issue before its loop)."""
    for step in tl.static_range(FIRST, 3):
        offs_e, end, idx, val, xg, nw = escape_stage(
            step, offs_e, end, idx, val, xg, nw, esc_row_ptr, n0, N, esc_idx_ptr, esc_val_ptr, x_ptr, nw_ptr, offs_m,
            mask_m, K, stride_xm, stride_xk, BLOCK_N, ESC_BLOCK, NORM,
        )
    return offs_e, end, idx, val, xg, nw


@triton.jit
def escapes_ahead(
    acc, offs_e, end, idx, val, xg, nw, x_ptr, esc_idx_ptr, esc_val_ptr, offs_m, mask_m, offs_n, K,
    stride_xm, stride_xk, ESC_BLOCK: tl.constexpr, nw_ptr, inv, NORM: tl.constexpr, DTYPE: tl.constexpr,
    ROUND_BF16: tl.constexpr, y_scale,
):
    """``apply_escapes`` (biased decode, no dot) for a GEMV that loaded the first ESC_BLOCK escapes
    of its rows by ``escape_stage``: that block from its registers, any further ones loaded here
    (past ESC_BLOCK escapes in a program's rows: rare, about 0.6 a row of 4096 N(0, 0.02) weights)."""
    e0 = tl.min(offs_e, 0)
    e_end = tl.max(end, 0)
    esc, spur = _escape_sums(acc, True)
    esc, spur = _escape_block(
        esc, spur, idx, val, xg, nw, e0, e_end, x_ptr, esc_idx_ptr, esc_val_ptr, offs_m, mask_m, offs_n, K,
        stride_xm, stride_xk, ESC_BLOCK, False, nw_ptr, inv, NORM, DTYPE, ROUND_BF16, True,
    )
    esc, spur = _escape_blocks(
        esc, spur, e0 + ESC_BLOCK, e_end, x_ptr, esc_idx_ptr, esc_val_ptr, offs_m, mask_m, offs_n, K,
        stride_xm, stride_xk, ESC_BLOCK, False, nw_ptr, inv, NORM, DTYPE, ROUND_BF16, True,
    )
    return _escape_finish(acc, esc, spur, y_scale, True)


@triton.jit
def apply_escapes(
    acc, x_ptr, esc_idx_ptr, esc_val_ptr, esc_row_ptr, offs_m, mask_m, offs_n, n0, N, K,
    stride_xm, stride_xk, BLOCK_N: tl.constexpr, ESC_BLOCK: tl.constexpr, USE_DOT: tl.constexpr,
    nw_ptr, inv, NORM: tl.constexpr, DTYPE: tl.constexpr, ROUND_BF16: tl.constexpr,
    BIASED: tl.constexpr = False, y_scale=1.0,
):
    """Add the exact contributions of the escaped weights in rows [n0, min(n0 + BLOCK_N, N)) of W
    (offs_n: those rows' indices in W, so a block of the up half of [gate; up] passes n0, offs_n and
    N shifted by the gate rows). NORM: x at an escape's column is normalised as the fused kernel's
    x planes are (kernels/u12/fused.py), dtype(nw · dtype(x · inv)) with inv [BM] per row.

    BIASED: acc holds the biased decode's sums (its units: y / y_scale), in which every escape
    decoded to 2^-15 (``ESC_DECODED``). That term is taken back in those units, where it is the
    exact product the loop added, before the scale: y = (acc - Σ x 2^-15) · y_scale + Σ x w. Else
    acc is y's sums already and the escapes decoded to +0.0: y = acc + Σ x w.

    Three dependent memory round trips (row pointers, then indices and values, then x at their
    columns); the GEMVs issue the first before their loops (``escape_stage``, ``escapes_ahead``)."""
    esc, spur = _escape_sums(acc, BIASED)
    start, end = _escape_range(esc_row_ptr, n0, N, BLOCK_N)
    esc, spur = _escape_blocks(
        esc, spur, start, end, x_ptr, esc_idx_ptr, esc_val_ptr, offs_m, mask_m, offs_n, K,
        stride_xm, stride_xk, ESC_BLOCK, USE_DOT, nw_ptr, inv, NORM, DTYPE, ROUND_BF16, BIASED,
    )
    return _escape_finish(acc, esc, spur, y_scale, BIASED)


@triton.jit
def _lane_sums(a0, b0, a1, b1):
    return a0 + a1, b0 + b1


@triton.jit
def lanes_load(lanes_ptr, rows_n, LANES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The escape lanes (``U12Tensor.esc_lanes``: LANES a row, ``column | bf16 bits << 16``) of
    the W rows rows_n [1, BN, 1], as [BM, BN, LANES] int32. Their addresses need no other load,
    so the GEMVs issue this before their loop and use it after."""
    offs_l = tl.arange(0, LANES)[None, None, :]
    return tl.load(tl.broadcast_to(lanes_ptr + rows_n * LANES + offs_l, (BLOCK_M, BLOCK_N, LANES)))


@triton.jit
def _lanes_x(lanes, x_ptr, nw_ptr, rows_m, stride_xm, K, NORM: tl.constexpr):
    """x (rows_m [BM, 1, 1]) and, NORM, the norm weight at the columns of ``lanes``
    (``lanes_load``) as loaded, 0 in empty lanes (column 0xFFFF >= K): the loads of
    ``lanes_gather``, one memory round trip (x, from L2)."""
    col = lanes & 0xFFFF
    ok = col < K
    xv = tl.load(x_ptr + rows_m * stride_xm + col, mask=ok, other=0.0)
    nw = tl.load(nw_ptr + col, mask=ok, other=0.0) if NORM else xv
    return xv, nw


@triton.jit
def _lanes_terms(lanes, xv, nw, K, inv, NORM: tl.constexpr, DTYPE: tl.constexpr, ROUND_BF16: tl.constexpr):
    """``lanes_gather``'s terms from ``_lanes_x``'s loads."""
    ok = (lanes & 0xFFFF) < K
    xv = xv.to(tl.float32)
    if NORM:
        xv = normalize(xv, inv, nw.to(tl.float32), DTYPE, ROUND_BF16)
    w = (lanes & -0x10000).to(tl.float32, bitcast=True)
    return tl.where(ok, xv * ESC_DECODED, 0.0), tl.where(ok, xv * w, 0.0)


@triton.jit
def lanes_gather(lanes, x_ptr, nw_ptr, rows_m, stride_xm, K, inv,
                 NORM: tl.constexpr, DTYPE: tl.constexpr, ROUND_BF16: tl.constexpr):
    """(x · 2^-15, x · w) [BM, BN, LANES] fp32 for the escapes in ``lanes`` (``lanes_load``), 0 in
    empty lanes (column 0xFFFF >= K): x at each lane's column (rows_m [BM, 1, 1]; NORM: normalised
    as the loop's x, with inv [BM, 1, 1] and the norm weight there). One memory round trip (x, from L2)."""
    xv, nw = _lanes_x(lanes, x_ptr, nw_ptr, rows_m, stride_xm, K, NORM)
    return _lanes_terms(lanes, xv, nw, K, inv, NORM, DTYPE, ROUND_BF16)


@triton.jit
def lanes_finish(acc, spur, esc, y_scale):
    """y [BM, BN] from the biased decode's sums acc [BM, BN, BW] and the escapes' terms
    (``lanes_gather``): y = (Σ acc - Σ x · 2^-15) · y_scale + Σ x · w, the 2^-15 the loop added for
    each escape taken back before the scale (as ``apply_escapes``). Both escape sums in one
    reduction; inf/NaN flow as IEEE has them (no one-hot product mixes rows here)."""
    spur, esc = tl.reduce((spur, esc), 2, _lane_sums)
    return (tl.sum(acc, axis=2) - spur) * y_scale + esc

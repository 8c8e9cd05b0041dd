"""Where the u12 kernels read W's planes and x: addresses in either layout, and loads in word order.

A weight's planes are int32 words of 4 sign/mantissa bytes and int16 words of their 4 codes, in
rows or in tiles (``U12Tensor.layout``, specpilot/formats/u12.py: each 16-row tile stores its
16-word groups row after row, so a warp's loads of a group are contiguous). ``row_words`` and
``col_words`` give a word's place in either; x is read in the same word order as four planes
(plane j: x[m, 4 w + j]), bf16 x as one int64 word of 4 a w.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..bf16_words import bf16x4_to_fp32
from .decode import decode_planes


@triton.jit
def row_words(rows, stride, TILED: tl.constexpr):
    """Where each row starts in a plane, in words: rows · stride; TILED (U12Tensor.layout "tiles"), its
    16-row tile's start plus its 16 words of a group (specpilot/formats/u12.py)."""
    if TILED:
        return (rows // 16) * (16 * stride) + (rows % 16) * 16
    else:
        return rows * stride


@triton.jit
def col_words(w, TILED: tl.constexpr):
    """Where word w of a row sits after the row's start: w; TILED, 256 words (16 rows) a 16-word
    group, so runs of 16 words stay contiguous."""
    if TILED:
        return (w // 16) * 256 + w % 16
    else:
        return w


@triton.jit
def x_planes(x_rows, offs_w, mask, X_WORDS: tl.constexpr, MASKED: tl.constexpr):
    """x[m, 4 w + j] for j = 0..3 as fp32. X_WORDS: bf16 x read as one int64 word per w (4 bf16),
    split in registers; else four strided element loads."""
    if X_WORDS:
        if MASKED:
            xw = tl.load(x_rows + offs_w, mask=mask, other=0)
        else:
            xw = tl.load(x_rows + offs_w)
        x0, x1, x2, x3 = bf16x4_to_fp32(xw)
    else:
        x_k = x_rows + 4 * offs_w
        if MASKED:
            x0 = tl.load(x_k, mask=mask, other=0.0).to(tl.float32)
            x1 = tl.load(x_k + 1, mask=mask, other=0.0).to(tl.float32)
            x2 = tl.load(x_k + 2, mask=mask, other=0.0).to(tl.float32)
            x3 = tl.load(x_k + 3, mask=mask, other=0.0).to(tl.float32)
        else:
            x0 = tl.load(x_k).to(tl.float32)
            x1 = tl.load(x_k + 1).to(tl.float32)
            x2 = tl.load(x_k + 2).to(tl.float32)
            x3 = tl.load(x_k + 3).to(tl.float32)
    return x0, x1, x2, x3


@triton.jit
def fma_planes(acc, sm_rows, code_rows, offs_w, mask, x0, x1, x2, x3, MASKED: tl.constexpr, ASM: tl.constexpr,
               TILED: tl.constexpr = False):
    """acc += Σ_j x_j · plane j of the decoded words offs_w of the rows sm_rows / code_rows (the
    rows' starts, ``row_words``)."""
    at = col_words(offs_w, TILED)
    if MASKED:
        s = tl.load(sm_rows + at, mask=mask, other=0)
        c = tl.load(code_rows + at, mask=mask, other=0).to(tl.int32)
    else:
        s = tl.load(sm_rows + at)
        c = tl.load(code_rows + at).to(tl.int32)
    w0, w1, w2, w3 = decode_planes(s, c, ASM)
    acc = tl.fma(x0, w0, acc)
    acc = tl.fma(x1, w1, acc)
    acc = tl.fma(x2, w2, acc)
    acc = tl.fma(x3, w3, acc)
    return acc

"""The u12 decode: sign/mantissa bytes and 4-bit exponent codes to bf16 or fp32 weights, in registers.

Two decodes, both exact. The scaled one (the tile and mma kernels): where the base's window holds
only normal finite exponents (1 <= base <= 240), a weight's exponent field is its code, so code c
decodes to the weight times 2^-(base-1) and an escape (code 0, byte 0) to +0.0; x is scaled by 2^64
once per element and the fp32 sum by 2^(base-65) once per output (powers of two: exact while
|x| < 2^64 and the scaled products stay normal). Other bases (0: a window reaching subnormals;
241: reaching inf/NaN) take the exact exponent ``code + (base - 1)``, code 0 mapped to 0.

The biased one (gemv2, the fused GEMV, hmma): the exponent field is 112 + code, the bias the
multiplies' addend, so a weight decodes to w · 2^(113-base), in [2^-14, 2), x is used as it is,
and the sums are scaled by 2^(base-113) once per output (``biased_scale``); an escape decodes to
2^-15, which the escape step takes back. Two weights a 32-bit register (``pair_patterns``): byte
permutes (prmt), multiply-adds that spread the code nibbles, one bit-select (lop3) a pair; inline
PTX on the GPU (ASM), a shift-and-mask emulation of the same bits under the interpreter.
"""

from __future__ import annotations

import triton
import triton.language as tl

from specpilot.formats.u12 import MAX_BASE

X_SCALE_LOG2 = 64  # the scaled decode scales x by 2^64
EXP_BIAS = 112  # the biased decode: exponent field 112 + code (biased_scale)
PAIR_BIAS = tl.constexpr((EXP_BIAS << 7) | (EXP_BIAS << 23))  # both halves of a pair register: 0x38003800
ESC_DECODED = tl.constexpr(2.0 ** (EXP_BIAS - 127))  # an escape (code 0, byte 0) in the biased decode: 2^-15


@triton.jit
def decode_pairs(s, c, TO_BF16: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr):
    """The scaled decode two weights per 32-bit op: bf16 patterns of weights (0, 2) and (1, 3).

    (s & 0x00FF00FF) · 0x0101 = [b2 b2 b0 b0], masked 0x807F807F: both signs and mantissas placed.
    (c & 0x0F0F) · 0x8080 puts c0 at bits 7..10 and c2 at 23..26 (the cross terms land in 15..19),
    masked 0x07800780: both exponent fields. About 3.5 integer ops a weight with the fp32 split.
    """
    p02 = (((s & 0x00FF00FF) * 0x0101) & -0x7F807F81) | (((c & 0x0F0F) * 0x8080) & 0x07800780)
    p13 = ((((s >> 8) & 0x00FF00FF) * 0x0101) & -0x7F807F81) | ((((c >> 4) & 0x0F0F) * 0x8080) & 0x07800780)
    if TO_BF16:
        w0 = p02.to(tl.int16).to(tl.bfloat16, bitcast=True)
        w2 = (p02 >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)
        w1 = p13.to(tl.int16).to(tl.bfloat16, bitcast=True)
        w3 = (p13 >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)
    else:
        w0 = (p02 << 16).to(tl.float32, bitcast=True)
        w2 = (p02 & -0x10000).to(tl.float32, bitcast=True)
        w1 = (p13 << 16).to(tl.float32, bitcast=True)
        w3 = (p13 & -0x10000).to(tl.float32, bitcast=True)
    w = tl.join(tl.join(w0, w2), tl.join(w1, w3))  # [BN, BW, a, b] holds weight 4 w + 2 a + b
    return tl.reshape(w, (BLOCK_N, 4 * BLOCK_W))


@triton.jit
def decode_words(
    s, c, base, SCALED: tl.constexpr, PAIRS: tl.constexpr, TO_BF16: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr,
):
    """[BN, BW] int32 words of 4 sign/mantissa bytes and their 4 codes -> [BN, 4 BW] weights in k order.

    SCALED: exponent field = code (weight · 2^-(base-1); escapes, code 0 and byte 0, are +0.0),
    by pairs (PAIRS) or one weight per 32-bit op. Else the exact exponent code + base - 1, 0 for code 0.
    """
    if SCALED and PAIRS:
        return decode_pairs(s, c, TO_BF16, BLOCK_N, BLOCK_W)
    j = tl.arange(0, 4)
    b = (s[:, :, None] >> (8 * j)[None, None, :]) & 0xFF
    code = (c[:, :, None] >> (4 * j)[None, None, :]) & 0xF
    if SCALED:
        e = code
    else:
        e = code + (base - 1) * tl.minimum(code, 1)
    # b · 0x0101 repeats the byte, so one mask puts the sign in the top bit and the mantissa in the
    # low 7 (the multiply runs on the FMA pipe, beside the integer ALU that the decode is bound by).
    if TO_BF16:
        w = (((b * 0x0101) & 0x807F) | (e << 7)).to(tl.int16).to(tl.bfloat16, bitcast=True)
    else:
        w = (((b * 0x01010000) & -0x7F810000) | (e << 23)).to(tl.float32, bitcast=True)  # mask 0x807F0000
    return tl.reshape(w, (BLOCK_N, 4 * BLOCK_W))


@triton.jit
def prmt(a, b, SELECTOR: tl.constexpr, ASM: tl.constexpr):
    """PTX ``prmt.b32`` in its default mode: byte i of the result is byte ``(SELECTOR >> 4 i) & 7``
    of the pair {b, a} (bytes 0-3 from a, 4-7 from b). ASM: the instruction; else the same bytes by
    shifts and masks (the interpreter runs no inline assembly). Selectors here never set bit 3 (the
    sign-replicating form)."""
    if ASM:
        return tl.inline_asm_elementwise(
            f"prmt.b32 $0, $1, $2, {SELECTOR};", "=r,r,r", [a, b], dtype=tl.int32, is_pure=True, pack=1,
        )
    else:
        out = tl.zeros_like(a)
        for i in tl.static_range(4):  # no constexpr assignment in the loop: Triton 3.6 refuses its reassignment
            src = a if ((SELECTOR >> (4 * i)) & 7) < 4 else b
            out |= ((src >> (8 * ((SELECTOR >> (4 * i)) & 3))) & 0xFF) << (8 * i)
        return out


@triton.jit
def select_bits(mask_src, other, MASK: tl.constexpr, ASM: tl.constexpr):
    """Bits of ``mask_src`` where MASK is 1, of ``other`` elsewhere. ASM: one ``lop3.b32``; LLVM
    turns the portable form into two LOP3s (one per constant), seen in the sm_90 SASS."""
    if ASM:
        return tl.inline_asm_elementwise(
            f"lop3.b32 $0, $1, $2, {MASK}, 0xE4;", "=r,r,r", [mask_src, other], dtype=tl.int32, is_pure=True, pack=1,
        )
    else:
        return other ^ ((other ^ mask_src) & MASK)


@triton.jit
def pair_patterns(s, c, ASM: tl.constexpr, BIASED: tl.constexpr = True):
    """The bf16 bit patterns of weights (0, 2) (low, high half) and (1, 3) of each word, biased decode
    (``decode_planes`` says how); BIASED off: exponent field = code, the tile and mma kernels' scaled
    decode (escapes +0.0, weight times 2^-(base-1))."""
    if BIASED:
        e02 = (c & 0x0F0F) * 0x8080 + PAIR_BIAS  # one IMAD: the bias is the multiply's addend
        e13 = (c & 0xF0F0) * 0x0808 + PAIR_BIAS
    else:
        e02 = (c & 0x0F0F) * 0x8080
        e13 = (c & 0xF0F0) * 0x0808
    p02 = select_bits(e02, prmt(s, s, 0x2200, ASM), 0x7F807F80, ASM)
    p13 = select_bits(e13, prmt(s, s, 0x3311, ASM), 0x7F807F80, ASM)
    return p02, p13


@triton.jit
def decode_planes(s, c, ASM: tl.constexpr, BIASED: tl.constexpr = True):
    """The biased decode of int32 words ``s`` (4 sign/mantissa bytes) and their int16 code words
    ``c`` (4 nibbles) into four fp32 planes, plane j holding weight 4 w + j times 2^(113-base)
    (exponent field 112 + code; an escape, code 0 and byte 0, is 2^-15); no join or reshape, so no
    layout change.

    The bf16 patterns of weights (0, 2) and (1, 3) are built in one 32-bit register each:
    prmt repeats bytes ([b2 b2 b0 b0]: sign at bit 15, mantissa at bits 0-6 of each half),
    (c & 0x0F0F) · 0x8080 + 0x38003800 puts code 0 at bits 7-10 and code 2 at bits 23-26 with the
    bias 112 = 0b1110000 beside each (bits 11-13, 27-29; the cross terms land in bits 15-19), and one
    bit-select takes both exponent fields (mask 0x7F807F80) from there. 12 integer ops a word of 4
    weights: 2 masks, 2 multiply-adds, 2 prmt, 2 bit-selects, 4 to split the pairs to fp32.
    """
    p02, p13 = pair_patterns(s, c, ASM, BIASED)
    w0 = (p02 << 16).to(tl.float32, bitcast=True)
    w1 = (p13 << 16).to(tl.float32, bitcast=True)
    w2 = (p02 & -0x10000).to(tl.float32, bitcast=True)
    w3 = (p13 & -0x10000).to(tl.float32, bitcast=True)
    return w0, w1, w2, w3


def scaled_decode(base: int) -> tuple[bool, float, float, float]:
    """(scaled, x scale, y scale lo, y scale hi): y = (x 2^64 · w 2^-(base-1)) 2^(base-65)."""
    if not 1 <= base <= MAX_BASE - 1:
        return False, 1.0, 1.0, 1.0
    q = base - 1 - X_SCALE_LOG2  # in -64 .. 175: two factors keep each within fp32
    lo = min(q, 100)
    return True, 2.0**X_SCALE_LOG2, 2.0**lo, 2.0 ** (q - lo)


def biased_scale(base: int) -> float:
    """y's scale in the biased decode (gemv2, u12_fused_linear; 1 <= base <= 240): a weight
    decodes to w' = w · 2^(113-base), so y = (Σ x w') · 2^(base-113), a normal fp32 for every such base."""
    return 2.0 ** (base - 1 - EXP_BIAS)


def words_and_scales(k: int, base: int) -> bool:
    """Whether a weight can run the gemv2, mma and hmma kernels: word loads (K % 4 == 0) and a base
    their decodes scale back exactly (1 <= base <= 240)."""
    return k > 0 and k % 4 == 0 and scaled_decode(base)[0]

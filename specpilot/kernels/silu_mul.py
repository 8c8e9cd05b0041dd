"""SwiGLU's elementwise middle: silu(gate) · up from the fused gate|up projection output.

`silu_mul(gate_up)`: gate_up [..., 2·I] (gate the first half of the last dim, up the second)
-> [..., I], as model.MLP computes F.silu(gate) * up: silu in fp32 (x / (1 + exp(-x))) rounded
to the dtype, then the product in fp32 rounded to the dtype.

Numerics: both rounding points are torch's, the division is IEEE (div_rn) and, on the GPU, exp is
libdevice's expf, which is what CUDA's expf in torch's silu compiles to: bit-exact on the GPU in
every dtype as far as we know (not yet run on one: the fused-kernel CUDA-graph test checks within a
step). The interpreter has no libdevice and uses numpy's exp: there bf16 matched bit for bit and
fp32 to an ulp or two.

Launch: 1-D over the I output columns in BLOCK = 1024 tiles (grid rows × cdiv(I, 1024)),
4 warps. Untuned: no GPU measurement yet. CUDA graphs: no host sync; the grid is shape-only.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.language.extra import libdevice

from .overlap import Launch, pdl_args, pdl_enter
from .registry import KernelSpec, register
from .rounding import round_bf16
from .target import native as on_native

BLOCK = 1024


@triton.jit
def _silu_mul_kernel(
    gu_ptr, out_ptr, I, stride_gu, stride_out,
    BLOCK: tl.constexpr, ROUND_BF16: tl.constexpr,  # bf16 under the interpreter: round before casting
    EXPF: tl.constexpr,  # libdevice's expf, CUDA's (the interpreter has no libdevice)
    PDL: tl.constexpr,  # programmatic dependent launch (kernels/overlap.py)
):
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < I
    gate = tl.load(gu_ptr + row * stride_gu + cols, mask=ok, other=0.0)
    up = tl.load(gu_ptr + row * stride_gu + I + cols, mask=ok, other=0.0)
    g = gate.to(tl.float32)
    if EXPF:
        e = libdevice.exp(-g)
    else:
        e = tl.exp(-g)
    s = tl.math.div_rn(g, 1.0 + e)
    if ROUND_BF16:
        s = round_bf16(s)
    y = s.to(gate.dtype).to(tl.float32) * up.to(tl.float32)
    if ROUND_BF16:
        y = round_bf16(y)
    tl.store(out_ptr + row * stride_out + cols, y.to(out_ptr.dtype.element_ty), mask=ok)


def silu_mul(gate_up: torch.Tensor, *, launch: Launch | None = None) -> torch.Tensor:
    """gate_up [..., 2·I] -> silu(gate_up[..., :I]) · gate_up[..., I:], [..., I] in the same dtype.
    `launch`: PDL (kernels/overlap.py)."""
    two_i = gate_up.shape[-1]
    if two_i % 2:
        raise ValueError(f"silu_mul: the last dim must be 2·I (gate then up), got {two_i}")
    if gate_up.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"silu_mul: gate_up must be float32/bfloat16/float16, got {gate_up.dtype}")
    i = two_i // 2
    out = torch.empty((*gate_up.shape[:-1], i), dtype=gate_up.dtype, device=gate_up.device)
    if out.numel() == 0:
        return out
    gu = gate_up.reshape(-1, two_i) if gate_up.stride(-1) == 1 else gate_up.contiguous().view(-1, two_i)
    out2 = out.view(-1, i)
    native = on_native(gate_up)
    _silu_mul_kernel[(gu.shape[0], triton.cdiv(i, BLOCK))](
        gu, out2, i, gu.stride(0), out2.stride(0),
        BLOCK=BLOCK, ROUND_BF16=not native and gate_up.dtype == torch.bfloat16, EXPF=native,
        **(dict(num_warps=4, enable_fp_fusion=False) if native else {}), **pdl_args(gate_up.device, launch),
    )
    return out


def silu_mul_reference(gate_up: torch.Tensor, *, launch: Launch | None = None) -> torch.Tensor:
    """model.MLP's F.silu(gate) * up; `launch` is the kernel's argument, unused here."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


# --- registry entry -------------------------------------------------------------------------

def _make_inputs(case, device, seed):
    g = torch.Generator().manual_seed(seed)
    x = 3 * torch.randn(case["rows"], 2 * case["I"], generator=g)
    return (x.to(case["dtype"]).to(device),)


def _plant(inputs):
    """One up element with its sign flipped."""
    (x,) = inputs
    x = x.clone()
    x[0, -1] = -x[0, -1] if x[0, -1] != 0 else 1.0
    return (x,)


F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16

register(KernelSpec(
    name="silu_mul",
    run=silu_mul,
    reference=silu_mul_reference,
    make_inputs=_make_inputs,
    cases=[
        {"rows": 3, "I": 200, "dtype": F32},
        {"rows": 5, "I": 1031, "dtype": BF16},  # two column tiles, the second ragged
        {"rows": 1, "I": 7, "dtype": F16},
    ],
    # silu one ulp off (module docstring), one rounding step of the dtype after the product.
    tolerance={F32: (1e-6, 1e-6), BF16: (0.0, 2 ** -7), F16: (0.0, 2 ** -10)},
    corrupt=_plant,
    description="silu(gate) · up from the fused gate|up projection output",
))

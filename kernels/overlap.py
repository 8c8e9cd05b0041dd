"""How a kernel overlaps its neighbours: programmatic dependent launch and L2 prefetch of weights.

PDL: the next kernel starts while this one drains.

A decode step is a chain of about 250 short kernels, each depending on the one before. Launched
the plain way, a kernel's programs are scheduled only once the previous kernel has finished and
its memory is flushed: a gap of a few microseconds at every boundary, where the GPU reads no
weights. On Hopper (sm_90) and later, a kernel launched with ``launch_pdl=True`` may be scheduled
while the previous one still runs. Each kernel that takes the ``PDL`` flag opens with
``pdl_enter``: ``gdc_launch_dependents`` (PTX ``griddepcontrol.launch_dependents``: the kernel after
this one may be scheduled once every program here has reached this point), then ``gdc_wait``
(``griddepcontrol.wait``: block until the kernel before has completed and its writes are
visible). Every load and store of such a kernel comes after the wait, so the order of memory
effects is the plain launch's; what overlaps is scheduling and launch latency (the waiting
programs hold their SM slots, which only the last wave of the kernel before leaves free). A
kernel launched plainly after a PDL kernel waits for it as usual, and a PDL kernel after a plain
one (a torch op) is released when that kernel's programs exit, so the mix is safe. CUDA graphs
capture the launches as programmatic edges (CUDA 12.3+).

``pdl_options(device)`` gives a launch's ``PDL`` flag and options: on where the device is a CUDA
GPU of compute capability 9.0 or more (not under TRITON_INTERPRET=1, which has no
griddepcontrol), unless ``SPECPILOT_PDL=0`` or inside ``overlap_off()`` (benchmarks compare both).

L2 prefetch: a latency-bound kernel (RoPE, attention: a few MB of KV and microseconds of
dependent steps) leaves DRAM idle, while the GEMV after it reads its weights from DRAM. Given a
weight (``prefetch_args``), such a kernel's programs issue ``cp.async.bulk.prefetch.L2`` over
their share of the weight's bytes before anything else (before the PDL wait: weights do not
depend on the kernel before), so the bytes stream into L2 while the kernel runs and the GEMV
then reads them from L2. Exact (a prefetch moves no value); only where the weight fits in L2
with room to spare (``MAX_PREFETCH_BYTES``), and only on sm_90+ (the bulk prefetch is Hopper's);
not with ``SPECPILOT_PREFETCH=0`` or inside ``overlap_off()``.
"""

from __future__ import annotations

import functools
import os
from contextlib import contextmanager

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

_pdl_off = _prefetch_off = 0  # overlap_off() depth


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def pdl_capable(device: torch.device) -> bool:
    """A CUDA GPU of compute capability 9.0+, outside the interpreter (griddepcontrol, bulk prefetch)."""
    if device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    return _capability(device.index if device.index is not None else torch.cuda.current_device()) >= (9, 0)


def pdl_enabled(device: torch.device) -> bool:
    """Whether kernels on `device` launch with PDL now."""
    return not _pdl_off and os.environ.get("SPECPILOT_PDL", "1") != "0" and pdl_capable(device)


def pdl_options(device: torch.device) -> tuple[bool, dict]:
    """(the kernel's PDL flag, its extra launch options) for a launch on `device`."""
    on = pdl_enabled(device)
    return on, ({"launch_pdl": True} if on else {})


@contextmanager
def overlap_off(pdl: bool = True, prefetch: bool = True):
    """Launches inside use no PDL (`pdl`) and no L2 prefetch (`prefetch`); graphs captured inside keep that."""
    global _pdl_off, _prefetch_off
    _pdl_off, _prefetch_off = _pdl_off + pdl, _prefetch_off + prefetch
    try:
        yield
    finally:
        _pdl_off, _prefetch_off = _pdl_off - pdl, _prefetch_off - prefetch


# Prefetch at most this many bytes: a third of the H200's 50 MB L2 (the GEMV's weight must still be
# there when it runs; Llama-3.1-8B's o_proj is 32 MiB in bf16, 24 in u12).
MAX_PREFETCH_BYTES = 40 << 20


def prefetch_args(device: torch.device, weights) -> tuple[int, int, int, int, int]:
    """(the kernel's PREFETCH flag: ranges 0-2, address, bytes, address, bytes) to prefetch
    `weights` (a tensor, a few, or None; a u12 weight's planes) into L2: each one's bytes rounded
    down to 16-byte units, when all are contiguous, 16-byte aligned, on `device`, and no larger
    than MAX_PREFETCH_BYTES together; else none."""
    none = (0, 0, 0, 0, 0)
    if weights is None or _prefetch_off or os.environ.get("SPECPILOT_PREFETCH", "1") == "0":
        return none
    weights = [weights] if isinstance(weights, torch.Tensor) else list(weights)
    if not 1 <= len(weights) <= 2 or not pdl_capable(device):
        return none
    ranges = []
    for w in weights:
        if w.device != device or not w.is_contiguous() or w.data_ptr() % 16:
            return none
        ranges += [w.data_ptr(), w.numel() * w.element_size() // 16 * 16]
    if not 0 < sum(ranges[1::2]) <= MAX_PREFETCH_BYTES:
        return none
    return (len(weights), *ranges, *none[: 4 - len(ranges)])


@triton.jit
def _prefetch_l2(addr, nbytes, pid, programs, SLICES: tl.constexpr):
    """Program `pid` of `programs` asks L2 for its share of bytes [addr, addr + nbytes) (nbytes a
    multiple of 16), cut into SLICES bulk prefetches (one a thread where SLICES is the thread count)."""
    per_program = tl.cdiv(nbytes, programs * 16) * 16
    per_slice = tl.cdiv(per_program, SLICES * 16) * 16
    lo = pid.to(tl.int64) * per_program + tl.arange(0, SLICES).to(tl.int64) * per_slice
    hi = tl.minimum(lo + per_slice, tl.minimum(pid.to(tl.int64) * per_program + per_program, nbytes))
    size = tl.maximum(hi - lo, 0).to(tl.int32)
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.gt.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.b32 $0, 0; }",
        "=r,l,r", [addr + lo, size], dtype=tl.int32, is_pure=False, pack=1,
    )


@triton.jit
def overlap_enter(
    PDL: tl.constexpr, PREFETCH: tl.constexpr, addr0, bytes0, addr1, bytes1, pid, programs, SLICES: tl.constexpr,
):
    """pdl_enter with an L2 prefetch of PREFETCH (0-2) weight ranges (``prefetch_args``) between its two steps."""
    if PDL:
        gdc_launch_dependents()
    if PREFETCH >= 1:
        _prefetch_l2(addr0, bytes0, pid, programs, SLICES)
    if PREFETCH >= 2:
        _prefetch_l2(addr1, bytes1, pid, programs, SLICES)
    if PDL:
        gdc_wait()


@triton.jit
def pdl_enter(PDL: tl.constexpr):
    """A PDL kernel's first step (the module docstring says why this order); nothing without PDL."""
    if PDL:
        gdc_launch_dependents()
        gdc_wait()

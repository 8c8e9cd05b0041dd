"""How a kernel launch overlaps its neighbours: programmatic dependent launch (PDL) and L2 prefetch.

A decode step is a chain of about 250 short kernels, each depending on the one before; launched
the plain way, each waits for the one before to finish and flush before its programs are
scheduled. `Launch` is the frozen setting every kernel entry point takes (``launch=``):

- ``pdl``: on sm_90+, the kernel is launched with ``launch_pdl`` and opens with ``pdl_enter``:
  mode 1 triggers the next kernel's launch (``griddepcontrol.launch_dependents``) and then waits
  for the kernel before (``griddepcontrol.wait``); mode 2 only waits (the next kernel launches as
  this one's programs exit). Every load and store comes after the wait, so memory effects are the
  plain launch's; what overlaps is scheduling and launch latency. CUDA graphs keep the launches'
  programmatic edges.
- ``prefetch``: a latency-bound kernel that is given the next GEMV's weight (rope_qkv's
  ``prefetch=``) asks L2 for its share of those bytes (``cp.async.bulk.prefetch.L2``) before its
  PDL wait. Exact: a prefetch moves no value.

Both need a CUDA GPU of compute capability 9.0+ and no interpreter; elsewhere they are off.
Measurements: docs/experiments/pdl-and-prefetch.md.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@dataclass(frozen=True)
class Launch:
    """A kernel launch's overlap with its neighbours (module docstring)."""

    # 0 plain (the default: the bf16 step was fastest so, step_times_h200_llama.json); 1 trigger
    # then wait; 2 wait only (a u12 stack's few-row forwards: step_ab_h200.json, u12-pdl-wait)
    pdl: int = 0
    # L2 prefetch of a given weight before the PDL wait; off: slower in the graphed AR step
    # (step_times_h200_llama.json), kept to re-measure at other shapes
    prefetch: bool = False

    def __post_init__(self) -> None:
        if self.pdl not in (0, 1, 2) or isinstance(self.pdl, bool):
            raise ValueError(f"Launch.pdl: expected 0 (off), 1 (trigger, then wait) or 2 (wait only), got {self.pdl!r}")
        if not isinstance(self.prefetch, bool):
            raise ValueError(f"Launch.prefetch: expected a bool, got {self.prefetch!r}")


PLAIN = Launch()


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def pdl_capable(device: torch.device) -> bool:
    """A CUDA GPU of compute capability 9.0+, outside the interpreter (griddepcontrol, bulk prefetch)."""
    if device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    return _capability(_index(device)) >= (9, 0)


def pdl_mode(device: torch.device, launch: Launch | None) -> int:
    """The PDL mode a launch on `device` runs in: `launch`'s where the GPU has PDL, else 0."""
    return (launch or PLAIN).pdl if pdl_capable(device) else 0


def pdl_args(device: torch.device, launch: Launch | None) -> dict:
    """A launch's PDL keywords on `device`: the kernel's ``PDL`` flag, and ``launch_pdl`` when on."""
    mode = pdl_mode(device, launch)
    return {"PDL": mode, **({"launch_pdl": True} if mode else {})}


# Prefetch at most this many bytes, of the H200's 50 MB L2 (the GEMV's weight must still be there
# when it runs; Llama-3.1-8B's o_proj is 32 MiB in bf16, 24 in u12).
MAX_PREFETCH_BYTES = 40 << 20


def prefetch_args(device: torch.device, weights, launch: Launch | None) -> tuple[int, int, int, int, int]:
    """(the kernel's PREFETCH flag: ranges 0-2, address, bytes, address, bytes) to prefetch `weights`
    (a tensor, a few, or None; a u12 weight's planes) into L2 where `launch` asks: each one's bytes
    rounded down to 16-byte units, when all are contiguous, 16-byte aligned, on `device`, and no
    larger than MAX_PREFETCH_BYTES together; else none."""
    none = (0, 0, 0, 0, 0)
    if weights is None or not (launch or PLAIN).prefetch:
        return none
    weights = [weights] if isinstance(weights, torch.Tensor) else list(weights)
    if not 1 <= len(weights) <= 2 or not pdl_capable(device):
        return none
    ranges = []
    for w in weights:
        if w.device.type != "cuda" or _index(w.device) != _index(device) or not w.is_contiguous() or w.data_ptr() % 16:
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
    """pdl_enter with an L2 prefetch of PREFETCH (0-2) weight ranges (``prefetch_args``) before the wait."""
    if PDL == 1:
        gdc_launch_dependents()
    if PREFETCH >= 1:
        _prefetch_l2(addr0, bytes0, pid, programs, SLICES)
    if PREFETCH >= 2:
        _prefetch_l2(addr1, bytes1, pid, programs, SLICES)
    if PDL >= 1:
        gdc_wait()


@triton.jit
def pdl_enter(PDL: tl.constexpr):
    """A PDL kernel's first step: mode 1 lets the next kernel launch, then (modes 1, 2) waits for
    the kernel before; nothing in mode 0."""
    if PDL == 1:
        gdc_launch_dependents()
    if PDL >= 1:
        gdc_wait()

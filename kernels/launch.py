"""Programmatic dependent launch (PDL): the next kernel starts while this one drains.

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
griddepcontrol), unless ``SPECPILOT_PDL=0`` or inside ``pdl_disabled()`` (benchmarks compare both).
"""

from __future__ import annotations

import functools
import os
from contextlib import contextmanager

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

_disabled = 0


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def pdl_enabled(device: torch.device) -> bool:
    """Whether kernels on `device` launch with PDL now."""
    if _disabled or device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    if os.environ.get("SPECPILOT_PDL", "1") == "0":
        return False
    return _capability(device.index if device.index is not None else torch.cuda.current_device()) >= (9, 0)


def pdl_options(device: torch.device) -> tuple[bool, dict]:
    """(the kernel's PDL flag, its extra launch options) for a launch on `device`."""
    on = pdl_enabled(device)
    return on, ({"launch_pdl": True} if on else {})


@contextmanager
def pdl_disabled():
    """Launches inside use no PDL (graphs captured inside keep plain launches)."""
    global _disabled
    _disabled += 1
    try:
        yield
    finally:
        _disabled -= 1


@triton.jit
def pdl_enter(PDL: tl.constexpr):
    """A PDL kernel's first step (the module docstring says why this order); nothing without PDL."""
    if PDL:
        gdc_launch_dependents()
        gdc_wait()

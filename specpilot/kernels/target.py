"""Where a kernel launch runs: the GPU's own code, the interpreter's emulation, or compiled only.

``native(device)``: whether launches on `device` take the GPU's paths (inline PTX, libdevice, fp
fusion, register caps, the GPU's tile configs): a CUDA device outside ``TRITON_INTERPRET=1``, or
any device inside ``compile_only``. Every kernel wrapper asks this, so the two modes below see
the same launches a GPU would.

``compile_only(arch)``: inside it every Triton launch compiles its kernel for that NVIDIA GPU
(Triton's bundled ptxas; no GPU, no driver) and returns without running it; CPU tensors stand for
the GPU's (their shapes, dtypes, strides and 16-byte alignment decide the specialization, as on
the GPU) and each launch is recorded as a ``Compiled`` (the kernel, its constexprs and the
cubin). What runs around the launches (torch ops on the outputs, split-K sums) runs on the CPU
over unwritten memory: meaningless values, never read. For static checks of what the GPU would
run, on a machine without one: registers, spills, shared memory, the SASS of the loop
(bench.kernels.kernel_static, tests/test_kernel_static.py). Triton must have been imported without
the interpreter: under ``TRITON_INTERPRET=1`` a kernel is not compiled at all.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

_compile_only: list["_Recorder"] = []  # the active compile_only context, innermost last


def native(device: torch.device | torch.Tensor) -> bool:
    """Whether a launch on `device` (or a tensor's) runs the GPU's code: see the module docstring."""
    if _compile_only:
        return True
    device = device.device if isinstance(device, torch.Tensor) else device
    return device.type == "cuda" and os.environ.get("TRITON_INTERPRET") != "1"


@dataclass
class Compiled:
    """One launch compiled by ``compile_only``."""

    name: str  # the kernel function's name
    constexprs: dict[str, object]  # its constexpr arguments by name (BLOCK_*, flags)
    num_warps: int
    shared: int  # bytes of shared memory Triton reserved
    cubin: bytes


class _Recorder:
    def __init__(self) -> None:
        self.compiled: list[Compiled] = []
        self.functions: list = []  # the JITFunctions that compiled here (their caches are cleaned on exit)


class _TargetDriver:
    """The least of Triton's driver that compiling needs: a target, a device and a stream."""

    def __init__(self, target) -> None:
        self.target = target

    def get_current_target(self):
        return self.target

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device=None) -> int:
        return 0

    def __getattr__(self, name: str):
        raise RuntimeError(f"compile_only: Triton asked the driver for {name!r}, which compiling does not use")


@contextmanager
def compile_only(arch: int = 90) -> Iterator[list[Compiled]]:
    """Launches inside compile for ``sm_<arch>`` without running (see the module docstring);
    yields the list the launches are appended to."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise RuntimeError("compile_only: TRITON_INTERPRET=1 is set, so Triton interprets kernels and compiles none; "
                           "run in a process without it")
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction

    recorder = _Recorder()
    plain_run = JITFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        kernel = plain_run(self, *args, grid=grid, warmup=True, **kwargs)
        names = [p.name for p in self.params]
        bound = dict(zip(names, args)) | {k: v for k, v in kwargs.items() if k in names}
        constexprs = {p.name: bound[p.name] for p in self.params if p.is_constexpr and p.name in bound}
        recorder.compiled.append(Compiled(self.__name__, constexprs, kernel.metadata.num_warps,
                                          kernel.metadata.shared, kernel.asm["cubin"]))
        if self not in recorder.functions:
            recorder.functions.append(self)
        return kernel

    previous = driver._active  # None until a launch asks for one: restored as it was, not created
    driver.set_active(_TargetDriver(GPUTarget("cuda", arch, 32)))
    JITFunction.run = run
    _compile_only.append(recorder)
    try:
        yield recorder.compiled
    finally:
        _compile_only.pop()
        JITFunction.run = plain_run
        driver._active = previous
        for fn in recorder.functions:  # device 0's binder and kernels were this target's, not a GPU's
            fn.device_caches.pop(0, None)

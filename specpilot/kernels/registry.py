"""A registry of Triton kernels, each beside its torch reference.

One generic test (tests/test_kernels.py) walks ``KERNELS``: for every kernel and every case it
compares ``run`` with ``reference`` within the kernel's tolerance for the output dtype, and,
where the kernel gives ``corrupt``, checks that a planted error is caught by that tolerance.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

Case = Mapping[str, Any]


@dataclass(frozen=True)
class KernelSpec:
    """A kernel, its reference and how to test it.

    ``make_inputs(case, device, seed)`` returns the positional arguments of both ``run`` and
    ``reference``; ``cases`` should include odd shapes; ``tolerance`` maps the output dtype to
    ``(atol, rtol)``; ``corrupt(inputs)``, if given, returns inputs with one planted error that
    the tolerance must detect.
    """

    name: str
    run: Callable[..., torch.Tensor]
    reference: Callable[..., torch.Tensor]
    make_inputs: Callable[[Case, torch.device | str, int], tuple]
    cases: Sequence[Case]
    tolerance: Mapping[torch.dtype, tuple[float, float]]
    corrupt: Callable[[tuple], tuple] | None = None
    description: str = field(default="", compare=False)


KERNELS: dict[str, KernelSpec] = {}


def register(spec: KernelSpec) -> KernelSpec:
    """Add ``spec`` to ``KERNELS``; names are unique."""
    if spec.name in KERNELS and KERNELS[spec.name] is not spec:
        raise ValueError(f"kernel {spec.name!r} is already registered")
    if not spec.cases:
        raise ValueError(f"kernel {spec.name!r}: no test cases")
    KERNELS[spec.name] = spec
    return spec


def check_kernel(spec: KernelSpec, device: torch.device | str = "cpu", seed: int = 1234) -> list[str]:
    """What tests/test_kernels.py checks of a registered kernel, as problems (empty: it passes): on
    every case the kernel matches its reference within the tolerance of the output dtype, and where
    it plants an error, the tolerance catches it. For a plugin's own test suite."""
    problems = []
    for i, case in enumerate(spec.cases):
        inputs = spec.make_inputs(case, device, seed + i)
        out, ref = spec.run(*inputs), spec.reference(*inputs)
        if out.dtype != ref.dtype or out.shape != ref.shape:
            problems.append(f"{spec.name} case {dict(case)}: gives {out.dtype} {tuple(out.shape)}, the reference "
                            f"{ref.dtype} {tuple(ref.shape)}")
            continue
        atol, rtol = spec.tolerance[ref.dtype]
        if not torch.allclose(out, ref, atol=atol, rtol=rtol, equal_nan=True):
            problems.append(f"{spec.name} case {dict(case)}: differs from its reference by "
                            f"{(out.float() - ref.float()).abs().nan_to_num().max().item():.3g} (atol {atol}, rtol {rtol})")
        if spec.corrupt is not None:
            planted = spec.run(*spec.corrupt(inputs))
            if torch.allclose(planted, ref, atol=atol, rtol=rtol, equal_nan=True):
                problems.append(f"{spec.name} case {dict(case)}: a planted error passes the tolerance")
    return problems

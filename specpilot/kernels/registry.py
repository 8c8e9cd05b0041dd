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

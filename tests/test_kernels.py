"""Every registered kernel against its torch reference, on every case of its spec.

On a machine without CUDA the kernels run in Triton's interpreter (TRITON_INTERPRET=1 must be
set before the kernel modules are imported, which this module does); with CUDA they run natively.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

from specpilot.kernels import KERNELS  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# inf/NaN weights are planted on purpose; the interpreter's numpy warns about them.
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")

CASES = [(name, i) for name, spec in KERNELS.items() for i in range(len(spec.cases))]
CORRUPTIBLE = [(name, i) for name, i in CASES if KERNELS[name].corrupt is not None]


def _case_id(param):
    name, i = param
    return f"{name}-{'-'.join(str(v) for v in KERNELS[name].cases[i].values())}"


def _close(spec, out, ref) -> bool:
    atol, rtol = spec.tolerance[ref.dtype]
    try:
        torch.testing.assert_close(out, ref, atol=atol, rtol=rtol, equal_nan=True)
    except AssertionError:
        return False
    return True


@pytest.mark.parametrize("param", CASES, ids=_case_id)
def test_kernel_matches_reference(param):
    name, i = param
    spec = KERNELS[name]
    inputs = spec.make_inputs(spec.cases[i], DEVICE, 1234 + i)
    out, ref = spec.run(*inputs), spec.reference(*inputs)
    assert out.dtype == ref.dtype and out.shape == ref.shape
    atol, rtol = spec.tolerance[ref.dtype]
    torch.testing.assert_close(out, ref, atol=atol, rtol=rtol, equal_nan=True)


@pytest.mark.parametrize("param", CORRUPTIBLE, ids=_case_id)
def test_tolerance_catches_planted_error(param):
    name, i = param
    spec = KERNELS[name]
    inputs = spec.make_inputs(spec.cases[i], DEVICE, 1234 + i)
    out = spec.run(*spec.corrupt(inputs))
    assert not _close(spec, out, spec.reference(*inputs)), "a planted error passed the tolerance"


def test_every_kernel_has_odd_cases():
    for spec in KERNELS.values():
        assert any(any(v % 2 for v in case.values() if isinstance(v, int)) for case in spec.cases), spec.name

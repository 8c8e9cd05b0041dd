"""Every registered kernel against its torch reference, on every case of its spec.

On a machine without CUDA the kernels run in Triton's interpreter (TRITON_INTERPRET=1,
set by conftest.py before any kernel module is imported); with CUDA they run natively.
"""

import pytest
import torch

from conftest import DEVICE
from specpilot.kernels import KERNELS

# inf/NaN weights are planted on purpose; the interpreter's numpy warns about them.
pytestmark = [pytest.mark.interpreter, pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")]

CASES = [(name, i) for name, spec in KERNELS.items() for i in range(len(spec.cases))]


def _planted_cases() -> list[tuple[str, int]]:
    """A kernel's tolerance is per output dtype: a planted error is run on the first and the last case
    of each dtype of each kernel that plants one (the last cases are the large and odd shapes)."""
    out = []
    for name, spec in KERNELS.items():
        if spec.corrupt is None:
            continue
        by_dtype: dict[str, list[int]] = {}
        for i, case in enumerate(spec.cases):
            by_dtype.setdefault(str(case.get("dtype")), []).append(i)
        out += [(name, i) for ids in by_dtype.values() for i in sorted({ids[0], ids[-1]})]
    return out


CORRUPTIBLE = _planted_cases()


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


@pytest.mark.parametrize("k,base", [(33, None), (64, None), (64, 0), (40, 241)])
def test_u12_linear_decodes_bit_exactly(k, base):
    """With x = I (fp32) each output is one weight times 1 plus zeros: the decode must be exact."""
    from specpilot.formats.u12 import pack_u12, unpack_u12
    from specpilot.kernels.u12 import u12_linear

    g = torch.Generator().manual_seed(k)
    w = (torch.randn(37, k, generator=g) * 0.02).to(torch.bfloat16)
    flat = w.view(torch.int16).view(-1)
    flat[::7] = torch.randint(-0x8000, 0x8000, (len(flat[::7]),), generator=g, dtype=torch.int16)  # any pattern
    t = pack_u12(w, base=base).to(DEVICE)
    x = torch.eye(k, device=DEVICE)
    y = u12_linear(x, t)
    ref = x @ unpack_u12(t).float().T  # same 0·inf = NaN as the kernel where a weight is inf or NaN
    finite = torch.isfinite(ref)
    assert torch.equal(y[finite].view(torch.int32), ref[finite].view(torch.int32))
    assert torch.equal(y.isnan(), ref.isnan()) and torch.equal(y[ref.isinf()], ref[ref.isinf()])

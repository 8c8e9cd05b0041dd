"""The hmma kernel past 16 rows (kernels/u12/hmma.py's ``hmma_rows`` and ``MAX_M``): row blocks side by side.

Apart from tests/test_u12_hmma.py so that the two files' interpreter runs go to two workers."""

from __future__ import annotations

import pytest
import torch

from conftest import DEVICE
from specpilot.kernels.u12 import U12Config, hmma
from specpilot.kernels.u12 import fused as ufl
from specpilot.kernels.u12.cases import fused_case, make_fused_inputs

pytestmark = [pytest.mark.interpreter, pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")]  # gated: SiLU of large negatives
_HMMA = dict(num_stages=1, kernel="hmma")


@pytest.mark.parametrize("m,split_k,mode,n", [
    (21, 2, "hand_out", 48), (32, 1, "gated", 32),  # one m-tile a warp: blocks of 32 rows
    (37, 2, "hand_in", 32),  # the last block of 5 rows
    (21, 2, "residual", 32),  # two m-tiles a warp (one warp of 32 rows): blocks of 16
])
def test_row_blocks_side_by_side_give_each_block_alone(monkeypatch, m, split_k, mode, n):
    """Past 16 rows a launch runs row blocks side by side, of 32 rows where each warp holds one m-tile
    (each word decoded once for them all), else of 16: every 16 rows' outputs bit for bit those of a
    launch of those rows alone (their sums and epilogues do not meet), split-K, the residual, gated
    and handoff epilogues included (a handed-on norm's xg and the row sums of its parts too); and the
    reference's within the kernel's tolerance. (The launches of the rows alone hold 5+ rows: the
    fused GEMV serves fewer.)"""
    k = 128  # 32 words: splits of whole 16-word chunks (n 48: two N blocks, the second half past N)
    warps = 1 if mode == "residual" else 2
    gated = mode == "gated"
    case = fused_case(m, 2 * n if gated else n, k, torch.bfloat16, gated=int(gated), residual=1)
    x, t, _, _, r, _ = make_fused_inputs(case, DEVICE, m)  # escapes planted
    t = t.with_layout("tiles")
    g = torch.Generator().manual_seed(m)
    parts = (0.5 + torch.rand(3, m, generator=g)).to(DEVICE) * k
    nw = (1 + 0.1 * torch.randn(n, generator=g)).to(torch.bfloat16).to(DEVICE)
    cfg = U12Config(32, 16, split_k=split_k, num_warps=warps, **_HMMA)
    kernel, block_ms = hmma._u12_hmma_kernel, []

    class Spy:  # each launch's rows a program
        def __getitem__(self, grid):
            return lambda *a, **kw: (block_ms.append(kw["BLOCK_M"]), kernel[grid](*a, **kw))

    monkeypatch.setattr(hmma, "_u12_hmma_kernel", Spy())

    def run(rows):
        h_out = ufl.NormHandoff(nw) if mode == "hand_out" else None
        h_in = (ufl.NormHandoff(torch.ones(k, dtype=torch.bfloat16, device=DEVICE), 1e-6, xg=x[rows],
                                parts=parts[:, rows].clone()) if mode == "hand_in" else None)
        res = r[rows].clone() if mode in ("residual", "hand_out") else None
        y = ufl.u12_fused_linear(x[rows], t, gated=gated, residual=res, config=cfg, hand_out=h_out, hand_in=h_in)
        return y, h_out

    y, h = run(slice(0, m))
    assert block_ms == [32 if warps == 2 else 16]
    blocks = [run(slice(lo, min(lo + 16, m))) for lo in range(0, m, 16)]
    assert torch.equal(y.view(torch.int16), torch.cat([b[0] for b in blocks]).view(torch.int16))
    if mode == "hand_out":
        assert torch.equal(h.xg.view(torch.int16), torch.cat([b[1].xg for b in blocks]).view(torch.int16))
        torch.testing.assert_close(h.parts.sum(0), torch.cat([b[1].parts.sum(0) for b in blocks]), rtol=1e-6, atol=0)
    h_in = (ufl.NormHandoff(torch.ones(k, dtype=torch.bfloat16, device=DEVICE), 1e-6, xg=x, parts=parts.clone())
            if mode == "hand_in" else None)
    h_out = ufl.NormHandoff(nw) if mode == "hand_out" else None
    ref = ufl.u12_fused_linear_reference(x, t, gated=gated, residual=r.clone() if mode in ("residual", "hand_out")
                                         else None, hand_in=h_in, hand_out=h_out)
    torch.testing.assert_close(y.float(), ref.float(), rtol=8e-3, atol=1e-3)

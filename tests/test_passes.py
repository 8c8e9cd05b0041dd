"""The pass base, registry and manager, and the draft-block-size pass."""

import pytest

from specpilot.errors import PipelineError
from specpilot.ir import lower, print_program
from specpilot.passes import REGISTRY, lookup, pipeline_string, run_passes
from specpilot.passes.block_size import DraftBlockSize

from test_ir import DFLASH, PARD, TARGET


def test_block_size_changes_exactly_the_step_graph():
    p = lower(TARGET, DFLASH)
    q, [rec] = run_passes(p, [DraftBlockSize(size=4)])
    assert rec.changed and rec.before != rec.after and rec.lossless
    assert q.target == p.target and q.drafter == p.drafter
    assert q.step.one("draft")[1]["block_size"] == 4
    assert q.step.one("propose")[1]["budget"] == 3
    assert q.step.one("verify")[1]["q"] == 4
    before, after = print_program(p).splitlines(), print_program(q).splitlines()
    assert sum(a != b for a, b in zip(before, after)) == 3  # draft, propose, verify lines


def test_block_size_pard_counts_k_drafts():
    p = lower(TARGET, PARD)
    q, _ = run_passes(p, [DraftBlockSize(size=6)])
    assert q.step.one("verify")[1]["q"] == 7


def test_no_change_is_reported():
    p = lower(TARGET, DFLASH)
    q, [rec] = run_passes(p, [DraftBlockSize(size=8)])
    assert not rec.changed and q == p


def test_schedule_space_only_lists_changes():
    p = lower(TARGET, DFLASH)
    space = DraftBlockSize.schedule_space(p)
    assert space and all(s.size != 8 for s in space)
    for candidate in space:
        assert candidate.apply(p).changed


def test_spec_and_params():
    assert DraftBlockSize(size=4).spec() == "draft-block-size{size=4}"
    assert pipeline_string([DraftBlockSize(size=4), DraftBlockSize(size=2)]) == (
        "draft-block-size{size=4},draft-block-size{size=2}")
    assert lookup("draft-block-size").from_params({"size": 12}) == DraftBlockSize(size=12)
    with pytest.raises(PipelineError, match="no parameter 'sizes'"):
        DraftBlockSize.from_params({"sizes": 3})
    with pytest.raises(PipelineError, match="expects int, got \"x\""):
        DraftBlockSize.from_params({"size": "x"})
    with pytest.raises(PipelineError, match="size must be >= 1"):
        DraftBlockSize.from_params({"size": 0})
    with pytest.raises(PipelineError, match="unknown pass 'nope'"):
        lookup("nope")
    assert "draft-block-size" in REGISTRY

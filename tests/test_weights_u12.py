"""The weights-u12 pass: what it changes, and that the engine's weights stay bit-identical."""

import pytest
import torch

from specpilot.backends.torch_backend import U12Linear, build_engine, packed_weights
from specpilot.errors import PipelineError
from specpilot.ir import MATMUL_OPS, lower
from specpilot.passes import lookup, run_passes
from specpilot.passes.weights_u12 import WeightsU12
from specpilot.runtime.builtin import resolve_builtin
from specpilot.runtime.load import load_target
from specpilot.formats.u12 import tiles_fit, unpack_u12

from test_ir import DFLASH, TARGET


def test_changes_exactly_the_large_bf16_matmuls():
    p = lower(TARGET, DFLASH, dtype="bfloat16")
    q, [rec] = run_passes(p, [WeightsU12(min_numel=8192, kernel="torch", layout="rows")])
    assert rec.changed and rec.lossless
    for level in ("target", "drafter"):
        before, after = p.graph(level), q.graph(level)
        for name, node in before.items():
            new = after.node(name)
            big = node.op in MATMUL_OPS and node["in_features"] * node["out_features"] >= 8192
            if big and not node["weight"].startswith("target/"):
                assert (new["format"], new["kernel"]) == ("u12", "torch"), name
                assert new.replace(format=node["format"], kernel=node["kernel"]) == node  # nothing else moved
            else:
                assert new == node, name
    assert q.step == p.step


def test_no_change_outside_bf16():
    p = lower(TARGET, DFLASH, dtype="float32")
    q, [rec] = run_passes(p, [WeightsU12(min_numel=1)])
    assert not rec.changed and q == p and "float32" in rec.summary
    assert WeightsU12.schedule_space(p) == []


def test_parameters_are_checked():
    with pytest.raises(PipelineError, match="kernel must be one of"):
        lookup("weights-u12").from_params({"kernel": "cuda"})
    with pytest.raises(PipelineError, match="layout must be one of auto, rows, tiles"):
        lookup("weights-u12").from_params({"layout": "columns"})
    assert WeightsU12(min_numel=5, kernel="torch").spec() == 'weights-u12{min-numel=5, kernel="torch", layout="auto"}'


@pytest.mark.parametrize("explicit", [True, False])
def test_tiles_layout_marks_the_nodes_and_rows_leaves_them(explicit):
    """layout=tiles (or auto, where the step verifies a block: DFLASH's 16 tokens) adds the layout of
    each u12 node whose weight tiles and changes nothing else (a weight that does not tile, like the
    tiny lm_head [300, 64], stays rows); rows adds nothing."""
    p = lower(TARGET, DFLASH, dtype="bfloat16")
    assert max(n["q"] for _, n in p.step.items() if n.op == "verify") >= 3
    rows, _ = run_passes(p, [WeightsU12(min_numel=8192, kernel="torch", layout="rows")])
    tiles, [rec] = run_passes(p, [WeightsU12(min_numel=8192, kernel="torch", layout="tiles" if explicit else "auto")])
    assert "tiled" in rec.summary
    for level in ("target", "drafter"):
        for name, node in rows.graph(level).items():
            tiled = tiles.graph(level).node(name)
            assert "layout" not in dict(node.attrs)
            if node.op in MATMUL_OPS and node["format"] == "u12" and tiles_fit((node["out_features"], node["in_features"])):
                assert tiled["layout"] == "tiles"
                assert {k: v for k, v in tiled.attrs if k != "layout"} == dict(node.attrs)  # nothing else moved
            else:
                assert tiled == node


def test_auto_tiles_from_the_rows_the_tensor_core_kernels_take():
    """TILES_FROM_ROWS is the kernels' TENSOR_CORE_ROWS (where TUNED_TILES' hmma configs start)."""
    from specpilot.kernels.u12 import TENSOR_CORE_ROWS
    from specpilot.passes.weights_u12 import TILES_FROM_ROWS

    assert TILES_FROM_ROWS == TENSOR_CORE_ROWS


def test_auto_keeps_rows_for_narrow_steps(monkeypatch):
    """auto: a deployment verifying fewer tokens a step than TILES_FROM_ROWS keeps the row planes."""
    from specpilot.passes import weights_u12

    p = lower(TARGET, DFLASH, dtype="bfloat16")
    q = max(n["q"] for _, n in p.step.items() if n.op == "verify")
    monkeypatch.setattr(weights_u12, "TILES_FROM_ROWS", q + 1)
    out, [rec] = run_passes(p, [WeightsU12(min_numel=8192, kernel="torch")])
    assert rec.changed and "tiled" not in rec.summary
    assert not any("layout" in dict(n.attrs) for level in ("target", "drafter") for _, n in out.graph(level).items())


@pytest.mark.parametrize("layout", ["rows", "tiles"])
def test_engine_weights_are_bit_identical(tmp_path, monkeypatch, layout):
    monkeypatch.setenv("SPECPILOT_CACHE", str(tmp_path))
    target_dir, drafter_dir = resolve_builtin("tiny-qwen3"), resolve_builtin("tiny-qwen3/dflash")
    import json
    p = lower(json.loads((target_dir / "config.json").read_text()),
              json.loads((drafter_dir / "config.json").read_text()), dtype="bfloat16")
    p, _ = run_passes(p, [WeightsU12(min_numel=1, kernel="torch", layout=layout)])
    engine = build_engine(p, target_dir, drafter_dir, torch.device("cpu"))
    reference, _ = load_target(target_dir, dtype=torch.bfloat16, device="cpu")
    packed = packed_weights(engine.target, p.target.items())
    assert len(packed) == sum(1 for _, n in p.target.items() if n.op in MATMUL_OPS)
    ref = dict(reference.named_parameters())
    for name, t in packed.items():
        w = ref["lm_head.weight" if name == "model.embed_tokens.weight" else name]
        assert torch.equal(unpack_u12(t).view(torch.int16), w.detach().view(torch.int16)), name
        assert t.layout == (layout if tiles_fit(t.shape) else "rows"), name
    assert layout == "rows" or any(t.layout == "tiles" for t in packed.values())
    assert isinstance(engine.target.lm_head, U12Linear)
    # the engine generates exactly what AR greedy on the reference generates
    prompt = list(range(60, 80))
    assert engine.generate(prompt, 16).tokens == engine.generate_ar(prompt, 16).tokens

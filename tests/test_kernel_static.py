"""kernels/target.py's compile_only and bench.kernels.kernel_static: kernels compiled for sm_90 on a
machine without a GPU, and what their SASS must (not) contain.

The claims checked here are the kernels' docstrings': the hmma kernel's loop runs from registers
(no shared memory, shuffle or barrier) and its tiled-planes variant compiles to the same loop;
gemv2 and the fused GEMV keep everything in registers without spilling. Compiling needs a process
whose Triton was imported without the interpreter (conftest sets TRITON_INTERPRET=1 for the rest of
the suite), so those run in a subprocess.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from bench.kernels import kernel_static
from specpilot.agent.predict import ranks
from conftest import ON_GPU

ROOT = Path(__file__).resolve().parent.parent

# a CUDA machine compiles for its own GPU through the same path; the check is for machines without one
pytestmark = pytest.mark.skipif(ON_GPU, reason="compile_only is the no-GPU path")


def _compiled_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"  # Triton 3.9 warns while the default is unset
    return env


HMMA_SCRIPT = r"""
import dataclasses, json, tempfile
from pathlib import Path
import torch
from bench.kernels import kernel_static
from specpilot.kernels.target import compile_only, native
from specpilot.kernels.u12 import NormHandoff, U12Config, u12_fused_linear, u12_linear
from specpilot.formats.u12 import pack_u12
from triton.runtime import driver

before = driver._active
w = pack_u12((torch.randn(256, 1024, generator=torch.Generator().manual_seed(0)) * 0.02).bfloat16())
x = torch.randn(16, 1024).bfloat16()
rows = U12Config(64, 32, num_warps=4, num_stages=1, kernel="hmma", maxnreg=128)
out = {}
with tempfile.TemporaryDirectory() as tmp:
    gemv = U12Config(4, 128, num_warps=4, num_stages=1, kernel="gemv2")
    split = dataclasses.replace(rows, split_k=4)
    for name, m, cfg, t in (("rows", 16, rows, w), ("tiles", 16, rows, w.with_layout("tiles")), ("narrow", 8, rows, w),
                            ("split", 16, split, w.with_layout("tiles")),
                            ("gemv", 1, gemv, w), ("gemv-tiles", 1, gemv, w.with_layout("tiles"))):
        with compile_only(90) as compiled:
            assert native(x)
            u12_linear(x[:m], t, cfg)
        out[name] = [kernel_static.describe(c, Path(tmp)) for c in compiled]
    hand = NormHandoff(torch.ones(1024).bfloat16(), 1e-5)
    hand.xg, hand.parts = x.clone(), torch.rand(256, 16)  # as a producer of 64 programs of 4 warps leaves them
    with compile_only(90) as compiled:  # a handed-in norm on the tiled split-K launch
        u12_fused_linear(hand.xg, w.with_layout("tiles"), hand_in=hand, config=split)
    out["hand_in"] = [kernel_static.describe(c, Path(tmp)) for c in compiled]
out["native_after"] = native(x)
out["driver_restored"] = driver._active is before
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def hmma_facts() -> dict:
    done = subprocess.run([sys.executable, "-c", HMMA_SCRIPT], cwd=ROOT, env=_compiled_env(), capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_hmma_loop_runs_from_registers(hmma_facts):
    for name in ("rows", "tiles", "narrow"):
        (k,) = hmma_facts[name]  # one launch: no split-K reduction kernel at one split
        # an m16n8k16 MMA takes 256 weights, each in every n-tile's MMA (BLOCK_M / 8 of them)
        assert k["loop_opcodes"]["HMMA"] * 256 == k["loop_weights_per_warp"] * k["constexprs"]["BLOCK_M"] // 8
        assert k["kernel"] == "_u12_hmma_kernel" and k["constexprs"]["ASM"] is True
        ops = k["loop_opcodes"]
        assert ops.get("HMMA", 0) > 0 and ops.get("LDG", 0) > 0, (name, ops)
        assert not {"LDS", "STS", "LDSM", "BAR", "SHFL", "HGMMA"} & ops.keys(), (name, ops)
        assert k["spill_bytes"] == 0 and k["registers"] <= 128, (name, k)  # the config's maxnreg


def test_hmma_epilogue_converts_no_layouts(hmma_facts):
    """The epilogue works on [T] tensors in the loop's layout (kernels/u12/hmma.py), so neither the
    split-K partials nor the escapes and stores pass through shared memory: the barriers left are
    the split-K release and the walk's block-wide max, where the stacked epilogue's layout
    conversions took 33 (sm_90, triton 3.9)."""
    for name in ("rows", "split", "narrow"):
        (k,) = hmma_facts[name]
        ops = k["kernel_opcodes"]
        assert ops.get("BAR", 0) <= 8 and ops.get("STS", 0) <= 4, (name, ops)
    (split,) = hmma_facts["split"]
    assert split["constexprs"]["SPLIT_K"] == 4  # the partials' path compiled, not one split


def test_handed_in_norm_takes_no_gather(hmma_facts):
    """HAND_IN: each lane sums its own rows' parts and one reduction adds the lanes' and warps'
    (``_lane_invs``), so the epilogue keeps within 4 barriers and 16 shared-memory ops of the plain
    split-K launch; the block's inv reduced across the program and gathered by each of the 8 sums
    took 11 barriers and 54 shared-memory ops more (qkv, Triton 3.6:
    docs/experiments/tried/kernel_static_sm90_triton36-fused-tiles-bff8915.json; 4.4 µs a call in
    docs/experiments/tried/layer16_h100_bff8915.json)."""
    (hand,), (plain,) = hmma_facts["hand_in"], hmma_facts["split"]
    assert hand["constexprs"]["SPLIT_K"] == 4 and hand["spill_bytes"] == 0, hand
    ops, base = hand["kernel_opcodes"], plain["kernel_opcodes"]
    assert ops.get("BAR", 0) <= base.get("BAR", 0) + 4, (ops, base)
    assert ops.get("STS", 0) + ops.get("LDS", 0) <= base.get("STS", 0) + base.get("LDS", 0) + 16, (ops, base)
    assert hand["loop_opcodes"]["HMMA"] == plain["loop_opcodes"]["HMMA"]


def test_tiled_planes_compile_to_the_rows_loop(hmma_facts):
    """The tiled layout changes addresses only: the same loads, MMAs and loop length (a7c7e4b's claim)."""
    (rows,), (tiles,) = hmma_facts["rows"], hmma_facts["tiles"]
    assert tiles["constexprs"]["TILED"] is True and rows["constexprs"]["TILED"] is False
    assert tiles["loop_opcodes"]["LDG"] == rows["loop_opcodes"]["LDG"]
    assert tiles["loop_opcodes"]["HMMA"] == rows["loop_opcodes"]["HMMA"]
    assert abs(tiles["loop_instructions"] - rows["loop_instructions"]) <= 0.1 * rows["loop_instructions"]


def test_tiled_gemv_keeps_its_vector_loads(hmma_facts):
    """gemv2 on a tiled weight (runs of 16 words, 256 apart): the same loads (16-byte vectors of 4 words),
    FMAs and loop as on the row planes; only the addresses differ."""
    (rows,), (tiles,) = hmma_facts["gemv"], hmma_facts["gemv-tiles"]
    assert tiles["constexprs"]["TILED"] is True and rows["constexprs"]["TILED"] is False
    for op in ("LDG", "FFMA"):
        assert tiles["loop_opcodes"][op] == rows["loop_opcodes"][op], op
    assert tiles["spill_bytes"] == 0 and tiles["loop_instructions"] <= rows["loop_instructions"] + 16


def test_narrow_hmma_halves_the_mmas(hmma_facts):
    """At <= 8 rows one n-tile (BLOCK_M 8): half the MMAs of two, and fewer registers."""
    (wide,), (narrow,) = hmma_facts["rows"], hmma_facts["narrow"]
    assert narrow["constexprs"]["BLOCK_M"] == 8 and wide["constexprs"]["BLOCK_M"] == 16
    assert 2 * narrow["loop_opcodes"]["HMMA"] == wide["loop_opcodes"]["HMMA"]
    assert narrow["registers"] < wide["registers"]


def test_compile_only_leaves_the_launch_state_as_it_was(hmma_facts):
    assert hmma_facts["native_after"] is False and hmma_facts["driver_restored"] is True


def _kernel_static(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "bench.kernels.kernel_static", *args], cwd=ROOT,
                          env=env or _compiled_env(), capture_output=True, text=True, timeout=600)


def test_kernel_static_smoke_run(tmp_path):
    out = tmp_path / "static.json"
    done = _kernel_static("--smoke", "--ms", "1", "--step-variants", "--only", "u12,u12-fused,bf16", "--out", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert (result["bench"], result["gpu"], result["smoke"]) == ("kernel_static", "sm90", True)
    rows = result["records"]
    # step_ab's AR TUNED variants compiled after the default launches, on the fused calls they change
    assert [r["variant"] for r in rows][0] == "default"
    ar = [name for name, ms, whats, _, _ in kernel_static.step_variants() if 1 in ms and "u12-fused" in whats]
    assert ar and {r["variant"] for r in rows} == {"default", *ar}
    for name in ar:
        assert {r["what"] for r in rows if r["variant"] == name} == {"u12-fused"}, name
    rows = [r for r in rows if r["variant"] == "default"]
    assert {(r["what"], r["shape"]) for r in rows} >= {(w, s) for s in kernel_static.SMOKE_SHAPES for w in ("u12", "bf16")}
    assert all(r["constexprs"]["LANES"] > 0 for r in rows if r["what"] == "u12")  # the GEMVs' escapes from the lanes
    fused = [(r["shape"], r["kernel"]) for r in rows if r["what"] == "u12-fused"]
    assert fused == [(s, "_u12_fused_gemv_kernel") for s in ("o", "gate_up", "down", "qkv")]  # the AR step's order
    for r in rows:
        assert r["registers"] > 0 and r["spill_bytes"] == 0 and r["programs_per_sm"] >= 1, r
        if r["kernel"] in ("_u12_gemv_kernel", "_u12_fused_gemv_kernel"):  # gemv2: decode and FMAs in registers
            assert r["loop_opcodes"].get("FFMA", 0) > 0 and r["loop_opcodes"].get("PRMT", 0) > 0, r
            assert not {"LDS", "STS", "BAR"} & r["loop_opcodes"].keys(), r
            # one row: one FMA a weight, so a warp's FMAs an iteration are the weights its config says
            assert r["loop_opcodes"]["FFMA"] * 32 == r["loop_weights_per_warp"], r
            assert r["warp_instructions_per_weight"] == pytest.approx(r["loop_instructions"] / r["loop_weights_per_warp"],
                                                                      abs=1e-4)


def test_kernel_static_compiles_the_fused_calls_on_tiles(tmp_path):
    """--only u12-fused-tiles (bench.steps.step_ab's u12-tiles, the default way): the verify step's four fused
    calls on tiled weights, each a tensor-core kernel reading the tiles with its epilogue, in the
    step's order, nothing spilled (at the smoke shapes the mma kernel's default tile; at Llama's
    TUNED_TILES gives the hmma kernel)."""
    out = tmp_path / "static.json"
    done = _kernel_static("--smoke", "--ms", "16", "--only", "u12-fused-tiles", "--out", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(out.read_text())["records"]
    assert [(r["what"], r["shape"]) for r in rows] == [("u12-fused-tiles", s) for s in ("o", "gate_up", "down", "qkv")]
    assert {r["kernel"] for r in rows} <= {"_u12_mma_kernel", "_u12_hmma_kernel"}
    for r in rows:
        assert r["constexprs"]["TILED"] and r["spill_bytes"] == 0, r
    flags = {r["shape"]: r["constexprs"] for r in rows}
    assert flags["gate_up"]["GATED"] and flags["gate_up"]["HAND_IN"] and flags["qkv"]["HAND_IN"]
    assert flags["o"]["HAND_OUT"] and flags["o"]["RESIDUAL"] and flags["down"]["HAND_OUT"]


def test_kernel_static_refuses_the_interpreter(tmp_path):
    env = _compiled_env() | {"TRITON_INTERPRET": "1"}
    done = _kernel_static("--smoke", "--out", str(tmp_path / "x.json"), env=env)
    assert done.returncode == 2 and "TRITON_INTERPRET" in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "x.json").exists()


SASS = [("", "S2R R0, SR_TID.X"), (".L_x_1", "@!P0 LDG.E.128 R4, desc[UR6][R2.64]"), ("", "HMMA.16816.F32.BF16 R8, R4, R6, R8"),
        (".L_x_2", "IADD3 R2, R2, 0x10, RZ"), ("", "@P1 BRA `(.L_x_2)"), ("", "@P0 BRA `(.L_x_1)"),
        ("", "BRA `(.L_x_3)"), (".L_x_3", "EXIT")]


def test_main_loop_is_the_longest_backward_branch():
    assert kernel_static.main_loop(SASS) == (1, 5)
    # an escape walk with more FMAs than the K loop has MMAs is not the K loop
    walk = [(".L_x_9", "FFMA R1, R2, R3, R1"), ("", "FFMA R1, R2, R3, R1"), ("", "FFMA R1, R2, R3, R1"),
            ("", "@P2 BRA `(.L_x_9)")]
    assert kernel_static.main_loop(SASS[:6] + walk) == (1, 5)
    assert kernel_static.main_loop([("", "EXIT")]) is None
    assert [kernel_static.opcode(i) for _, i in SASS[:3]] == ["S2R", "LDG", "HMMA"]


@pytest.mark.parametrize("regs, warps, shared, programs", [
    (128, 4, 0, 4), (80, 4, 0, 6), (255, 2, 1024, 4), (40, 4, 40960, 5), (16, 1, 0, 32), (96, 2, 1024, 10)])
def test_programs_per_sm(regs, warps, shared, programs):
    assert kernel_static.programs_per_sm(regs, warps, shared) == programs


# five of bench.kernels.u12_linear's sweep at o's smoke shape, 16 rows (compiling each takes seconds):
# its default first, then four split-1 hmma configs
PICK = ("(lambda swept: swept[:1] + [c for c in swept if str(c).startswith('hmma') and '-sk1-' in str(c)][:4])"
        "(u12_linear.sweep_configs(16, *kernel_static.SMOKE_SHAPES['o'], ('hmma',)))")
SWEEP_SCRIPT = f"""
import sys
from bench.kernels import kernel_static, u12_linear
configs = {PICK}
u12_linear.sweep_configs = lambda *args, **kw: configs
sys.exit(kernel_static.main(sys.argv[1:]))
"""


def test_sweep_mode_joins_the_timed_configs(tmp_path):
    """--sweep compiles bench.kernels.u12_linear's config list (here five of it) and takes each
    config's time from a results file by (shape, rows, config string); the correlations cover the
    timed groups only."""
    from bench.kernels import u12_linear  # noqa: F401  (PICK's)

    configs = [str(c) for c in eval(PICK)]
    hmma = configs[1:]
    assert len(hmma) == 4 and not configs[0].startswith("hmma")
    timed = tmp_path / "timed.json"  # a made-up sweep: the four hmma configs timed, slower down the list
    timed.write_text(json.dumps({"sweep": [{"name": "o", "M": 16, "config": c, "us": 10.0 + i} for i, c in enumerate(hmma)]}))
    out = tmp_path / "sweep.json"
    done = subprocess.run([sys.executable, "-c", SWEEP_SCRIPT, "--smoke", "--sweep", "hmma", "--ms", "16", "--shapes", "o",
                           "--timed", str(timed), "--out", str(out)], cwd=ROOT, env=_compiled_env(),
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert [r["config"] for r in result["records"]] == configs  # every swept config, in the sweep's order
    assert {r["config"]: r["us"] for r in result["records"] if r["us"] is not None} == {c: 10.0 + i for i, c in
                                                                                        enumerate(hmma)}
    assert all(r["spill_bytes"] == 0 for r in result["records"])
    (corr,) = result["correlations"]  # one group timed: o, the hmma kernel, split 1
    assert (corr["shape"], corr["kernel"], corr["split_k"], corr["configs"]) == ("o", "_u12_hmma_kernel", 1, 4)
    assert corr["best"] == hmma[0] and corr["best_us"] == 10.0


@given(st.lists(st.integers(-50, 50), min_size=3, max_size=12, unique=True),
       st.lists(st.integers(-50, 50), min_size=3, max_size=12, unique=True))
def test_spearman_matches_the_distinct_values_formula(a, b):
    n = min(len(a), len(b))
    a, b = a[:n], b[:n]
    ra, rb = sorted(a).index, sorted(b).index
    d2 = sum((ra(x) - rb(y)) ** 2 for x, y in zip(a, b))
    assert kernel_static.spearman(a, b) == pytest.approx(1 - 6 * d2 / (n * (n * n - 1)), abs=1e-9)
    assert kernel_static.spearman(a, [3 * y + 7 for y in b]) == pytest.approx(kernel_static.spearman(a, b))


def test_spearman_with_ties_and_constants():
    assert kernel_static.spearman([1, 2, 2, 3], [1, 3, 2, 4]) == pytest.approx(4.5 / 22.5 ** 0.5)
    assert kernel_static.spearman([1, 1, 1], [1, 2, 3]) is None
    assert ranks([5, 1, 5, 2]) == [3.5, 1.0, 3.5, 2.0]

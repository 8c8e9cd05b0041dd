"""kernels/target.py's compile_only and bench/kernel_static.py: kernels compiled for sm_90 on a
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
import torch
from hypothesis import given
from hypothesis import strategies as st

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
import kernel_static  # noqa: E402

# a CUDA machine compiles for its own GPU through the same path; the check is for machines without one
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="compile_only is the no-GPU path")


def _compiled_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"  # Triton 3.9 warns while the default is unset
    return env


HMMA_SCRIPT = r"""
import dataclasses, json, sys, tempfile
from pathlib import Path
import torch
sys.path.insert(0, "bench")
import kernel_static
from specpilot.kernels.target import compile_only, native
from specpilot.kernels.u12_linear import U12Config, u12_linear
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
    from specpilot.kernels import u12_hmma
    u12_hmma.AHEAD = True  # the register double buffer on the tiled split-K launch
    with compile_only(90) as compiled:
        u12_linear(x, w.with_layout("tiles"), split)
    out["ahead"] = [kernel_static.describe(c, Path(tmp)) for c in compiled]
    u12_hmma.AHEAD_X = True  # and the next chunk's x prefetched into L1
    with compile_only(90) as compiled:
        u12_linear(x, w.with_layout("tiles"), split)
    out["ahead_x"] = [kernel_static.describe(c, Path(tmp)) for c in compiled]
    u12_hmma.AHEAD, u12_hmma.AHEAD_X = False, False
    u12_hmma.ESC_SPLIT = True  # the splits walk their shares of the escapes
    with compile_only(90) as compiled:
        u12_linear(x, w.with_layout("tiles"), split)
    out["esc_split"] = [kernel_static.describe(c, Path(tmp)) for c in compiled]
    u12_hmma.ESC_SPLIT = False
    wk = U12Config(16, 32, num_warps=4, num_stages=1, kernel="hmma", maxnreg=128, warp_k=True)
    with compile_only(90) as compiled:  # WARP_K: 4 warps on 16 rows, each a quarter of the words
        u12_linear(x, w.with_layout("tiles"), wk)
    out["warp_k"] = [kernel_static.describe(c, Path(tmp)) for c in compiled]
    with compile_only(90) as compiled:  # 8 warps: one 32-word chunk each of the 256 words
        u12_linear(x, w.with_layout("tiles"), dataclasses.replace(wk, num_warps=8))
    out["warp_k8"] = [kernel_static.describe(c, Path(tmp)) for c in compiled]
    from specpilot.kernels.u12_fused_linear import NormHandoff, u12_fused_linear
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
    """The epilogue works on [T] tensors in the loop's layout (kernels/u12_hmma.py), so neither the
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
    bench/results/tried/kernel_static_fused_tiles_sm90_triton36_bff8915.json; 4.4 µs a call in
    bench/results/tried/layer16_bff8915_h100.json)."""
    (hand,), (plain,) = hmma_facts["hand_in"], hmma_facts["split"]
    assert hand["constexprs"]["SPLIT_K"] == 4 and hand["spill_bytes"] == 0, hand
    ops, base = hand["kernel_opcodes"], plain["kernel_opcodes"]
    assert ops.get("BAR", 0) <= base.get("BAR", 0) + 4, (ops, base)
    assert ops.get("STS", 0) + ops.get("LDS", 0) <= base.get("STS", 0) + base.get("LDS", 0) + 16, (ops, base)
    assert hand["loop_opcodes"]["HMMA"] == plain["loop_opcodes"]["HMMA"]


def test_words_ahead_stay_in_registers(hmma_facts):
    """``u12_hmma.AHEAD`` at o's tile (64 rows, 32 words, 4 warps, 128 registers): the next chunk's
    words held in registers without spilling, the same loads and MMAs a chunk as the one-stage
    loop, still no shared memory in the loop, and a longer loop (the carried words' moves)."""
    (ahead,), (one,) = hmma_facts["ahead"], hmma_facts["split"]
    assert ahead["constexprs"]["AHEAD"] is True and one["constexprs"]["AHEAD"] is False
    assert ahead["constexprs"]["TILED"] and ahead["constexprs"]["SPLIT_K"] == 4
    assert ahead["spill_bytes"] == 0 and ahead["registers"] <= 128, ahead
    ops = ahead["loop_opcodes"]
    assert ops["LDG"] == one["loop_opcodes"]["LDG"] and ops["HMMA"] == one["loop_opcodes"]["HMMA"], (ops, one)
    assert not {"LDS", "STS", "BAR", "SHFL"} & ops.keys(), ops
    assert ahead["loop_instructions"] > one["loop_instructions"], (ahead["loop_instructions"], one["loop_instructions"])


def test_x_prefetched_a_chunk_ahead(hmma_facts):
    """``u12_hmma.AHEAD_X``: AHEAD's loop with one L1 prefetch (CCTL.E.PF1) of x a group and n-tile
    row (2 groups of o's 32 words, 2 n-tiles: 4), the same loads and MMAs, still in 128 registers."""
    (ax,), (ahead,) = hmma_facts["ahead_x"], hmma_facts["ahead"]
    assert ax["constexprs"]["AHEAD"] is True and ax["spill_bytes"] == 0 and ax["registers"] <= 128, ax
    ops, base = ax["loop_opcodes"], ahead["loop_opcodes"]
    assert ops.get("CCTL") == 4 and "CCTL" not in base, (ops, base)
    assert ops["LDG"] == base["LDG"] and ops["HMMA"] == base["HMMA"], (ops, base)


def test_escapes_walked_by_the_splits_leave_the_loop_alone(hmma_facts):
    """``u12_hmma.ESC_SPLIT`` on the tiled split-K launch: the loop compiles to the same loads and
    MMAs, no shared memory, about as long (the walk runs after it; ptxas schedules the addresses a
    little otherwise), nothing spills at o's 128 registers, and the epilogue converts no layouts."""
    (esc,), (one,) = hmma_facts["esc_split"], hmma_facts["split"]
    assert esc["constexprs"]["SPLIT_K"] == 4 and esc["spill_bytes"] == 0 and esc["registers"] <= 128, esc
    ops, base = esc["loop_opcodes"], one["loop_opcodes"]
    assert ops["LDG"] == base["LDG"] and ops["HMMA"] == base["HMMA"], (ops, base)
    assert not {"LDS", "STS", "BAR", "SHFL"} & ops.keys(), ops
    assert abs(esc["loop_instructions"] - one["loop_instructions"]) <= 8, (esc["loop_instructions"], one["loop_instructions"])
    ops = esc["kernel_opcodes"]
    assert ops.get("BAR", 0) <= 8 and ops.get("STS", 0) <= 4, ops
    assert esc["sass_instructions"] != one["sass_instructions"]  # the knob reached the kernel


def test_warps_splitting_the_words_keep_the_loop_in_registers(hmma_facts):
    """``U12Config.warp_k`` (16 rows, 4 warps): each warp's loop multiplies all 16 rows of its share
    of the words, so a loop iteration's weights a warp are BLOCK_N x the chunk, not over the warps
    (kernel_static's /weight had divided them, showing WARP_K 4x the instructions a weight); the loop
    runs from registers, the warps' sums meet in shared memory after it."""
    (wk,), (rows,) = hmma_facts["warp_k"], hmma_facts["tiles"]
    assert wk["constexprs"]["WARP_K"] is True and wk["constexprs"]["BLOCK_N"] == 16 and wk["num_warps"] == 4
    assert wk["loop_opcodes"]["HMMA"] * 256 == wk["loop_weights_per_warp"] * wk["constexprs"]["BLOCK_M"] // 8
    assert wk["loop_opcodes"]["HMMA"] == rows["loop_opcodes"]["HMMA"]  # 16 rows a warp in both
    assert abs(wk["warp_instructions_per_weight"] - rows["warp_instructions_per_weight"]) < 0.02, (wk, rows)
    assert not {"LDS", "STS", "BAR", "SHFL"} & wk["loop_opcodes"].keys(), wk["loop_opcodes"]
    assert wk["spill_bytes"] == 0 and wk["shared_bytes"] > 0 and wk["kernel_opcodes"].get("BAR", 0) > 0, wk
    (wk8,) = hmma_facts["warp_k8"]  # the same loop at 8 warps (before the share was declared whole
    assert wk8["num_warps"] == 8 and wk8["spill_bytes"] == 0  # chunks, more loads and shared memory in it)
    assert wk8["loop_opcodes"]["LDG"] == wk["loop_opcodes"]["LDG"] and wk8["loop_opcodes"]["HMMA"] == 16
    assert not {"LDS", "STS", "BAR", "SHFL"} & wk8["loop_opcodes"].keys(), wk8["loop_opcodes"]


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
    """At <= 8 rows one n-tile (u12_hmma.NARROW: BLOCK_M 8): half the MMAs of two, and fewer registers."""
    (wide,), (narrow,) = hmma_facts["rows"], hmma_facts["narrow"]
    assert narrow["constexprs"]["BLOCK_M"] == 8 and wide["constexprs"]["BLOCK_M"] == 16
    assert 2 * narrow["loop_opcodes"]["HMMA"] == wide["loop_opcodes"]["HMMA"]
    assert narrow["registers"] < wide["registers"]


def test_compile_only_leaves_the_launch_state_as_it_was(hmma_facts):
    assert hmma_facts["native_after"] is False and hmma_facts["driver_restored"] is True


def test_kernel_static_smoke_run(tmp_path):
    out = tmp_path / "static.json"
    done = subprocess.run([sys.executable, "bench/kernel_static.py", "--smoke", "--ms", "1", "--step-variants",
                           "--out", str(out)], cwd=ROOT, env=_compiled_env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    rows = result["rows"]
    # every step_ab knob variant compiled at the rows it is timed at, after the default launches
    variants = kernel_static.step_variants()
    assert [r["variant"] for r in rows][0] == "default"
    for name, (ms, _) in variants.items():
        assert {r["m"] for r in rows if r["variant"] == name and r["what"] == "u12"} == set(ms), name
    esc_table = [r for r in rows if r["variant"] == "u12-esc-table" and r["what"] == "u12"]
    assert esc_table and all(r["constexprs"]["LANES"] == 0 for r in esc_table)  # the side table, not lanes
    assert all(r["constexprs"]["LANES"] > 0 for r in rows if r["variant"] == "default" and r["what"] == "u12")
    rows = [r for r in rows if r["variant"] == "default"]
    assert {(r["what"], r["shape"]) for r in rows} >= {("u12", s) for s in kernel_static.SMOKE_SHAPES}
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
    """--only u12-fused-tiles (bench/step_ab.py's u12-tiles, the default way): the verify step's four fused
    calls on tiled weights, each a tensor-core kernel reading the tiles with its epilogue, in the
    step's order, nothing spilled (at the smoke shapes the mma kernel's default tile; at Llama's
    TUNED_TILES gives the hmma kernel)."""
    out = tmp_path / "static.json"
    done = subprocess.run([sys.executable, "bench/kernel_static.py", "--smoke", "--ms", "16", "--only", "u12-fused-tiles",
                           "--out", str(out)], cwd=ROOT, env=_compiled_env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [(r["what"], r["shape"]) for r in rows] == [("u12-fused-tiles", s) for s in ("o", "gate_up", "down", "qkv")]
    assert {r["kernel"] for r in rows} <= {"_u12_mma_kernel", "_u12_hmma_kernel"}
    for r in rows:
        assert r["constexprs"]["TILED"] and r["spill_bytes"] == 0, r
    flags = {r["shape"]: r["constexprs"] for r in rows}
    assert flags["gate_up"]["GATED"] and flags["gate_up"]["HAND_IN"] and flags["qkv"]["HAND_IN"]
    assert flags["o"]["HAND_OUT"] and flags["o"]["RESIDUAL"] and flags["down"]["HAND_OUT"]


def test_kernel_static_refuses_the_interpreter(tmp_path):
    env = _compiled_env() | {"TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "bench/kernel_static.py", "--smoke", "--out", str(tmp_path / "x.json")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "TRITON_INTERPRET" in done.stderr and "Traceback" not in done.stderr
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


def test_sweep_mode_joins_the_timed_configs(tmp_path):
    """--sweep compiles bench/u12_linear.py's own config list and takes each config's time from a
    results file by (shape, rows, config string); the correlations cover the timed groups only."""
    sys_path = str(ROOT / "bench")
    code = (f"import sys; sys.path.insert(0, {sys_path!r}); from u12_linear import sweep_configs; "
            "print('\\n'.join(str(c) for c in sweep_configs(16, *" + repr(kernel_static.SMOKE_SHAPES["o"]) + ", ('hmma',))))")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=_compiled_env(), capture_output=True, text=True)
    configs = done.stdout.split()
    hmma = [c for c in configs if c.startswith("hmma") and "-sk1-" in c]
    assert len(hmma) >= 4, done.stderr[-2000:]
    timed = tmp_path / "timed.json"  # a made-up sweep: four split-1 hmma configs timed, slower down the list
    timed.write_text(json.dumps({"sweep": [{"name": "o", "M": 16, "config": c, "us": 10.0 + i}
                                           for i, c in enumerate(hmma[:4])]}))
    out = tmp_path / "sweep.json"
    done = subprocess.run([sys.executable, "bench/kernel_static.py", "--smoke", "--sweep", "hmma", "--ms", "16",
                           "--shapes", "o", "--timed", str(timed), "--out", str(out)],
                          cwd=ROOT, env=_compiled_env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert [r["config"] for r in result["rows"]] == configs  # every swept config, in the sweep's order
    assert {r["config"]: r["us"] for r in result["rows"] if r["us"] is not None} == {c: 10.0 + i for i, c in
                                                                                     enumerate(hmma[:4])}
    assert all(r["spill_bytes"] == 0 for r in result["rows"])
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
    assert kernel_static._ranks([5, 1, 5, 2]) == [2.5, 0.0, 2.5, 1.0]

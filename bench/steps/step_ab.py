"""Interleaved A/B of the Llama-3.1-8B fused AR step: bf16 against the u12 variants, on one GPU.

    python bench/step_ab.py [--rounds 12] [--repeats 25] [--q 1] [--bf16-tuned FILE] [--u12-tuned FILE]
                            [--u12-fused-tuned FILE] [--out bench/results/step_ab_<gpu>.json]

bench/step_times.py measures each path once, one after another, and between its runs the u12
rows moved by up to 8% while the bf16 rows moved by 1% (the u12 GEMVs decode on the CUDA cores,
so they follow the clock more than the bandwidth-bound bf16 GEMVs do). Here every variant's step
is captured once in a CUDA graph over the same random weights, then the graphs are replayed in
rounds, each round timing every variant (CUDA events, median of `repeats` replays) in a rotated
order, so drift reaches all variants alike. Reported per variant: the median over rounds and the
spread; per u12 variant, the median of the per-round ratios bf16 / u12.

Variants (runtime/fused.py): bf16 (the fused path: fused_linear with its norm prologues and
epilogues); u12-unfused (u12_linear beside the separate rmsnorm, SiLU·mul and add kernels: the
default u12 layers until this comparison); u12-epilogues (u12_fused_linear's SiLU·mul and residual
epilogues, the norms as rmsnorm kernels: the default until the handoff); u12-prologue
(u12_fused_linear with its norm prologue too); u12-handoff (the epilogues' step with each norm after
o and down handed on to the next GEMV: u12_fused_linear's NormHandoff, no rmsnorm kernel between
them; the default); u12-parts-before, u12-o-bn8, u12-before-bn8 (a handed-in norm's parts summed
before the consumer's loop instead of after it, ``u12_fused_linear.PARTS_AFTER``; o at the derived
8-row blocks instead of TUNED's 4; both, with gate|up's derived tile: the default before 7db51f5;
AR only); u12-gu-bn8-w2 (gate|up at its derived 8-row, 2-warp tile, whose parts are summed
before its loop, in place of TUNED's 16 rows and 4 warps: the default at 7db51f5; AR only);
u12-default-again (the default captured again: on the H200 graphs of one configuration captured
apart ran up to 2% apart at 0bc2353); u12-esc-table (the default with the escapes from the side table, the GEMVs' row
pointers loaded before their loops, in place of the rows' lanes: ``u12_linear.ESC_LANES``);
u12-esc-after (the same with every load of the table after the loops: ``u12_linear.ESC_AHEAD`` off;
AR only); bf16-pdl, bf16-pdl-wait, u12-pdl, u12-pdl-wait (each step with programmatic dependent
launch, kernels/overlap.py's modes 1 and 2; AR only, not under --smoke; the u12 AR step's default is mode 2,
runtime/fused.py's U12_PDL, so u12-pdl-wait is the default step captured again); u12-plain (the u12 step
with PDL off, mode 0: the default until 3cf2c55; AR only, not under --smoke); u12-many-rows-off (a verify
step's u12 layers through u12_linear beside the rmsnorm and silu_mul kernels, where by default up to
16 rows run u12_fused_linear's mma and hmma epilogues and the norm handoff: runtime/fused.py's
U12_MANY_ROWS; --q above 1 only); u12-lanes-g8, u12-lanes-g16 (a verify
step's mma and hmma kernels walking the lanes 8 or 16 a step, ``u12_linear.LANE_GROUP``, against the
default 4; --q above 1 only); u12-gemv-rows (gemv2 at 3..4 rows, the default before the tensor-core
kernels took them: ``u12_linear.TENSOR_CORE_ROWS``; --q 3 or 4); u12-hmma-wide (the hmma kernel's
two n-tiles at up to 8 rows, ``u12_hmma.NARROW`` off; --q 2..8); u12-tiles (the default u12 step with
every weight tiled, ``U12Tensor.layout``: gemv2 and the fused GEMV on the tiles at one row, TUNED_TILES'
hmma configs from 3 rows, and at up to 16 rows u12_fused_linear in PDL mode 2, U12_MANY_ROWS and
U12_PDL_ROWS; u12-tiles-sweep: with the tiled configs of a --tiles-tuned file (bench/hmma_knobs.py's
per-shape winners) or else a --u12-tuned one; u12-tiles-ahead and
u12-tiles-esc-split, u12-tiles-esc-late, u12-tiles-esc-early-split: with ``u12_hmma.AHEAD``, ``ESC_SPLIT``, or
``ESC_EARLY`` "off" (the default before) or "split-k" (the default "all"); u12-tiles-wcache-off,
u12-tiles-wcg: the hmma kernel's weight loads through L1 and L2 (the default before) or L2 only, not L1
evict-first (``u12_hmma.W_CACHE``; not under --smoke); u12-tiles-w4: the layer shapes at
64-row programs of 4 warps (TUNED_TILES' configs before b5fd050; c566ca9's u12-tiles, whose
u12-tiles-w2 is the default since); u12-tiles-ahead-x: AHEAD with
``u12_hmma.AHEAD_X``; u12-tiles-many-rows-off, u12-tiles-pdl-off, u12-tiles-many-rows-off-pdl-off: u12-tiles
with u12_linear beside the norm kernels, PDL off, or both (the default verify step before 407086e),
not under --smoke; at --q above 16 also u12-tiles-mma-past-16 (the mma kernel past 16 rows, the default
before 994ddd1), u12-tiles-wide-off (the hmma kernel's blocks of 16 rows, not 32), u12-tiles-r168 and
u12-tiles-w1-r168 (the layer shapes' programs at 168 registers, of 2 warps or of 1) and u12-tiles-many-rows-32
(the fused way at 32 rows, not under --smoke); at --q above 32 also u12-tiles-hmma-to-64 (the hmma kernel's
32-row programs side by side up to 64 rows, where the mma kernel serves by default); bf16-linear-pdl-wait: bf16-linear in PDL mode 2, not under --smoke; all --q above 1); u12-sweep and u12-fused-sweep
(the default u12 step with u12_linear's, or u12_fused_linear's, TUNED entries for the step's rows
taken from a sweep's results file: --u12-tuned, --u12-fused-tuned); bf16-default, bf16-r128 (the bf16 step at other register budgets:
``BF16_VARIANTS``; not under --smoke, whose tiny shapes TUNED does not hold). With --q above 1 (a
chain verify step): bf16-cublas (cuBLAS with the separate norm, SiLU·mul and add kernels),
bf16-linear (fused_linear at those rows, --bf16-tuned's configs), bf16-linear-nosq (the same with
each norm prologue reading x: no RowSquares). Tried here and kept out
(bench/results/tried/step_ab_*.json): the u12 step with other gemv2 tiles for qkv, o and down (two
rows a thread, one-warp programs, BLOCK_N 8: 3.671, 3.756, 3.755 ms against 3.673, f6a43e7) and with
ptxas allowed 80 or 128 registers (3.86, 3.99 against 3.71, ef655ec; 80 for o and down, qkv or
gate_up alone: 3.719, 3.712, 3.812 against 3.702, e2a0b5e), though then every load of the BLOCK_N 4
loop is issued before its first FMA; 4 words a thread for every linear or gate_up alone (3.870,
3.745 against 3.701, ac79ccb; for qkv and o 3.674, which TUNED took); the lanes in the
accumulator's shape (4.041 ms, or 3.925 loaded before the loop, against 3.439, 2840cfa), x's
gather after a peeled first chunk, the weight loads .cg or L1 evict_first (3.629, 3.523, 3.529
against 3.427, 0cf1235); the GEMVs' escape lanes gathered before the PDL wait and the handed-in
norm's parts summed in the loop (u12-pdl-wait-early, u12-pdl-wait-parts-loop, u12-pdl-wait-both,
u12-early, u12-plain-parts-loop: 4.792, 4.525, 4.809, 4.823, 4.559 ms against 4.487 on the H100,
8cc6200, bench/results/tried/step_ab_early_lanes_parts_h100.json; 3.750, 3.658, 3.708, 3.771, 3.716
against 3.411 on the H200, 0bc2353, bench/results/tried/step_ab_0bc2353_h200.json; both knobs since removed);
the hmma epilogue's table walk 4 or 8 escapes a step (``u12_hmma.ESC_UNROLL``, default 2): u12-tiles-walk4
5.379 ms against u12-tiles' 5.356, and in the fused way in PDL mode 2 5.289 (walk4) and 5.385 (walk8) against
5.272, on an H100 (524e331, bench/results/tried/step_ab_verify16_walk_524e331_h100.json).
Batch 1, a 512-token context, a device-length cache of 2048 slots; random
bf16 weights N(0, 0.02).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import platform
import statistics
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the bench scripts beside this one
import step_times as st  # noqa: E402  (SHAPES, graphed, random_, time_fn, to_u12, tile_u12)

from specpilot.kernels import fused_linear, u12_fused_linear, u12_hmma, u12_linear  # noqa: E402
from specpilot.kernels.overlap import overlap  # noqa: E402
from specpilot.kernels.u12_linear import U12Config  # noqa: E402
from specpilot.hf.config import ModelConfig  # noqa: E402
from specpilot.backends.kernel_hooks import fused_path  # noqa: E402
from specpilot.runtime.fused import GEMV_ROWS  # noqa: E402
from specpilot.runtime.model import Transformer  # noqa: E402

U12_VARIANTS = {  # name: FusedOps fields over the default ops
    "u12-unfused": dict(u12_kernel=""),
    "u12-epilogues": dict(u12_kernel="triton-u12", u12_norms_apart=True, u12_norm_handoff=False),
    "u12-prologue": dict(u12_kernel="triton-u12", u12_norms_apart=False, u12_norm_handoff=False),
    "u12-handoff": dict(u12_kernel="triton-u12", u12_norms_apart=True, u12_norm_handoff=True),  # the default
}
U12_VERIFY_VARIANTS = {  # a verify step (--q above 1) only: its u12 layers through u12_linear beside the norm kernels
    "u12-many-rows-off": dict(u12_many_rows=0),
}


U12_KNOB_VARIANTS = {  # name: kernel modules' launch-time settings (knobs_set) over the default u12 step
    "u12-parts-before": {"u12_fused_linear.PARTS_AFTER": False},  # a handed-in norm's parts summed before the loop
    "u12-o-bn8": {"u12_fused_linear.TUNED": {**u12_fused_linear.TUNED,  # o at the derived 8-row blocks
                                             (1, 4096, 4096, False): U12Config(8, 256, num_warps=4, num_stages=1,
                                                                               kernel="gemv2")}},
    "u12-before-bn8": {"u12_fused_linear.PARTS_AFTER": False, "u12_fused_linear.TUNED": {}},  # the default before 7db51f5
    "u12-gu-bn8-w2": {"u12_fused_linear.TUNED": {  # gate|up at the derived 8-row, 2-warp tile: the default at 7db51f5
        k: v for k, v in u12_fused_linear.TUNED.items() if k != (1, 28672, 4096, True)}},
    "u12-default-again": {},  # the default captured again: the spread between captures
    "u12-esc-table": dict(ESC_LANES="table"),  # the escapes from the side table, row pointers ahead
    "u12-esc-after": dict(ESC_LANES="table", ESC_AHEAD=False),  # every load of the table after the loop
}
U12_VERIFY_KNOB_VARIANTS = {  # the same, for a verify step (--q above 1: the mma and hmma kernels)
    "u12-esc-table": dict(ESC_LANES="table"),
    "u12-esc-lanes": dict(ESC_LANES="lanes"),  # the block kernels from the lanes too (the default before)
    "u12-lanes-g8": dict(ESC_LANES="lanes", LANE_GROUP=8),  # the lanes walked 8 a step (the default 4)
    "u12-lanes-g16": dict(ESC_LANES="lanes", LANE_GROUP=16),  # all of a row's lanes at once (16 at most)
    "u12-walk-1": {"u12_hmma.ESC_UNROLL": 1},  # the hmma epilogue's table walk one escape a step
}
U12_FEW_ROWS_KNOB_VARIANTS = {  # name: (the rows q it applies to, settings): verify steps of few rows
    "u12-gemv-rows": ((3, 4), dict(TENSOR_CORE_ROWS=5)),  # gemv2 at 3..4 rows, the default before
    "u12-hmma-wide": ((2, 8), {"u12_hmma.NARROW": False}),  # the hmma kernel's two n-tiles at <= 8 rows
}
W4 = {"u12_linear.TUNED_TILES": {  # the layer shapes at 64-row programs of 4 warps (TUNED_TILES' before b5fd050)
    **u12_linear.TUNED_TILES, **{(16, n, k): dataclasses.replace(u12_linear.TUNED_TILES[(16, n, k)], block_n=64, num_warps=4,
                                                                 maxnreg=168 if n == 6144 else 128)
                                 for n, k in ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336))}}}
TILES_KNOB_VARIANTS = {  # name: knobs over u12-tiles (--q above 1)
    "u12-tiles-ahead": {"u12_hmma.AHEAD": True},  # the hmma loop's register double buffer
    "u12-tiles-ahead-x": {"u12_hmma.AHEAD": True, "u12_hmma.AHEAD_X": True},  # and the next chunk's x into L1
    "u12-tiles-esc-split": {"u12_hmma.ESC_SPLIT": True},  # a split-K launch's escapes walked by its splits
    "u12-tiles-esc-late": {"u12_hmma.ESC_EARLY": "off"},  # the escape walk all after the loop (the default before)
    "u12-tiles-esc-early-split": {"u12_hmma.ESC_EARLY": "split-k"},  # early in the split-K launches only
    "u12-tiles-w4": W4,
}
TILES_CACHE_VARIANTS = {  # the hmma kernel's weight loads through both caches (the default before 2ed6199) or
    # L2 only, where by default they leave L1 first (u12_hmma.W_CACHE): --q above 1, not under --smoke (the
    # interpreter's loads take no cache policy)
    "u12-tiles-wcache-off": {"u12_hmma.W_CACHE": "ca"},
    "u12-tiles-wcg": {"u12_hmma.W_CACHE": "cg"},
}
TILES_PAST_16_VARIANTS = {  # name: knobs over u12-tiles, at --q above 16 only (at fewer rows the default step)
    "u12-tiles-mma-past-16": {"u12_linear.TILES_MAX_ROWS": 16},  # past 16 rows the mma kernel (the default before)
    "u12-tiles-wide-off": {"u12_hmma.WIDE": False},  # past 16 rows hmma blocks of 16 rows, not 32
    # the layer shapes' 32-row programs at 168 registers, not 128 (an H100's qkv at 32 rows: 22.19 µs
    # against 23.76, bench/results/tried/u12_linear_hmma_m32_tiles_h100.json); and at one warp a program.
    # In the H100's verify(32) both lost: 7.443 and 7.460 ms against u12-tiles' 6.490
    # (bench/results/tried/step_ab_verify32_r168_3d6c5d9_h100.json)
    "u12-tiles-r168": {"u12_linear.TUNED_TILES": {
        **u12_linear.TUNED_TILES, **{key: dataclasses.replace(cfg, maxnreg=168) for key, cfg in u12_linear.TUNED_TILES.items()
                                     if key[1] != 128256}}},
    "u12-tiles-w1-r168": {"u12_linear.TUNED_TILES": {
        **u12_linear.TUNED_TILES, **{key: dataclasses.replace(cfg, block_n=16, num_warps=1, maxnreg=168)
                                     for key, cfg in u12_linear.TUNED_TILES.items() if key[1] != 128256}}},
}
TILES_PAST_32_VARIANTS = {  # the same, at --q above u12_linear.TILES_MAX_ROWS (32) only
    "u12-tiles-hmma-to-64": {"u12_linear.TILES_MAX_ROWS": 64},  # 32-row hmma programs side by side, not mma
}


def tiles_knob_variants(q: int) -> dict[str, dict]:
    """The knob variants over u12-tiles of a step of q rows (above 1): the past-16 and past-32 ones only
    where they differ from the default step."""
    return {**TILES_KNOB_VARIANTS, **(TILES_PAST_16_VARIANTS if q > 16 else {}),
            **(TILES_PAST_32_VARIANTS if q > u12_linear.TILES_MAX_ROWS else {})}
# u12-tiles' twins at q rows, GPU only: (suffix, ops.u12_many_rows, PDL mode; None: the default's, which
# for a verify step of up to 16 rows is u12_fused_linear's epilogues and norm handoff in PDL mode 2)
TILES_WAYS = (("-many-rows-off", 0, None), ("-pdl-off", None, 0), ("-many-rows-off-pdl-off", 0, 0),
              ("-many-rows-32", 32, None))  # the fused way up to 32 rows (at --q above 16 only)
KNOB_MODULES = {"u12_linear": u12_linear, "u12_hmma": u12_hmma, "u12_fused_linear": u12_fused_linear}


def knob_variants(q: int) -> dict[str, dict]:
    """The u12 knob variants of a step of q rows: {name: {"module.attr" or u12_linear's attr: value}}."""
    if q == 1:
        return dict(U12_KNOB_VARIANTS)
    few = {name: knobs for name, ((lo, hi), knobs) in U12_FEW_ROWS_KNOB_VARIANTS.items() if lo <= q <= hi}
    return {**U12_VERIFY_KNOB_VARIANTS, **few}


@contextlib.contextmanager
def knobs_set(knobs: dict):
    """Kernel modules' launch-time settings (``KNOB_MODULES``; a bare name is u12_linear's) set, then restored."""
    targets = {}
    for name in knobs:
        module, _, attr = name.rpartition(".")
        targets[name] = (KNOB_MODULES[module or "u12_linear"], attr)
    saved = {name: getattr(mod, attr) for name, (mod, attr) in targets.items()}
    try:
        for name, value in knobs.items():
            mod, attr = targets[name]
            setattr(mod, attr, value)
        yield
    finally:
        for name, value in saved.items():
            mod, attr = targets[name]
            setattr(mod, attr, value)


# Programmatic dependent launch (kernels/overlap.py), off by default since the bf16 step measured
# slower with it in CUDA graphs; the u12 step's GEMVs are shorter, so their launch ramps weigh more.
# Both steps with each mode, AR only: (name, the step it varies, overlap's keywords). The u12 AR
# step's default is mode 2 (runtime/fused.py's U12_PDL), so u12-plain forces mode 0 (overlap's
# setting wins over the deployment's default: kernels/overlap.py's default_pdl).
OVERLAP_VARIANTS = (
    ("bf16-pdl", "bf16", dict(pdl=1)), ("bf16-pdl-wait", "bf16", dict(pdl=2)),
    ("u12-pdl", "u12", dict(pdl=1)), ("u12-pdl-wait", "u12", dict(pdl=2)),
    ("u12-plain", "u12", dict(pdl=0)),  # the default step until 3cf2c55
)


def _bf16_registers(maxnreg: int, names: tuple[str, ...]) -> dict:
    """fused_linear's M = 1 TUNED entries of the layers `names` with ptxas allowed `maxnreg` registers."""
    keys = {"qkv": (1, 6144, 4096, False), "o": (1, 4096, 4096, False), "gate_up": (1, 28672, 4096, True),
            "down": (1, 4096, 14336, False)}
    return {keys[n]: dataclasses.replace(fused_linear.TUNED[keys[n]], maxnreg=maxnreg) for n in names}


# The bf16 step with fused_linear's configs at other register budgets. TUNED allows o and down 128
# since b8d00fd, where this measured 4.142 ms for them at 128 (4.139 at 80) against 4.237 at ptxas's
# default and 4.180 with every M = 1 linear at 128; bf16-default keeps that comparison.
BF16_VARIANTS = {
    "bf16-default": _bf16_registers(0, ("o", "down")),
    "bf16-r128": _bf16_registers(128, ("qkv", "o", "gate_up", "down")),
}


def tuned_from_sweep(path: Path, config_type: type, m_key: int = 1, layout: str = "rows") -> dict:
    """TUNED entries of the rows key m_key (a kernel module's bucket of M) from a sweep's results file
    (bench/fused_linear.py, bench/u12_linear.py or bench/u12_fused_linear.py): its "tuned" list, each entry's fields of
    config_type (FusedLinearConfig or U12Config) made a config again; those measured on weights in
    `layout` (bench/u12_linear.py's entries say; others are rows')."""
    names = {f.name for f in dataclasses.fields(config_type)}
    return {tuple(e["key"]): config_type(**{k: v for k, v in e.items() if k in names})
            for e in json.loads(path.read_text())["tuned"]
            if e["key"][0] == m_key and e.get("layout", "rows") == layout}


class Replay:
    """A captured step: calling it replays the graph; ``logits()`` is what the last replay wrote."""

    def __init__(self, replay, held: dict) -> None:
        self.replay, self.held = replay, held

    def __call__(self) -> None:
        self.replay()

    def logits(self) -> torch.Tensor:
        return self.held["logits"]


class Ran(Replay):
    """--smoke (the CPU, no graphs): the step run once as it is captured, under its variant's settings
    (calling the bare step later would run it under the last capture's, on the last weights), timed
    by the clock; calling it again does nothing, ``logits()`` is that run's."""

    def __init__(self, step, held: dict) -> None:
        (self.seconds,) = st.time_fn(step, 1)  # the CPU's: one run by the clock
        super().__init__(lambda: None, held)


def check_outputs(graphs: dict) -> dict[str, dict]:
    """Each variant's logits after one replay against the bf16 step's (the same weights, u12's
    lossless): the largest difference, and the share of positions whose greedy token agrees. A
    variant whose kernels raced or read the wrong buffers shows here; rounding alone moves random
    weights' logits by a few hundredths and may flip a near tie."""
    def replayed(g) -> torch.Tensor:
        g()
        if st.DEVICE == "cuda":
            torch.cuda.synchronize()
        return g.logits().float().clone()

    out = {}
    with torch.inference_mode():
        ref = replayed(graphs["bf16"])
        for name, g in graphs.items():
            y = replayed(g)
            out[name] = dict(max_abs_diff_vs_bf16=(y - ref).abs().max().item(),
                             greedy_agree_vs_bf16=(y.argmax(-1) == ref.argmax(-1)).float().mean().item(),
                             finite=bool(torch.isfinite(y).all()))
    return out


@torch.inference_mode()
def capture(shape: str, variants: bool, extra_bf16: dict | None = None, extra_u12: dict | None = None,
            q: int = 1, extra_u12_fused: dict | None = None, extra_u12_tiles: dict | None = None,
            only: frozenset | None = None) -> tuple[dict, list]:
    """({variant: graph replay} over one model's weights, what the graphs read and must outlive:
    the caches, and the bf16 weights that the u12 modules replaced). q: the step's new tokens (1:
    AR; more: a chain verify, where bf16-linear runs fused_linear at those rows too). only: the
    variants to capture (bf16, the baseline, always), else all."""
    cfg = ModelConfig.from_hf(st.SHAPES[shape], shape)
    torch.manual_seed(0)
    with torch.device(st.DEVICE):
        model = Transformer(cfg).to(torch.bfloat16)
    st.random_(model)
    ids = torch.randint(0, cfg.vocab_size, (1, q), generator=torch.Generator().manual_seed(1)).to(st.DEVICE)
    start = torch.tensor(st.CACHE_LEN, device=st.DEVICE)
    graphs, keep = {}, []

    def capture_step():
        cache = model.new_cache(1, st.CAPACITY, device_length=True)
        keep.append(cache)
        held = {}

        def step():
            cache.length.copy_(start)
            held["logits"] = model(ids, cache).logits  # a graph's output: its last capture's tensor
        return Ran(step, held) if st.DEVICE == "cpu" else Replay(st.graphed(step), held)

    def add(name: str) -> None:
        if only is None or name == "bf16" or name in only:
            graphs[name] = capture_step()

    with fused_path(model):
        add("bf16")
        if variants:
            for name, override in {**(BF16_VARIANTS if q == 1 else {}), **(extra_bf16 or {})}.items():
                with _tuned(fused_linear.TUNED, override):
                    add(name)
        if variants and q == 1:
            for name, step, kw in OVERLAP_VARIANTS:
                if step == "bf16":
                    with overlap(**kw):
                        add(name)
        if q > 1:  # fused_linear (norm prologue, SiLU·mul and residual epilogues) at q rows, and cuBLAS
            ops = model.fused.ops
            at_q = dict(linear_max_m=q, linear_gemv_max_m=min(q, GEMV_ROWS), linear_gap=(0, 0))
            model.fused.ops = dataclasses.replace(ops, linear_max_m=1)  # cuBLAS with the separate kernels
            add("bf16-cublas")
            model.fused.ops = dataclasses.replace(ops, **at_q)
            with _tuned(fused_linear.TUNED, (extra_bf16 or {}).get("bf16-sweep", {})):
                add("bf16-linear")
                if variants:
                    with overlap(pdl=2):  # the same in PDL mode 2 (the u12 verify step's default mode)
                        add("bf16-linear-pdl-wait")
                    # each norm prologue reading x, as before RowSquares
                    model.fused.ops = dataclasses.replace(ops, **at_q, row_squares=False)
                    add("bf16-linear-nosq")
            model.fused.ops = ops
    keep += [model._fused_kept, list(model.linear_modules().values())]  # the bf16 graph reads these
    st.to_u12(model)
    with fused_path(model):
        ops = model.fused.ops
        for name, fields in {**U12_VARIANTS, **(U12_VERIFY_VARIANTS if q > 1 else {})}.items():
            model.fused.ops = dataclasses.replace(ops, **fields)
            add(name)
        model.fused.ops = ops
        for name, knobs in knob_variants(q).items():
            with knobs_set(knobs):
                add(name)
        if variants and q == 1:
            for name, step, kw in OVERLAP_VARIANTS:
                if step == "u12":
                    with overlap(**kw):
                        add(name)
        for name, override in (extra_u12 or {}).items():  # the default u12 step at a sweep's configs for its rows
            with _tuned(u12_linear.TUNED, override):
                add(name)
        for name, override in (extra_u12_fused or {}).items():  # and with u12_fused_linear's own
            with _tuned(u12_fused_linear.TUNED, override):
                add(name)
    keep += [model._fused_kept, list(model.linear_modules().values())]  # the row planes the graphs read
    st.tile_u12(model)
    with fused_path(model):  # the default u12 step on tiled weights: TUNED_TILES from 3 rows
        ops = model.fused.ops

        add("u12-tiles")
        if q > 1:  # the hmma kernel's knobs, not yet defaults, on the tiles they were built for
            for name, knobs in {**tiles_knob_variants(q), **(TILES_CACHE_VARIANTS if variants else {})}.items():
                with knobs_set(knobs):
                    add(name)
            for suffix, many_rows, pdl in TILES_WAYS if variants else ():  # not under --smoke (at its 4 rows
                # all alike; PDL: GPU only)
                if many_rows == 32 and q <= 16:  # the default's way at q rows
                    continue
                model.fused.ops = ops if many_rows is None else dataclasses.replace(ops, u12_many_rows=many_rows)
                with overlap(pdl=pdl):
                    add("u12-tiles" + suffix)
            model.fused.ops = ops
        for name, override in (extra_u12_tiles or {}).items():  # at a sweep's configs for tiled weights
            with _tuned(u12_linear.TUNED_TILES, override):
                add(name)
    return graphs, keep


@contextlib.contextmanager
def _tuned(tuned: dict, override: dict):
    """A kernel module's TUNED with `override`'s entries (read when a capture launches each kernel)."""
    saved = dict(tuned)
    tuned.update(override)
    try:
        yield
    finally:
        tuned.clear()
        tuned.update(saved)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--repeats", type=int, default=25)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--bf16-tuned", type=Path,
                    help="a bench/fused_linear.py results file: its configs for the step's rows as the variant bf16-sweep")
    ap.add_argument("--u12-tuned", type=Path,
                    help="a bench/u12_linear.py results file: its configs for the step's rows as the variant u12-sweep")
    ap.add_argument("--u12-fused-tuned", type=Path,
                    help="a bench/u12_fused_linear.py results file: its configs for the step's rows as the variant "
                         "u12-fused-sweep")
    ap.add_argument("--tiles-tuned", type=Path,
                    help="a bench/u12_linear.py or bench/hmma_knobs.py results file: its configs for tiled weights "
                         "(M = 16 key) as the variant u12-tiles-sweep (in place of --u12-tuned's)")
    ap.add_argument("--only", help="comma-separated variants to capture and time (bf16 always): a short run")
    ap.add_argument("--q", type=int, default=1, help="new tokens a step: 1 (AR) or a chain verify's q")
    ap.add_argument("--smoke", action="store_true",
                    help="a tiny shape on the CPU under TRITON_INTERPRET=1: checks the script, measures nothing")
    args = ap.parse_args()
    shape = "llama-3.1-8b"
    if args.smoke:
        if os.environ.get("TRITON_INTERPRET") != "1":
            print("--smoke runs the Triton kernels in the interpreter: set TRITON_INTERPRET=1", file=sys.stderr)
            return 2
        st.DEVICE, st.CACHE_LEN, st.CAPACITY, shape, args.rounds, args.repeats = "cpu", 24, 96, "tiny", 1, 1
    elif not torch.cuda.is_available():
        print("bench/step_ab.py needs a CUDA GPU (or --smoke)", file=sys.stderr)
        return 2
    extra = {"bf16-sweep": tuned_from_sweep(args.bf16_tuned, fused_linear.FusedLinearConfig,
                                            fused_linear.m_bucket(args.q))} if args.bf16_tuned else None
    extra_u12 = {"u12-sweep": tuned_from_sweep(args.u12_tuned, u12_linear.U12Config, u12_linear._block_m(args.q))
                 } if args.u12_tuned else None
    tiles_file = args.tiles_tuned or args.u12_tuned
    extra_u12_tiles = {"u12-tiles-sweep": tuned_from_sweep(tiles_file, u12_linear.U12Config, 16, "tiles")
                       } if tiles_file and 3 <= args.q <= 16 else None
    extra_u12_fused = {"u12-fused-sweep": tuned_from_sweep(args.u12_fused_tuned, u12_linear.U12Config,
                                                           u12_linear._block_m(args.q))} if args.u12_fused_tuned else None
    graphs, _keep = capture(shape, variants=not args.smoke, extra_bf16=extra, extra_u12=extra_u12, q=args.q,
                            extra_u12_fused=extra_u12_fused, extra_u12_tiles=extra_u12_tiles,
                            only=frozenset(args.only.split(",")) if args.only else None)
    missing = sorted(set(args.only.split(",")) - set(graphs)) if args.only else []
    if missing:  # a misspelt name, or one these flags do not capture (the PDL variants under --smoke)
        print(f"bench/step_ab.py --only: no variant {missing} in this run; it captured {sorted(graphs)}", file=sys.stderr)
        return 2
    names = list(graphs)
    per_round: dict[str, list[float]] = {n: [] for n in names}
    with torch.inference_mode():  # (--smoke: each step ran once as it was captured, ``Ran``)
        for r in range(args.rounds):
            order = names[r % len(names):] + names[: r % len(names)]  # rotated: no variant always first
            for n in order:
                g = graphs[n]
                seconds = g.seconds if isinstance(g, Ran) else statistics.median(st.time_fn(g, args.repeats))
                per_round[n].append(seconds * 1e3)
    checks = check_outputs(graphs)
    rows = []
    for n in names:
        ms = per_round[n]
        row = dict(variant=n, ms=statistics.median(ms), min_ms=min(ms), max_ms=max(ms), rounds=ms, **checks[n])
        if n != "bf16":
            row["speedup_vs_bf16"] = statistics.median(b / u for b, u in zip(per_round["bf16"], ms))
        rows.append(row)
    gpu = torch.cuda.get_device_name() if st.DEVICE == "cuda" else "cpu"
    result = {
        "benchmark": "step_ab", "gpu": gpu, "torch": torch.__version__, "triton": triton.__version__,
        "python": platform.python_version(), "commit": os.environ.get("SPECPILOT_COMMIT", "unknown"),
        "shape": shape, "step": "ar" if args.q == 1 else f"verify-{args.q}", "q": args.q, "cache_len": st.CACHE_LEN,
        "method": f"CUDA graph per variant; {args.rounds} rounds in rotated order, each the median of "
                  f"{args.repeats} replays (CUDA events); random bf16 N(0,0.02) weights; batch 1",
        "rows": rows,
    }
    slug = "h200" if "H200" in gpu else gpu.lower().replace(" ", "-")
    out = args.out or Path(__file__).parent / "results" / f"step_ab_{slug}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"{gpu} -> {out}")
    print(f"{'variant':15} {'ms':>7} {'min':>7} {'max':>7} {'x bf16':>7} {'|dlogit|':>8} {'greedy':>6}")
    for r in rows:
        print(f"{r['variant']:15} {r['ms']:7.3f} {r['min_ms']:7.3f} {r['max_ms']:7.3f} "
              f"{r.get('speedup_vs_bf16', 1.0):7.3f} {r['max_abs_diff_vs_bf16']:8.3g} {r['greedy_agree_vs_bf16']:6.2f}"
              + ("" if r["finite"] else " NOT FINITE"))
    return 0


if __name__ == "__main__":
    sys.exit(main())

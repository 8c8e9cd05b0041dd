"""Interleaved A/B of the Llama-3.1-8B fused step: bf16 against the u12 variants, on one GPU.

    python -m bench.steps.step_ab [--q 1] [--rounds 12] [--repeats 25] [--only V1,V2] [--bf16-tuned FILE]
                                  [--u12-tuned FILE] [--u12-fused-tuned FILE] [--tiles-tuned FILE]
                                  [--out FILE|DIR] [--tag TAG]
    python -m bench.steps.step_ab --smoke [--q 4]   # a tiny model on the CPU (TRITON_INTERPRET=1)

bench.steps.step_times measures each path once, one after another, and between its runs the u12
rows moved by up to 8% while the bf16 rows moved by 1% (the u12 kernels decode on the CUDA cores,
so they follow the clock more than the bandwidth-bound bf16 ones do). Here every variant's step is
captured once in a CUDA graph over the same random weights (N(0, 0.02), batch 1, a 512-token
context, a device-length cache of 2048 slots), then the graphs are replayed in rounds, each round
timing every variant (CUDA events, median of `repeats` replays) in a rotated order, so drift
reaches all variants alike. Reported per variant: the median over rounds and the spread; per
variant, the median of the per-round ratios bf16 / variant; and its logits against bf16's.

Variants (runtime/fused.py's FusedOps; kernels/overlap.py's Launch; the kernels' TUNED tables):
  bf16                 the fused path: fused_linear with its norm prologues and epilogues
  bf16-default, -r128  (AR) fused_linear's configs at other register budgets (BF16_VARIANTS)
  bf16-pdl, -pdl-wait  (AR) the bf16 step in PDL mode 1 or 2 (the bf16 default: off)
  bf16-cublas          (--q > 1) cuBLAS with the separate norm, SiLU·mul and add kernels
  bf16-linear          (--q > 1) fused_linear at the step's rows; -pdl-wait in PDL mode 2; -nosq
                       with each norm prologue reading x (no RowSquares)
  u12-unfused          u12_linear beside the separate rmsnorm, SiLU·mul and add kernels
  u12-epilogues        u12_fused_linear's SiLU·mul and residual epilogues, the norms as rmsnorm kernels
  u12-prologue         the same with u12_fused_linear's norm prologue too
  u12-handoff          the epilogues with each norm after o and down handed on (NormHandoff): the default
  u12-many-rows-off    (--q > 1) the u12 layers through u12_linear beside the norm kernels
  u12-o-bn8, u12-gu-bn8-w2  (AR) o, or gate|up, at the config derived from the dispatcher's in
                       place of TUNED_FUSED's
  u12-default-again    (AR) the default captured again: the spread between captures of one step
  u12-pdl, -pdl-wait, u12-plain  (AR) the u12 step in PDL mode 1, 2 (its default), or 0
  u12-tiles            the default u12 step on tiled weights (weights-u12's layout=auto for verify)
  u12-tiles-w4         (--q > 1) the layer shapes' hmma programs at 64 rows of 4 warps
  u12-tiles-many-rows-off, -pdl-off, -many-rows-off-pdl-off, -many-rows-32  (--q > 1, GPU) u12-tiles
                       through u12_linear beside the norm kernels, in PDL mode 0, both, or the fused
                       way up to 32 rows (--q > 16)
  u12-tiles-r168, -w1-r168  (--q > 16) the layer shapes' 32-row programs at 168 registers, of 2 or 1 warps
  u12-sweep, u12-fused-sweep, u12-tiles-sweep, bf16-sweep  the default step with a sweep's TUNED
                       entries for its rows (--u12-tuned, --u12-fused-tuned, --tiles-tuned, --bf16-tuned)
Under --smoke only the variants that differ on a tiny model run (no PDL, no register budgets).
What each comparison found: docs/experiments/step-times-8b.md, u12-escapes.md, u12-hmma.md,
u12-gemv2.md, pdl-and-prefetch.md.

Writes bench/results/step_ab_<gpu>[_<tag>].json through the harness (records: variant, ms, min_ms,
max_ms, rounds, speedup_vs_bf16, and the logits' check) and prints a table.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import statistics
import sys
from pathlib import Path

import torch

from bench import shapes
from bench.steps import step_times as st
from specpilot.backends.kernel_hooks import fused_path, with_launch
from specpilot.bench import harness
from specpilot.hf.config import ModelConfig
from specpilot.kernels import fused_linear
from specpilot.kernels.overlap import Launch
from specpilot.kernels.u12 import TUNED, TUNED_TILES, U12Config
from specpilot.kernels.u12.epilogue import block_m
from specpilot.kernels.u12.fused import TUNED_FUSED
from specpilot.runtime.fused import GEMV_ROWS
from specpilot.runtime.model import Transformer

MODEL = shapes.LLAMA_8B
LINEARS = shapes.layer_linears(MODEL)
LAYER = ("qkv", "o", "gate_up", "down")

U12_VARIANTS = {  # name: FusedOps fields over the default ops
    "u12-unfused": dict(u12_kernel=""),
    "u12-epilogues": dict(u12_kernel="triton-u12", u12_norms_apart=True, u12_norm_handoff=False),
    "u12-prologue": dict(u12_kernel="triton-u12", u12_norms_apart=False, u12_norm_handoff=False),
    "u12-handoff": dict(u12_kernel="triton-u12", u12_norms_apart=True, u12_norm_handoff=True),  # the default
}
U12_VERIFY_VARIANTS = {  # a verify step (--q above 1) only: its u12 layers through u12_linear beside the norm kernels
    "u12-many-rows-off": dict(u12_many_rows=0),
}


def fused_key(name: str, m: int = 1) -> tuple[int, int, int, bool]:
    n, k = LINEARS[name]
    return (m, n, k, name == "gate_up")


# name: (the kernel table, its entries over the default's) for the AR step; a None entry drops the key
U12_TUNED_VARIANTS = {
    "u12-o-bn8": (TUNED_FUSED, {fused_key("o"): U12Config(8, 256, num_warps=4, num_stages=1, kernel="gemv2")}),
    "u12-gu-bn8-w2": (TUNED_FUSED, {fused_key("gate_up"): None}),
    "u12-default-again": (TUNED_FUSED, {}),
}


def _tiles(change) -> dict:
    """TUNED_TILES' layer-shape entries (the lm_head's aside), each with the fields `change(key)` gives."""
    keys = [(16, *LINEARS[name]) for name in LAYER]
    return {key: dataclasses.replace(TUNED_TILES[key], **change(key)) for key in keys if key in TUNED_TILES}


TILES_TUNED_VARIANTS = {  # name: TUNED_TILES entries over u12-tiles' (--q above 1)
    "u12-tiles-w4": _tiles(lambda key: dict(block_n=64, num_warps=4, maxnreg=168 if key[1] == LINEARS["qkv"][0] else 128)),
}
TILES_PAST_16_VARIANTS = {  # the same at --q above 16 only
    "u12-tiles-r168": _tiles(lambda key: dict(maxnreg=168)),
    "u12-tiles-w1-r168": _tiles(lambda key: dict(block_n=16, num_warps=1, maxnreg=168)),
}
# u12-tiles' twins, GPU only: (suffix, ops.u12_many_rows or None for the default's, the Launch or None
# for the default's: up to 16 rows u12_fused_linear's epilogues and the norm handoff in PDL mode 2)
TILES_WAYS = (("-many-rows-off", 0, None), ("-pdl-off", None, Launch()), ("-many-rows-off-pdl-off", 0, Launch()),
              ("-many-rows-32", 32, None))  # the fused way up to 32 rows (at --q above 16 only)
LAUNCH_VARIANTS = (  # (name, the step it varies, its launch): AR only, GPU only
    ("bf16-pdl", "bf16", Launch(pdl=1)), ("bf16-pdl-wait", "bf16", Launch(pdl=2)),
    ("u12-pdl", "u12", Launch(pdl=1)), ("u12-pdl-wait", "u12", Launch(pdl=2)),  # u12-pdl-wait: the default's
    ("u12-plain", "u12", Launch()),
)


def _bf16_registers(maxnreg: int, names: tuple[str, ...]) -> dict:
    """fused_linear's M = 1 TUNED entries of the layers `names` with ptxas allowed `maxnreg` registers."""
    return {fused_key(n): dataclasses.replace(fused_linear.TUNED[fused_key(n)], maxnreg=maxnreg) for n in names}


# The bf16 step with fused_linear's configs at other register budgets (TUNED allows o and down 128:
# docs/experiments/fused-linear.md).
BF16_VARIANTS = {
    "bf16-default": _bf16_registers(0, ("o", "down")),
    "bf16-r128": _bf16_registers(128, LAYER),
}


def tiles_tuned_variants(q: int) -> dict[str, dict]:
    """The TUNED_TILES variants over u12-tiles of a verify step of q rows: the past-16 ones only above 16."""
    return {**TILES_TUNED_VARIANTS, **(TILES_PAST_16_VARIANTS if q > 16 else {})}


def tuned_from_sweep(path: Path, config_type: type, m_key: int = 1, layout: str = "rows") -> dict:
    """TUNED entries of the rows key m_key (a kernel's bucket of M) from a sweep's results file
    (bench.kernels.fused_linear, u12_linear, u12_fused_linear or hmma_knobs): its "tuned" list, each
    entry's fields of config_type (FusedLinearConfig or U12Config) made a config again; those
    measured on weights in `layout` (u12_linear's entries say; others are rows')."""
    names = {f.name for f in dataclasses.fields(config_type)}
    return {tuple(e["key"]): config_type(**{k: v for k, v in e.items() if k in names})
            for e in json.loads(path.read_text())["tuned"]
            if e["key"][0] == m_key and e.get("layout", "rows") == layout}


@contextlib.contextmanager
def tuned(table: dict, override: dict):
    """A kernel's TUNED table with `override`'s entries (a None value drops the key) while a capture
    launches its kernels (the dispatchers read their tables at launch), restored after."""
    saved = dict(table)
    for key, cfg in override.items():
        if cfg is None:
            table.pop(key, None)
        else:
            table[key] = cfg
    try:
        yield
    finally:
        table.clear()
        table.update(saved)


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
        (self.seconds,) = st.time_fn(step, 1)
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
    AR; more: a chain verify). variants: the GPU's variants too (launches, register budgets,
    TUNED entries of the 8B shapes). only: the variants to capture (bf16, the baseline, always)."""
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

    def add(name: str, launch: Launch | None = None, **fields) -> None:
        """Capture the step as `name` with FusedOps `fields` and every forward's `launch` over the default ops."""
        if only is None or name == "bf16" or name in only:
            ops = model.fused.ops
            varied = dataclasses.replace(ops, **fields) if fields else ops
            model.fused.ops = with_launch(varied, launch) if launch is not None else varied
            try:
                graphs[name] = capture_step()
            finally:
                model.fused.ops = ops

    with fused_path(model):
        add("bf16")
        if variants and q == 1:
            for name, override in BF16_VARIANTS.items():
                with tuned(fused_linear.TUNED, override):
                    add(name)
            for name, step, launch in LAUNCH_VARIANTS:
                if step == "bf16":
                    add(name, launch)
        for name, override in (extra_bf16 or {}).items():  # the bf16 step at a sweep's configs for its rows
            with tuned(fused_linear.TUNED, override):
                add(name)
        if q > 1:  # fused_linear (norm prologue, SiLU·mul and residual epilogues) at q rows, and cuBLAS
            at_q = dict(linear_max_m=q, linear_gemv_max_m=min(q, GEMV_ROWS), linear_gap=(0, 0))
            add("bf16-cublas", linear_max_m=1)
            with tuned(fused_linear.TUNED, (extra_bf16 or {}).get("bf16-sweep", {})):
                add("bf16-linear", **at_q)
                if variants:
                    add("bf16-linear-pdl-wait", Launch(pdl=2), **at_q)
                    add("bf16-linear-nosq", **at_q, row_squares=False)
    keep += [model.fused_kept, list(model.linear_modules().values())]  # the bf16 graph reads these
    st.to_u12(model)
    with fused_path(model):
        for name, fields in {**U12_VARIANTS, **(U12_VERIFY_VARIANTS if q > 1 else {})}.items():
            add(name, **fields)
        if variants and q == 1:
            for name, (table, override) in U12_TUNED_VARIANTS.items():
                with tuned(table, override):
                    add(name)
            for name, step, launch in LAUNCH_VARIANTS:
                if step == "u12":
                    add(name, launch)
        for name, override in (extra_u12 or {}).items():  # the default u12 step at a sweep's configs for its rows
            with tuned(TUNED, override):
                add(name)
        for name, override in (extra_u12_fused or {}).items():  # and with u12_fused_linear's own
            with tuned(TUNED_FUSED, override):
                add(name)
    keep += [model.fused_kept, list(model.linear_modules().values())]  # the row planes the graphs read
    st.tile_u12(model)
    with fused_path(model):  # the default u12 step on tiled weights: TUNED_TILES from 3 rows
        add("u12-tiles")
        if q > 1 and variants:
            for name, override in tiles_tuned_variants(q).items():
                with tuned(TUNED_TILES, override):
                    add(name)
            for suffix, many_rows, launch in TILES_WAYS:
                if many_rows == 32 and q <= 16:  # the default's way at q rows
                    continue
                fields = {} if many_rows is None else dict(u12_many_rows=many_rows)
                add("u12-tiles" + suffix, launch, **fields)
        for name, override in (extra_u12_tiles or {}).items():  # at a sweep's configs for tiled weights
            with tuned(TUNED_TILES, override):
                add(name)
    return graphs, keep


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    harness.add_results_args(ap)
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--repeats", type=int, default=25)
    ap.add_argument("--bf16-tuned", type=Path,
                    help="a bench.kernels.fused_linear results file: its configs for the step's rows as the variant bf16-sweep")
    ap.add_argument("--u12-tuned", type=Path,
                    help="a bench.kernels.u12_linear results file: its configs for the step's rows as the variant u12-sweep")
    ap.add_argument("--u12-fused-tuned", type=Path,
                    help="a bench.kernels.u12_fused_linear results file: its configs for the step's rows as the "
                         "variant u12-fused-sweep")
    ap.add_argument("--tiles-tuned", type=Path,
                    help="a bench.kernels.u12_linear or hmma_knobs results file: its configs for tiled weights "
                         "(M = 16 key) as the variant u12-tiles-sweep (in place of --u12-tuned's)")
    ap.add_argument("--only", help="comma-separated variants to capture and time (bf16 always): a short run")
    ap.add_argument("--q", type=int, default=1, help="new tokens a step: 1 (AR) or a chain verify's q")
    args = ap.parse_args(argv)
    if args.q < 1:
        print(f"bench.steps.step_ab --q: expected a positive count of new tokens, got {args.q}", file=sys.stderr)
        return 2
    if reason := harness.refuse_device("bench.steps.step_ab", args.smoke):
        print(reason, file=sys.stderr)
        return 2
    shape = MODEL
    if args.smoke:
        st.DEVICE, st.CACHE_LEN, st.CAPACITY, shape, args.rounds, args.repeats = "cpu", 24, 96, shapes.TINY, 1, 1
    else:
        st.DEVICE = "cuda"
    extra = {"bf16-sweep": tuned_from_sweep(args.bf16_tuned, fused_linear.FusedLinearConfig,
                                            fused_linear.m_bucket(args.q))} if args.bf16_tuned else None
    extra_u12 = {"u12-sweep": tuned_from_sweep(args.u12_tuned, U12Config, block_m(args.q))} if args.u12_tuned else None
    tiles_file = args.tiles_tuned or args.u12_tuned
    extra_u12_tiles = {"u12-tiles-sweep": tuned_from_sweep(tiles_file, U12Config, 16, "tiles")
                       } if tiles_file and 3 <= args.q <= 16 else None
    extra_u12_fused = {"u12-fused-sweep": tuned_from_sweep(args.u12_fused_tuned, U12Config, block_m(args.q))
                       } if args.u12_fused_tuned else None
    graphs, _keep = capture(shape, variants=not args.smoke, extra_bf16=extra, extra_u12=extra_u12, q=args.q,
                            extra_u12_fused=extra_u12_fused, extra_u12_tiles=extra_u12_tiles,
                            only=frozenset(args.only.split(",")) if args.only else None)
    missing = sorted(set(args.only.split(",")) - set(graphs)) if args.only else []
    if missing:  # a misspelt name, or one these flags do not capture (the GPU's variants under --smoke)
        print(f"bench.steps.step_ab --only: no variant {missing} in this run; it captured {sorted(graphs)}",
              file=sys.stderr)
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
    records = []
    for n in names:
        ms = per_round[n]
        row = dict(variant=n, ms=statistics.median(ms), min_ms=min(ms), max_ms=max(ms), rounds=ms, **checks[n])
        if n != "bf16":
            row["speedup_vs_bf16"] = statistics.median(b / u for b, u in zip(per_round["bf16"], ms))
        records.append(row)
    out = harness.write_run(args, "step_ab", st.DEVICE, records, shape=shape,
                            step="ar" if args.q == 1 else f"verify-{args.q}", q=args.q, cache_len=st.CACHE_LEN,
                            method=f"CUDA graph per variant; {args.rounds} rounds in rotated order, each the median "
                                   f"of {args.repeats} replays (CUDA events); random bf16 N(0,0.02) weights; batch 1")
    print(f"{harness.device_name(st.DEVICE)}, {shape}, q = {args.q}" + (f" -> {out}" if out else ""))
    print(f"{'variant':24} {'ms':>7} {'min':>7} {'max':>7} {'x bf16':>7} {'|dlogit|':>8} {'greedy':>6}")
    for r in records:
        print(f"{r['variant']:24} {r['ms']:7.3f} {r['min_ms']:7.3f} {r['max_ms']:7.3f} "
              f"{r.get('speedup_vs_bf16', 1.0):7.3f} {r['max_abs_diff_vs_bf16']:8.3g} {r['greedy_agree_vs_bf16']:6.2f}"
              + ("" if r["finite"] else " NOT FINITE"))
    return 0


if __name__ == "__main__":
    sys.exit(main())

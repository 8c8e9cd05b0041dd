"""The benchmark harness: one place for how specpilot measures and records.

- `measure`: the AR baseline and an engine over prompts (what `specpilot compile` reports). Times
  exclude prefill (the loops time it separately) and come from the runtime's own clocks, which
  synchronise the GPU when there is one.
- `time_graph` / `time_events`: a step or kernel captured in a CUDA graph (or run eagerly), timed
  by CUDA events, median of repeats; wall clock on a CPU (a check, never a figure to quote).
  `time_interleaved`: several variants timed round by round in rotated order, so that a drift of
  the card's clocks or temperature lands on all of them alike (the A/B comparisons).
- `write_results`: every bench/ script's results file, one schema, with commit, date, device and
  versions inside, named `bench/results/<bench>_<gpu>[_<tag>].json`; `add_results_args` gives a
  script its `--out` (a file, or a folder to write the named file into) and `--tag`, and
  `refuse_device` the one check of where a script can run (`--smoke`: the CPU under the Triton
  interpreter; otherwise a CUDA GPU).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import importlib
import json
import os
import platform
import re
import statistics
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .. import __version__

ROOT = Path(__file__).resolve().parents[2]  # the checkout (bench/results lives here)


@dataclass
class Measurement:
    """AR baseline and engine runs over the benchmark prompts (prefill excluded from times)."""

    prompts: list[list[int]] = field(default_factory=list)
    ar_tokens: list[list[int]] = field(default_factory=list)
    spec_tokens: list[list[int]] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)
    spec_accepted: list[list[int]] = field(default_factory=list)  # per prompt: each step's accepted drafts
    ar_decode_s: float = 0.0
    spec_decode_s: float = 0.0
    served_tau: float | None = None  # a batched run's τ (its engine's stats), where steps are not per prompt
    ar_prompt_s: list[float] = field(default_factory=list)  # per prompt (batch 1): the AR loop's decode seconds
    spec_prompt_s: list[float] = field(default_factory=list)  # and the engine's

    def prompt_ratios(self) -> list[float]:
        """Per prompt, engine ms/token over the AR ms/token measured beside it (batch 1; empty otherwise)."""
        out = []
        for a_s, s_s, a, s in zip(self.ar_prompt_s, self.spec_prompt_s, self.ar_tokens, self.spec_tokens):
            if a_s > 0 and s_s > 0 and a and s:
                out.append((s_s / len(s)) / (a_s / len(a)))
        return out

    @property
    def tau(self) -> float:
        if self.served_tau is not None:
            return self.served_tau
        return (sum(self.accepted) + len(self.accepted)) / max(1, len(self.accepted))

    @property
    def ar_ms_per_token(self) -> float:
        return 1e3 * self.ar_decode_s / max(1, sum(map(len, self.ar_tokens)))

    @property
    def spec_ms_per_token(self) -> float:
        return 1e3 * self.spec_decode_s / max(1, sum(map(len, self.spec_tokens)))

    @property
    def speedup(self) -> float:
        return self.ar_ms_per_token / self.spec_ms_per_token if self.spec_ms_per_token else 0.0

    @property
    def matches_ar(self) -> int:
        return sum(a == s for a, s in zip(self.ar_tokens, self.spec_tokens))

    def acceptance_histogram(self, block: int) -> list[int]:
        hist = [0] * (block + 1)
        for a in self.accepted:
            hist[min(a, block)] += 1
        return hist


def measure(engine, baseline, prompts: list[list[int]], max_new_tokens: int, progress=None) -> Measurement:
    """AR greedy on `baseline` (the stock deployment: no passes) beside `engine`'s speculative
    decoding, prompt by prompt. The baseline keeps the checkpoint's weights and kernels, so what a
    pass gains on the target's own step (a weight format, a kernel) shows in the speedup. A replay
    engine (runtime/replay.py) takes each prompt's AR output as the first guess of its plan."""
    m = Measurement(prompts=prompts)
    warm = prompts[0][:8] or [0]
    baseline.generate_ar(warm, 4)
    engine.generate(warm, 4)
    for p in prompts:
        ar = baseline.generate_ar(p, max_new_tokens)
        if getattr(engine, "replay", None) is not None:
            engine.replay.suggest(p, ar.tokens)
        sp = engine.generate(p, max_new_tokens)
        m.ar_tokens.append(ar.tokens)
        m.spec_tokens.append(sp.tokens)
        m.accepted += sp.accepted
        m.spec_accepted.append(list(sp.accepted))
        m.ar_decode_s += ar.decode_s
        m.spec_decode_s += sp.decode_s
        m.ar_prompt_s.append(ar.decode_s)
        m.spec_prompt_s.append(sp.decode_s)
        if progress:
            progress()
    return m


def git_commit(short: bool = True) -> str:
    """SPECPILOT_COMMIT / GIT_COMMIT where set (a copied tree on a GPU machine has no .git), else
    HEAD, with "-dirty" when the tracked files differ from it."""
    for name in ("SPECPILOT_COMMIT", "GIT_COMMIT"):
        if os.environ.get(name):
            return os.environ[name]

    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], capture_output=True, text=True, cwd=ROOT, timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    head = git("rev-parse", *(["--short"] if short else []), "HEAD")
    if not head:
        return "unknown"
    return head + ("-dirty" if git("status", "--porcelain", "--untracked-files=no") else "")


@functools.lru_cache(maxsize=None)
def run_commit() -> str:
    """git_commit() as it was at this process's first call: a results file names the code that ran,
    not a HEAD that moved while it ran (add_results_args calls it at a script's start)."""
    return git_commit()


def versions() -> dict[str, str | None]:
    """The versions a measurement depends on (None: not installed)."""
    out: dict[str, str | None] = {"python": platform.python_version(), "torch": torch.__version__,
                                  "specpilot": __version__, "cuda": torch.version.cuda}
    for name in ("triton", "transformers"):
        try:
            out[name] = importlib.import_module(name).__version__
        except ImportError:
            out[name] = None
    return out


def device_name(device: torch.device | str) -> str:
    """The card's name ("NVIDIA H100 80GB HBM3"), or the CPU's."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return platform.processor() or platform.machine() or "cpu"


GPU_SLUGS = ("h200", "h100", "h20", "b200", "gh200", "a100", "a10g", "l40s", "l4", "rtx-4090")


def gpu_slug(device: torch.device | str) -> str:
    """The short name results files use for the device: "h200", "h100", ..., "cpu"."""
    device = torch.device(device)
    if device.type != "cuda":
        return "cpu"
    name = device_name(device).lower().replace(" ", "-")
    return next((s for s in sorted(GPU_SLUGS, key=len, reverse=True) if s in name), re.sub(r"[^a-z0-9]+", "-", name))


def environment(device: torch.device) -> dict:
    """Where a measurement ran: versions, commit, device (the compile report's `environment`)."""
    env = {**versions(), "commit": git_commit(), "device": str(device), "device_name": device_name(device)}
    if device.type == "cuda":
        env["gpu_name"] = env["device_name"]
    return env


# --- timing -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Timing:
    """Milliseconds of one call over repeats: median, p20 and p80. On a CPU, wall clock: a check
    that the code runs, never a measurement to quote."""

    median_ms: float
    p20_ms: float
    p80_ms: float
    repeats: int
    how: str  # "cuda-graph", "cuda-events" or "cpu-wall"

    @staticmethod
    def of(samples_ms: list[float], how: str) -> "Timing":
        q = sorted(samples_ms)
        at = lambda f: q[min(len(q) - 1, int(f * len(q)))]  # noqa: E731
        return Timing(statistics.median(q), at(0.2), at(0.8), len(q), how)

    def row(self) -> dict:
        return {"ms": self.median_ms, "p20_ms": self.p20_ms, "p80_ms": self.p80_ms, "repeats": self.repeats,
                "timing": self.how}


def _event_ms(fn: Callable[[], object]) -> float:
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    fn()
    b.record()
    b.synchronize()
    return a.elapsed_time(b)


def _wall_ms(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def _on_cuda(cuda: bool | None) -> bool:
    return torch.cuda.is_available() if cuda is None else cuda


def capture(fns: Callable[[], object] | Sequence[Callable[[], object]], warmup: int = 3,
            cuda: bool | None = None) -> Callable[[], None]:
    """`fns` (one or several, run in order) captured in one CUDA graph after `warmup` runs on a side
    stream; returns the replay. Off CUDA (`cuda` False, or no GPU), returns a function running them."""
    fns = [fns] if callable(fns) else list(fns)

    def run() -> None:
        for f in fns:
            f()

    if not _on_cuda(cuda):
        return run
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            run()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    return graph.replay


def time_graph(fns: Callable[[], object] | Sequence[Callable[[], object]], repeats: int = 20,
               warmup: int = 3, cuda: bool | None = None) -> Timing:
    """`fns` captured in one CUDA graph (`capture`), each replay timed by CUDA events; off CUDA one
    wall-clock run a repeat."""
    replay = capture(fns, warmup, cuda)
    if not _on_cuda(cuda):
        return Timing.of([_wall_ms(replay) for _ in range(repeats)], "cpu-wall")
    for _ in range(warmup):
        replay()
    return Timing.of([_event_ms(replay) for _ in range(repeats)], "cuda-graph")


def event_samples(fn: Callable[[], object], repeats: int = 20, warmup: int = 3, cuda: bool | None = None) -> list[float]:
    """Milliseconds of each of `repeats` calls of `fn` after `warmup` calls: CUDA events around each
    call on a GPU, the wall clock elsewhere."""
    for _ in range(warmup):
        fn()
    if not _on_cuda(cuda):
        return [_wall_ms(fn) for _ in range(repeats)]
    torch.cuda.synchronize()
    return [_event_ms(fn) for _ in range(repeats)]


def time_events(fn: Callable[[], object], repeats: int = 20, warmup: int = 3, cuda: bool | None = None) -> Timing:
    """`fn` run eagerly, each call timed by CUDA events (wall clock off CUDA)."""
    return Timing.of(event_samples(fn, repeats, warmup, cuda), "cuda-events" if _on_cuda(cuda) else "cpu-wall")


def time_interleaved(variants: Mapping[str, Callable[[], object]], rounds: int = 10, repeats: int = 5,
                     warmup: int = 3, cuda: bool | None = None) -> dict[str, list[float]]:
    """Each variant's per-round medians (ms): every round times each variant `repeats` times, the
    variants in an order rotated by one each round, so that no variant always runs first or after
    the same one. Pass replays (`capture`) to compare graphed steps. Compare variants round by
    round (the same round's medians ran seconds apart) rather than by their overall medians alone."""
    names = list(variants)
    for fn in variants.values():
        for _ in range(warmup):
            fn()
    out: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        for n in names[r % len(names):] + names[:r % len(names)]:
            out[n].append(statistics.median(event_samples(variants[n], repeats, 0, cuda)))
    return out


def read_bandwidth(device: torch.device | str = "cuda", gib: float = 4, repeats: int = 20) -> float:
    """Bytes/s of a full read (a sum) over a `gib` GiB tensor: the card's practical read ceiling."""
    device = torch.device(device)
    x = torch.empty(int(gib * 2**30) // 2, device=device, dtype=torch.bfloat16).normal_()
    t = time_events(lambda: x.sum(), repeats, cuda=device.type == "cuda")
    return x.numel() * x.element_size() / (t.median_ms * 1e-3)


# --- results files ----------------------------------------------------------------------------

RESULTS = ROOT / "bench" / "results"
SCHEMA = 1


def results_name(bench: str, gpu: str, tag: str = "") -> str:
    """<bench>_<gpu>[_<tag>].json: one name scheme for every results file (`gpu` a slug: "h200", "cpu")."""
    return f"{bench}_{gpu}{'_' + tag if tag else ''}.json"


def results_path(bench: str, device: torch.device | str, tag: str = "") -> Path:
    """bench/results/<bench>_<gpu>[_<tag>].json for a run on `device`."""
    return RESULTS / results_name(bench, gpu_slug(device), tag)


def write_results(bench: str, device: torch.device | str, records: list[dict], *, args: dict | None = None,
                  out: str | Path | None = None, tag: str = "", gpu: str | None = None, **summary) -> Path:
    """Write one results file (schema 1): what ran (bench, args), where (commit, date, device, gpu,
    versions), its `records` (one dict a measured row) and any `summary` keys. `out`: the file, or a
    folder to write the file's name into; default bench/results/. `gpu`: the card the records
    describe where that is not the device the script ran on (a model's predictions priced for a
    card, on a CPU). Written whole or not at all (a temporary file renamed into place); returns its path."""
    device = torch.device(device)
    gpu = gpu or gpu_slug(device)
    doc = {"bench": bench, "schema": SCHEMA, "commit": run_commit(),
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "device": device_name(device), "gpu": gpu, "versions": versions(),
           "args": args or {}, **summary, "records": records}
    name = results_name(bench, gpu, tag)
    path = Path(out) if out else RESULTS / name
    if path.is_dir():  # a folder (run_gpu.sh's $OUT): the file named as in bench/results
        path = path / name
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=2, default=str) + "\n")
    os.replace(tmp, path)
    return path


def add_results_args(ap: argparse.ArgumentParser, smoke: bool = True) -> argparse.ArgumentParser:
    """A bench script's common flags: --out (a results file, or a folder to write its named file
    into), --tag (the name's tag: `<bench>_<gpu>_<tag>.json`) and, with `smoke`, --smoke."""
    ap.add_argument("--out", type=Path, help="results file, or a folder for <bench>_<gpu>[_<tag>].json "
                    "(default: bench/results/)")
    ap.add_argument("--tag", default="", help="the results file name's tag: <bench>_<gpu>_<tag>.json")
    run_commit()  # the commit the run starts from, for its results file
    if smoke:
        ap.add_argument("--smoke", action="store_true",
                        help="tiny shapes on the CPU (Triton under TRITON_INTERPRET=1): checks the script, measures nothing")
    return ap


def write_run(args: argparse.Namespace, bench: str, device: torch.device | str, records: list[dict],
              **summary) -> Path | None:
    """`write_results` for a script run with `add_results_args`' flags: its --out and --tag, every
    flag recorded as `args`. A --smoke run checks the script and measures nothing, so it writes only
    where --out says (None when it wrote nothing)."""
    if getattr(args, "smoke", False) and args.out is None:
        return None
    return write_results(bench, device, records, args=vars(args), out=args.out, tag=args.tag, **summary)


def refuse_device(script: str, smoke: bool, interpreter: bool = True) -> str | None:
    """Why `script` cannot run here, or None: a --smoke run of Triton kernels needs TRITON_INTERPRET=1
    (`interpreter`), any other run a CUDA GPU. The caller prints it and exits 2."""
    if smoke:
        if interpreter and os.environ.get("TRITON_INTERPRET") != "1":
            return f"{script} --smoke runs the Triton kernels in the interpreter: set TRITON_INTERPRET=1"
        return None
    if not torch.cuda.is_available():
        return f"{script} needs a CUDA GPU (or --smoke)"
    return None

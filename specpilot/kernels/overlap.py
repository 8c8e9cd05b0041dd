"""How a kernel overlaps its neighbours: programmatic dependent launch and L2 prefetch of weights.

PDL: the next kernel starts while this one drains.

A decode step is a chain of about 250 short kernels, each depending on the one before. Launched
the plain way, a kernel's programs are scheduled only once the previous kernel has finished and
its memory is flushed: a gap of a few microseconds at every boundary, where the GPU reads no
weights. On Hopper (sm_90) and later, a kernel launched with ``launch_pdl=True`` may be scheduled
while the previous one still runs. Each kernel that takes the ``PDL`` flag opens with
``pdl_enter``: ``gdc_launch_dependents`` (PTX ``griddepcontrol.launch_dependents``: the kernel after
this one may be scheduled once every program here has reached this point), then ``gdc_wait``
(``griddepcontrol.wait``: block until the kernel before has completed and its writes are
visible). Every load and store of such a kernel comes after the wait, so the order of memory
effects is the plain launch's; what overlaps is scheduling and launch latency (the waiting
programs hold their SM slots, which only the last wave of the kernel before leaves free). A
kernel launched plainly after a PDL kernel waits for it as usual, and a PDL kernel after a plain
one (a torch op) is released when that kernel's programs exit, so the mix is safe. CUDA graphs
capture the launches as programmatic edges (CUDA 12.3+).

Modes (the kernels' ``PDL`` flag, 0-2): 1 is the above; 2 waits only (no explicit trigger: the
next kernel may launch as this one's programs exit). ``pdl_args(device)`` gives a launch's flag
and option; PDL needs a CUDA GPU of compute capability 9.0 or more (not under TRITON_INTERPRET=1,
which has no griddepcontrol).

Off by default, because measured slower: on the H200 the graphed Llama-3.1-8B AR step ran 5.03 ms
with mode 1 against 4.40 ms plain (bench/results/step_times_pdl_h200.json), though the eager
profile's kernels summed to less (4.29 ms against 4.34): the programmatic edges of the captured
graph cost about 2.6 µs a kernel (244 kernels). In later runs mode 1 ran 4.45-4.55 ms and mode 2
4.21-4.29 against 4.17-4.21 plain (bench/results/step_times_llama_h200.json and its history). ``SPECPILOT_PDL=1|2`` or ``overlap(pdl=...)`` turns it on (the
benchmarks measure each mode beside the default).

Tried and dropped (commit 21bdd2d, bench/results/tried/step_times_warm_start_h200.json): a
setting 3 that triggered only in kernels whose next kernel reads weights, with a "warm start" in
which the GEMVs' early-placed programs prefetched the heads of their weight rows into L2 before the
wait. Plain 4.20 ms; setting 3 alone 4.29 (the programmatic edges' cost, as setting 2's 4.29); with
1, 4 and 16 KB a row 4.27, 4.58 and 5.31; setting 1 with 4 KB 4.71. The more it prefetched, the
slower: the GEMVs before already keep DRAM busy to their tails, so the prefetches only queue
ahead of their reads.

L2 prefetch: a latency-bound kernel (RoPE, attention: a few MB of KV and microseconds of
dependent steps) leaves DRAM idle, while the GEMV after it reads its weights from DRAM. Given a
weight (``prefetch_args``), such a kernel's programs issue ``cp.async.bulk.prefetch.L2`` over
their share of the weight's bytes before anything else (before the PDL wait: weights do not
depend on the kernel before), so the bytes stream into L2 while the kernel runs and the GEMV
then reads them from L2. Exact (a prefetch moves no value); only where the weight fits in L2
with room to spare (``MAX_PREFETCH_BYTES``), and only on sm_90+ (the bulk prefetch is Hopper's).

Off by default, because measured slower: rope_qkv's prefetch of o_proj cost 4.4 µs a layer and the
GEMVs gained 5.8 in the eager profile of step_times_pdl_h200.json, and the graphed AR step ran 4.42
ms with the prefetch alone against 4.21 ms (bench/results/step_times_llama_h200.json).
``SPECPILOT_PREFETCH=1`` or ``overlap(prefetch=True)`` turns it on; the fused stacks then run
rope_qkv (which issues it) apart from attention instead of kernels/rope_attention.py.

Tried and dropped at 16 rows (commits d795ed5 and 2cdc46f, reverted; an H100, verify(16) interleaved):
the split-K GEMMs leave DRAM idle in their tails (o's SMs busy 69% of its cycles in Nsight Compute),
so (a) the hmma programs asked L2 for their first chunks of tiled words before the wait
(cp.async.bulk.prefetch.L2, a run a plane and tile) and (b) a mode 3 triggered the next launch after
the GEMMs' main loops rather than at entry (mode 1) or exit (mode 2), for its programs to take the
slots the sums and epilogues leave. Mode 2's u12 step 5.272 ms; (a) 5.333, (b) 5.268, both 5.319;
mode 1 6.449 (the next kernels' programs resident and waiting from the start, a chain of them);
bf16-linear 5.909 in mode 2, 5.965 in mode 3 (bench/results/tried/step_ab_verify16_early_l2_d795ed5_h100.json,
step_ab_verify16_pdl_late_2cdc46f_h100.json).

Tried and dropped at 16 rows (commits 93cb56d and 77043aa, reverted; an H100, verify(16) interleaved):
a tail prefetch, each hmma program, its own part done (a split past the semaphore, the summing one
after its stores), asking L2 for a share of the next GEMM's weight (qkv's program for o's, o's for
gate|up's, gate|up's for down's, down's for the next layer's qkv): the heads of every split range of
every 16-row band, the words the next launch's programs read first, about 8, 16 or 32 MiB a launch
as bulk prefetches, or 4, 8, 16 MiB a 128-byte line at a time (prefetch.global.L2). The idea: o's,
qkv's and down's split-K tails (3.75-6.25 µs on the H200, bench/results/hmma_trace_pdl2_h200.json)
and the gaps after them leave DRAM idle. Against the default's 5.182 ms: bulk 5.176, 5.267, 5.367;
against 5.187 in a second run: bulk 8 MiB 5.181, lines 5.198, 5.166, 5.238
(bench/results/tried/step_ab_verify16_tail_prefetch_93cb56d_h100.json, and _lines_77043aa_h100.json).
At best 0.4%, and the more it asked the slower, as at one row: the prefetches queue ahead of the
summing programs' loads and the next launch's first ones.

Tried and dropped (commits d3d5035 and 8ec05ab, reverted): a look-ahead inside the GEMVs, each
program issuing ``prefetch.global.L2`` for every 128-byte line of the chunk P ahead of the one it
loads (chunks 1..P-1 on entry), for DRAM bytes in flight beyond what its registers hold. Slower
everywhere at one row, each config in a CUDA graph over distinct weight copies
(bench/results/tried/u12_linear_prefetch_h200.json): u12 gate_up 46.5 µs plain against 62.6 at
best with it, lm_head 190 against 236, qkv 12.7 against 15.3; the AR step, interleaved
(bench/results/tried/step_ab_prefetch_h200.json), bf16 4.155 ms against 4.82 / 5.13 / 5.53 at 1,
2 and 4 chunks ahead and u12 3.696 against 5.16 / 5.31 / 5.69. At 16 rows it helped only the hmma
configs without split-K (gate_up 67.0 -> 62.0 µs, lm_head 254 -> 237), none past the best configs
without it by more than the run's spread.
"""

from __future__ import annotations

import functools
import os
from contextlib import contextmanager

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

_ENV = {"pdl": "SPECPILOT_PDL", "prefetch": "SPECPILOT_PREFETCH"}
_override: dict[str, int] = {}  # set inside overlap()


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def pdl_capable(device: torch.device) -> bool:
    """A CUDA GPU of compute capability 9.0+, outside the interpreter (griddepcontrol, bulk prefetch)."""
    if device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    return _capability(_index(device)) >= (9, 0)


def _setting(name: str) -> int:
    if name in _override:
        return _override[name]
    value = os.environ.get(_ENV[name], "0")
    if value not in ("0", "1", "2") or (name == "prefetch" and value == "2"):
        raise ValueError(f"{_ENV[name]}: expected 0 or 1{' or 2' if name == 'pdl' else ''}, got {value!r}")
    return int(value)


def pdl_mode(device: torch.device) -> int:
    """The PDL mode (0 off, 1 trigger then wait, 2 wait only) of launches on `device` now."""
    return _setting("pdl") if pdl_capable(device) else 0


def pdl_args(device: torch.device) -> dict:
    """A launch's PDL keywords on `device`: the kernel's ``PDL`` flag, and ``launch_pdl`` when on
    (never under the interpreter, where the mode is 0)."""
    mode = pdl_mode(device)
    return {"PDL": mode, **({"launch_pdl": True} if mode else {})}


def prefetch_on() -> bool:
    """Whether kernels are asked to prefetch weights into L2 now (the environment, or overlap())."""
    return bool(_setting("prefetch"))


@contextmanager
def overlap(pdl: int | None = None, prefetch: bool | None = None):
    """Launches inside use PDL mode `pdl` and L2 prefetch `prefetch` where given (else the
    environment's); graphs captured inside keep them."""
    before = dict(_override)
    _override.update({k: int(v) for k, v in (("pdl", pdl), ("prefetch", prefetch)) if v is not None})
    try:
        yield
    finally:
        _override.clear()
        _override.update(before)


@contextmanager
def default_pdl(mode: int):
    """Launches inside use PDL mode `mode` where neither overlap() nor SPECPILOT_PDL chose one: a
    deployment's own default (runtime/fused.py's U12_PDL), which the benchmarks' settings override."""
    if not mode or "pdl" in _override or _ENV["pdl"] in os.environ:
        yield
        return
    with overlap(pdl=mode):
        yield


# Prefetch at most this many bytes, of the H200's 50 MB L2 (the GEMV's weight must still be there
# when it runs; Llama-3.1-8B's o_proj is 32 MiB in bf16, 24 in u12).
MAX_PREFETCH_BYTES = 40 << 20


def prefetch_args(device: torch.device, weights) -> tuple[int, int, int, int, int]:
    """(the kernel's PREFETCH flag: ranges 0-2, address, bytes, address, bytes) to prefetch
    `weights` (a tensor, a few, or None; a u12 weight's planes) into L2: each one's bytes rounded
    down to 16-byte units, when all are contiguous, 16-byte aligned, on `device`, and no larger
    than MAX_PREFETCH_BYTES together; else none."""
    none = (0, 0, 0, 0, 0)
    if weights is None or not _setting("prefetch"):
        return none
    weights = [weights] if isinstance(weights, torch.Tensor) else list(weights)
    if not 1 <= len(weights) <= 2 or not pdl_capable(device):
        return none
    ranges = []
    for w in weights:
        if w.device.type != "cuda" or _index(w.device) != _index(device) or not w.is_contiguous() or w.data_ptr() % 16:
            return none
        ranges += [w.data_ptr(), w.numel() * w.element_size() // 16 * 16]
    if not 0 < sum(ranges[1::2]) <= MAX_PREFETCH_BYTES:
        return none
    return (len(weights), *ranges, *none[: 4 - len(ranges)])


@triton.jit
def _prefetch_l2(addr, nbytes, pid, programs, SLICES: tl.constexpr):
    """Program `pid` of `programs` asks L2 for its share of bytes [addr, addr + nbytes) (nbytes a
    multiple of 16), cut into SLICES bulk prefetches (one a thread where SLICES is the thread count)."""
    per_program = tl.cdiv(nbytes, programs * 16) * 16
    per_slice = tl.cdiv(per_program, SLICES * 16) * 16
    lo = pid.to(tl.int64) * per_program + tl.arange(0, SLICES).to(tl.int64) * per_slice
    hi = tl.minimum(lo + per_slice, tl.minimum(pid.to(tl.int64) * per_program + per_program, nbytes))
    size = tl.maximum(hi - lo, 0).to(tl.int32)
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.gt.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.b32 $0, 0; }",
        "=r,l,r", [addr + lo, size], dtype=tl.int32, is_pure=False, pack=1,
    )


@triton.jit
def overlap_enter(
    PDL: tl.constexpr, PREFETCH: tl.constexpr, addr0, bytes0, addr1, bytes1, pid, programs, SLICES: tl.constexpr,
):
    """pdl_enter with an L2 prefetch of PREFETCH (0-2) weight ranges (``prefetch_args``) before the wait."""
    if PDL == 1:
        gdc_launch_dependents()
    if PREFETCH >= 1:
        _prefetch_l2(addr0, bytes0, pid, programs, SLICES)
    if PREFETCH >= 2:
        _prefetch_l2(addr1, bytes1, pid, programs, SLICES)
    if PDL >= 1:
        gdc_wait()


@triton.jit
def pdl_enter(PDL: tl.constexpr):
    """A PDL kernel's first step: mode 1 lets the next kernel launch, then (modes 1, 2) waits for
    the kernel before; nothing in mode 0."""
    pdl_trigger(PDL)
    pdl_wait(PDL)


@triton.jit
def pdl_trigger(PDL: tl.constexpr):
    """``pdl_enter``'s first half: mode 1 lets the next kernel launch."""
    if PDL == 1:
        gdc_launch_dependents()


@triton.jit
def pdl_wait(PDL: tl.constexpr):
    """``pdl_enter``'s second half: modes 1, 2 wait for the kernel before. Loads of what that kernel
    cannot have written (weights) may come before it, in a program launched early."""
    if PDL >= 1:
        gdc_wait()

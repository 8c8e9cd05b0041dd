"""Gaps between the current pipeline and its ceiling, each named by the pass that would close it.

The cost model may not import the passes (it sits below them), so each pass's effect on the IR is
restated here as a small what-if: the same node rewrite the pass performs, applied to a copy of
the program. A gap is what a what-if saves in time per output token when it is applied on top of
the ones already taken. The ranking is a greedy waterfall: at each stage the what-if that saves
the most is taken, until none saves anything; what is left between that program and the ceiling
(every op at its floor, the best candidate set) is kernels running below the roofline, which no
pass closes yet. The savings therefore add up to current - ceiling per output token.

| what-if | gap it closes | pass |
|---|---|---|
| linear/lm_head bf16 weights -> u12 | weight bytes | `weights-u12` |
| CUDA graphs on, accept on the device | launch overhead, host round trips | `cuda-graphs` |
| norms, RoPE, SiLU·mul on fused kernels | small kernels' latency | `fused-decoder` |
| chain -> best-first tree of the best budget | τ below what the candidates allow | `tree-verify{budget=N}` |
| block size -> the best one | block size off the optimum | `draft-block-size{size=N}` |
| attention kernel -> split-KV | attention over long caches | `attention-split-kv` |
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable

from ..ir import MATMUL_OPS, Node, Program
from ..ir.lower import SHARED
from ..ir.verify import expected_verify_length

U12_MIN_NUMEL = 1 << 20  # weights-u12's default: smaller matrices stay bf16
TREE_BUDGETS = (8, 15, 16, 24, 31, 32, 48, 64, 96, 128, 192, 256)  # 31: q = 32, the fused stacks' row limit
NO_PASS = ""


@dataclass(frozen=True)
class Gap:
    """One reason the pipeline is slower than its ceiling, in seconds per output token (predicted)."""

    what: str  # the shortfall, in words
    pass_name: str  # the pass that closes it ("" where no pass does yet)
    pipeline: str  # the pass as a pipeline element, with its parameters
    saving: float  # seconds per output token the pass saves at this point of the waterfall
    fraction: float  # of the current time per output token
    detail: str = ""
    source: str = "predicted"


@dataclass(frozen=True)
class WhatIf:
    """A pass's effect, restated: the pass as a pipeline element and the program it would produce."""

    what: str
    pass_name: str
    pipeline: str
    program: Program


def step_ops(program: Program) -> dict[str, Node]:
    """The step graph's nodes by op (each op appears once in a valid step graph)."""
    return {node.op: node for _, node in program.step.dag.nodes(data="node")}


# -- program edits (each returns None when the pass would change nothing)

def _with_attr(program: Program, key: str, value) -> Program:
    attrs = dict(program.attrs)
    attrs[key] = value
    return Program(program.step, program.target, program.drafter, attrs=tuple(sorted(attrs.items())))


def _map(program: Program, level: str, fn: Callable[[str, Node], Node | None]) -> tuple[Program, int]:
    graph, changed = program.graph(level).map_nodes(fn)
    return (program.with_graph(level, graph) if changed else program), changed


def with_u12(program: Program, min_numel: int = U12_MIN_NUMEL) -> Program | None:
    """As `weights-u12`: bf16 matmul weights of min_numel or more -> u12; borrowed `target/` weights
    keep their drafter node (they follow the target's)."""
    if program.attr("dtype") != "bfloat16":
        return None

    def fn(_, node: Node):
        if (node.op in MATMUL_OPS and node["format"] == "bfloat16" and not node["weight"].startswith(SHARED)
                and node["in_features"] * node["out_features"] >= min_numel):
            return node.replace(format="u12", kernel="triton-u12")
        return None

    program, a = _map(program, "target", fn)
    program, b = _map(program, "drafter", fn)
    return program if a + b else None


def with_cuda_graphs(program: Program) -> Program | None:
    """What `cuda-graphs` does: accept on the device, every step one graph replay (chains, trees)."""
    ops = step_ops(program)
    if ops["verify"]["mode"] not in ("chain", "tree") or program.target.find("gated_deltanet"):
        return None

    def fn(_, node: Node):
        if node.op == "accept" and node["on"] != "device":
            return node.replace(on="device")
        if node.op == "schedule" and not node.get("graphs"):
            return node.replace(graphs=True)
        return None

    program, n = _map(program, "step", fn)
    return program if n else None


def with_fused_decoder(program: Program) -> Program | None:
    """What `fused-decoder` does (the pass itself): norms, RoPE and SiLU·mul on fused kernels."""
    from ..passes.fused_decoder import FusedDecoder

    result = FusedDecoder().apply(program)
    return result.program if result.changed else None


def with_split_kv(program: Program) -> Program | None:
    def fn(_, node: Node):
        return node.replace(kernel="triton-split-kv") if node.op == "attention" else None

    program, a = _map(program, "target", fn)
    program, b = _map(program, "drafter", fn)
    return program if a + b else None


def with_tree(program: Program, budget: int) -> Program | None:
    """Chain (or another budget) -> a best-first tree of `budget` candidates."""
    propose = step_ops(program)["propose"]
    if propose["shape"] == "tree" and propose["budget"] == budget:
        return None

    def fn(_, node: Node):
        if node.op == "propose":
            return node.replace(shape="tree", budget=budget)
        if node.op == "verify":
            mode = node["mode"] if node["mode"] != "chain" else "tree"
            return node.replace(mode=mode, q=budget + 1)
        if node.op == "accept":
            return node.replace(rule="tree-path")
        if node.op == "commit":
            return node.replace(kv="compact")
        return None

    return _map(program, "step", fn)[0]


def with_block_size(program: Program, block: int) -> Program | None:
    """The drafter's block size -> `block` (a chain's proposal and verify length follow)."""
    ops = step_ops(program)
    draft, propose = ops["draft"], ops["propose"]
    if draft["block_size"] == block:
        return None
    new_draft = draft.replace(block_size=block)
    if propose["shape"] == "chain":
        propose = propose.replace(budget=block - 1 if draft["kind"] == "dflash" else block)
    q = expected_verify_length(new_draft, propose)

    def fn(_, node: Node):
        if node.op == "draft":
            return new_draft
        if node.op == "propose":
            return propose
        if node.op == "verify":
            return node.replace(q=q)
        return None

    return _map(program, "step", fn)[0]


def draft_positions(program: Program) -> int:
    """Tokens the drafter proposes per block (DFlash: block_size - 1 after the anchor; PARD: k)."""
    draft = step_ops(program)["draft"]
    return draft["block_size"] - 1 if draft["kind"] == "dflash" else draft["block_size"]


def block_sizes(program: Program, max_positions: int) -> list[int]:
    """Block sizes worth trying: up to what the drafter was measured (or built) for."""
    draft = step_ops(program)["draft"]
    lo = 2 if draft["kind"] == "dflash" else 1
    hi = max(draft["block_size"], max_positions + (1 if draft["kind"] == "dflash" else 0))
    return list(range(lo, hi + 1))


def what_ifs(program: Program, *, max_positions: int, search: bool = True) -> list[WhatIf]:
    """Every pass effect that changes `program`, tree budgets and block sizes enumerated."""
    out: list[WhatIf] = []
    if (p := with_u12(program)) is not None:
        out.append(WhatIf("weight bytes (bf16 -> u12)", "weights-u12", f"weights-u12{{min-numel={U12_MIN_NUMEL}}}", p))
    if (p := with_cuda_graphs(program)) is not None:
        out.append(WhatIf("launch overhead and host round trips", "cuda-graphs", "cuda-graphs", p))
    if (p := with_fused_decoder(program)) is not None:
        out.append(WhatIf("small kernels of the decoder layers", "fused-decoder", "fused-decoder", p))
    if (p := with_split_kv(program)) is not None:
        out.append(WhatIf("attention over the cache", "attention-split-kv", "attention-split-kv", p))
    if search:
        for budget in TREE_BUDGETS:
            if (p := with_tree(program, budget)) is not None:
                out.append(WhatIf("τ below what the candidates allow", "tree-verify", f"tree-verify{{budget={budget}}}", p))
        for block in block_sizes(program, max_positions):
            if (p := with_block_size(program, block)) is not None:
                out.append(WhatIf("block size off the optimum", "draft-block-size", f"draft-block-size{{size={block}}}", p))
    return out


def rank_gaps(program: Program, t_token: Callable[[Program], float], ceiling_t_token: float, *,
              max_positions: int, search: bool = True) -> tuple[list[Gap], Program]:
    """The greedy waterfall from `program` toward the ceiling; returns (gaps, best program found).

    `t_token(program)` is the model's time per output token. Each pass is taken at most once
    (tree-verify and draft-block-size with their best parameter at that stage)."""
    base = t_token(program)
    current, now = program, base
    taken: set[str] = set()
    gaps: list[Gap] = []
    while True:
        best: tuple[float, WhatIf] | None = None
        for w in what_ifs(current, max_positions=max_positions, search=search):
            if w.pass_name in taken:
                continue
            t = t_token(w.program)
            if now - t > 1e-12 and (best is None or t < best[0]):
                best = (t, w)
        if best is None:
            break
        t, w = best
        gaps.append(Gap(w.what, w.pass_name, w.pipeline, now - t, (now - t) / base if base else 0.0))
        taken.add(w.pass_name)
        current, now = w.program, t
    rest = now - ceiling_t_token
    if rest > 1e-12:
        gaps.append(Gap("kernels below the roofline (efficiency, per-kernel latency)", NO_PASS, "",
                        rest, rest / base if base else 0.0,
                        "what the best pipeline found still loses to every op at its floor"))
    gaps.sort(key=lambda g: -g.saving)
    return gaps, current


def pipeline_string(gaps: Iterable[Gap]) -> str:
    """The passes of a gap list as one pipeline string (what the agent would try)."""
    return ",".join(g.pipeline for g in gaps if g.pass_name)

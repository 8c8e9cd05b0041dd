"""The per-node step model: bytes, FLOPs and time of every op of a model graph.

One evaluation of a model graph (an AR step, a verify of q tokens, a draft of a block) is costed
node by node at a `batch`, a query length `q` and a KV-cache length `cache_len`:

    t_mem   = bytes / (bandwidth · bw_efficiency · kernel_efficiency · occupancy)
    t_comp  = tensor FLOPs / (bf16_rate · mm_efficiency) + other FLOPs / fp32_rate
              (a matmul on a CPU: FLOPs / the rate measured at its shape, cost/cpu.py)
    time    = combine(t_mem, t_comp) + kernels · kernel_latency + [kernels · launch, unless CUDA graphs]
    floor   = max(bytes / bandwidth, tensor FLOPs / bf16_rate + other FLOPs / fp32_rate)

On a CPU (cost/cpu.py) a "kernel" is a torch op: its `kernel_latency` is the per-op cost measured
at a step's structure, paid with or without the cuda-graphs pass (nothing is captured there), and the fused
kernels' launch counts do not apply (`GPU.runs_triton`: their torch references run instead).

`combine` is the roofline max, or the p-norm (t_mem^p + t_comp^p)^(1/p) where the GPU's
`overlap` was fitted to measurements (p = inf is the max). With unit efficiencies and no
latencies, time = floor. Bytes count what a kernel must move: weights in their storage format
(u12: 12 bits a weight plus its escapes), activations read and written in the program's dtype,
and the KV cache read and appended. Weights a DFlash drafter borrows from the target
(`target/...`) are read again on each draft step, so they count there too; `weight_footprint`
counts each weight once.

Row counts: every node of a target or PARD graph sees batch·q rows. In a DFlash drafter the
target's hidden features enter as `context` rows per request (default q: about τ tokens are
accepted a step, and q bounds it); the k/v projections read both context and block rows, and
attention appends both to the drafter's cache.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from functools import cached_property
from ..errors import UnpricedError
from ..ir import MATMUL_OPS, Graph, Node, Program
from ..ir.node import FORMAT_BITS
from ..ir.lower import SHARED
from .gpu import GPU

ACT_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
WEIGHT_BITS = {"float32": 32, "bfloat16": 16, "float16": 16, "u12": 12}

# u12 (specpilot/formats/u12.py): a sign/mantissa byte plane, a 4-bit exponent-code plane, and a
# side table of escapes (int32 flat index + int16 bit pattern) with int32 CSR row pointers. The
# GEMVs read each row's escapes from its lanes instead (U12Tensor.esc_lanes: int32 lanes a row, as
# many as the fullest row needs rounded up to a power of two, at most U12_MAX_LANES), the table
# only where a row has more.
U12_ESCAPE_BYTES = 6
U12_LANE_BYTES = 4
U12_MAX_LANES = 16  # formats/u12.py's MAX_LANES
# Measured on N(0, 0.02) bf16 weights (GPU-FACTS.md: the best 15-exponent window covers 99.985%).
U12_ESCAPE_RATE = 1.5e-4

# Kernels a node launches in a plain torch implementation (HF-style rope and norms, SDPA, cache writes
# by copy): counted with torch.profiler on the H200, 1221 kernels in a Llama-3.1-8B AR step =
# 32 layers x 38 + 5 (.cache/costbench/steps/step_bench.py, 2026-12-02). A fusing backend launches fewer.
KERNELS = {"input": 0, "embed": 1, "rmsnorm": 3, "linear": 1, "lm_head": 1, "rope": 16,
           "attention": 5, "mlp": 2, "add": 1, "argmax": 1,
           # counted from runtime/hybrid.py's ops at q = 1 (not profiled); its recurrent form adds
           # about 10 a token. A fused kernel (conv + delta rule + gated norm) launches a few.
           "gated_deltanet": 45,
           # routing (softmax, top-k, renormalise) and the shared gate; each expert hit adds ~8
           "moe": 6}
# The same nodes on the fused kernels (kernel="triton-fused", runtime/fused.py): one launch each
# (rmsnorm with the residual add, rope_qkv with qk-norm and the cache write, silu_mul).
FUSED_KERNELS = {"rmsnorm": 1, "rope": 1, "mlp": 1}
# Attention on the split-KV kernel (kernel="triton-split-kv"): the split kernel and the combine; in a
# fused graph the layer's rope (and cache write) rides in the split kernel (kernels/rope_attention.py).
SPLIT_KV_KERNELS = 2

# Attention parallelism. SDPA at q = 1 is flash-decoding (the cache split over programs: the card
# fills). For q > 1 it runs one program per (request, head, 128-query tile), whatever the cache
# length; a split-KV kernel adds one per 128-token chunk. Each program streams the cache at about
# `attention_program_bw` (a GPU figure), so few programs leave most of the bandwidth unused.
ATTN_Q_TILE = 128
SPLIT_KV_CHUNK = 128

# FLOPs per element of the elementwise ops (on the fp32 units).
_ELEMENT_FLOPS = {"rmsnorm": 4, "rope": 6, "mlp": 5, "add": 1, "argmax": 1}


@dataclass(frozen=True)
class NodeCost:
    """One node at one shape: what it moves and computes, its floor and its predicted time."""

    name: str
    op: str
    rows: int
    weight_bytes: float = 0.0  # weight planes in the storage format
    escape_bytes: float = 0.0  # u12 side table
    act_bytes: float = 0.0  # activations read and written
    kv_bytes: float = 0.0  # KV cache read and appended
    tensor_flops: float = 0.0  # matmul work, on the tensor cores
    other_flops: float = 0.0  # elementwise work
    kernels: int = 0
    t_memory: float = 0.0  # floor: bytes / bandwidth
    t_compute: float = 0.0  # floor: FLOPs / rate
    efficiency: float = 1.0  # achieved fraction of the bandwidth (efficiencies x occupancy)
    t_latency: float = 0.0  # kernels · kernel_latency (part of t_kernel)
    t_kernel: float = 0.0  # predicted time on the GPU, kernel latency included
    t_launch: float = 0.0  # predicted CPU launch cost (0 under CUDA graphs)

    @property
    def bytes(self) -> float:
        return self.weight_bytes + self.escape_bytes + self.act_bytes + self.kv_bytes

    @property
    def flops(self) -> float:
        return self.tensor_flops + self.other_flops

    @property
    def t_floor(self) -> float:
        return max(self.t_memory, self.t_compute)

    @property
    def time(self) -> float:
        return self.t_kernel + self.t_launch

    @property
    def bound(self) -> str:
        return "compute" if self.t_compute > self.t_memory else "memory"


@dataclass(frozen=True)
class StepEstimate:
    """One evaluation of a model graph: per-node rows and their totals (seconds, bytes, FLOPs).

    Nodes that cost the same (same op and attributes but the weight name, same shapes: the layers
    of a decoder) are costed once: `costs[i]` stands for `counts[i]` nodes; `rows` lists every
    node by name, in topological order. `scale` is a calibration factor (measured / predicted,
    see `CostModel.update`) applied to `time`; the rows and the floor stay uncalibrated."""

    what: str  # "ar", "verify", "draft" or a caller's label
    graph: str
    batch: int
    q: int
    cache_len: int
    cuda_graphs: bool
    costs: tuple[NodeCost, ...] = field(default=(), repr=False)
    counts: tuple[int, ...] = field(default=(), repr=False)
    layout: tuple[tuple[str, int], ...] = field(default=(), repr=False)  # (node name, index into costs)
    scale: float = 1.0

    @cached_property
    def rows(self) -> tuple[NodeCost, ...]:
        return tuple(self.costs[i] if self.costs[i].name == name else replace(self.costs[i], name=name)
                     for name, i in self.layout)

    def _sum(self, fn) -> float:
        return sum(fn(c) * k for c, k in zip(self.costs, self.counts))

    @property
    def raw_time(self) -> float:
        return self._sum(lambda r: r.time)

    @property
    def time(self) -> float:
        return self.raw_time * self.scale

    @property
    def floor(self) -> float:
        return self._sum(lambda r: r.t_floor)

    @property
    def launch(self) -> float:
        return self._sum(lambda r: r.t_launch)

    @property
    def latency(self) -> float:
        """Kernel latency inside the step (kernels · kernel_latency)."""
        return self._sum(lambda r: r.t_latency)

    @property
    def bytes(self) -> float:
        return self._sum(lambda r: r.bytes)

    @property
    def weight_bytes(self) -> float:
        return self._sum(lambda r: r.weight_bytes + r.escape_bytes)

    @property
    def flops(self) -> float:
        return self._sum(lambda r: r.flops)

    @property
    def kernels(self) -> int:
        return int(self._sum(lambda r: r.kernels))

    def by_op(self) -> dict[str, dict[str, float]]:
        """Totals per op: time, floor, bytes, flops, count."""
        out: dict[str, dict[str, float]] = {}
        for r, k in zip(self.costs, self.counts):
            t = out.setdefault(r.op, {"time": 0.0, "floor": 0.0, "bytes": 0.0, "flops": 0.0, "count": 0})
            t["time"] += r.time * k
            t["floor"] += r.t_floor * k
            t["bytes"] += r.bytes * k
            t["flops"] += r.flops * k
            t["count"] += k
        return out

    def scaled(self, factor: float) -> "StepEstimate":
        return replace(self, scale=factor)


def combine(t_mem: float, t_comp: float, p: float) -> float:
    """Roofline max (p = inf) or the p-norm of memory and compute time."""
    if math.isinf(p):
        return max(t_mem, t_comp)
    hi = max(t_mem, t_comp)
    if hi <= 0.0:
        return 0.0
    return hi * ((t_mem / hi) ** p + (t_comp / hi) ** p) ** (1.0 / p)


def weight_bits(fmt: str) -> float:
    """Bits a weight of format `fmt` occupies: the built-in formats', or what a plugin registered
    with its format (ir.node.FORMAT_BITS); UnpricedError for a format registered without them."""
    if fmt in WEIGHT_BITS:
        return WEIGHT_BITS[fmt]
    if fmt in FORMAT_BITS:
        return FORMAT_BITS[fmt]
    raise UnpricedError(f"the cost model cannot price weight format {fmt!r}: it was registered without its bits per "
                        f"weight (register_weight_format(..., bits=N)), so this program can be measured "
                        f"(specpilot compile) but not predicted")


def u12_lanes(n: int, k: int, escape_rate: float) -> int:
    """Lanes a row of an [n, k] u12 weight whose escapes fall at `escape_rate` independently: the
    most a row is expected to hold (Poisson, the least s with n · P(X > s) < 1/2), rounded up to a
    power of two as U12Tensor.esc_lanes does; 0 (the table) past U12_MAX_LANES or k > 65535."""
    lam = k * escape_rate
    term = cdf = math.exp(-lam)
    s = 0
    while n * (1.0 - cdf) >= 0.5 and s <= U12_MAX_LANES:
        s += 1
        term *= lam / s
        cdf += term
    if s > U12_MAX_LANES or k > 0xFFFF:
        return 0
    return 1 << max(0, s - 1).bit_length()


def matmul_weight_bytes(node: Node, escape_rate: float = U12_ESCAPE_RATE) -> tuple[float, float]:
    """(planes, escapes) bytes of a linear / lm_head weight in its format (a head with a
    `vocab_subset` reads only those rows); u12's escapes as its kernels read them, from the rows'
    lanes (``u12_lanes``) or, where a row would need more, the side table and its row pointers."""
    n, k = node.get("vocab_subset") or node["out_features"], node["in_features"]
    fmt = node["format"]
    if fmt != "u12":
        return n * k * weight_bits(fmt) / 8, 0.0
    planes = n * k + n * ((k + 1) // 2)  # sign/mantissa bytes + two 4-bit codes a byte
    lanes = u12_lanes(n, k, escape_rate)
    escapes = n * lanes * U12_LANE_BYTES if lanes else n * k * escape_rate * U12_ESCAPE_BYTES + 4 * (n + 1)
    return float(planes), float(escapes)


@dataclass(frozen=True)
class GraphPlan:
    """A model graph flattened once for repeated costing: (name, node, input names) in topological order."""

    name: str
    entries: tuple[tuple[str, Node, tuple[str, ...]], ...]
    keys: tuple[Node, ...] = ()  # each node without its weight name: what its cost depends on

    @staticmethod
    def of(graph: "Graph | GraphPlan", shared: Graph | None = None) -> "GraphPlan":
        """`shared`: the target graph, whose nodes decide the format and kernel of the weights a
        drafter borrows (`target/<name>`), as the weight passes leave the borrowing node as it was."""
        if isinstance(graph, GraphPlan):
            return graph
        owners = {}
        if shared is not None:
            owners = {node["weight"]: node for _, node in shared.items() if node.op in MATMUL_OPS}

        def resolve(node: Node) -> Node:
            weight = node.get("weight", "")
            # a head over a token subset holds its own rows, in the compute dtype (runtime/draft_vocab.py)
            if (node.op in MATMUL_OPS and weight.startswith(SHARED) and weight[len(SHARED):] in owners
                    and not node.get("vocab_subset")):
                owner = owners[weight[len(SHARED):]]
                return node.replace(format=owner["format"], kernel=owner["kernel"])
            return node

        entries = tuple((n, resolve(node), tuple(graph.inputs(n))) for n, node in graph.items())
        nodes = {n: (node, inputs) for n, node, inputs in entries}
        layers = _fused_layers(nodes)
        folded, folded_few = folded_launches(nodes), _folded_at_few_rows(nodes, layers)
        fused_linears = {n for n, node, _ in entries
                         if node.op == "linear" and layers.get(n.rpartition(".")[0]) == "plain"}
        keys = tuple(Node(node.op, tuple(kv for kv in node.attrs if kv[0] != "weight")
                          + ((FOLDED, True),) * (n in folded)
                          + (((FOLDED_FEW_ROWS, folded_few[n]),) if n in folded_few else ())
                          + ((FUSED_LINEAR, True),) * (n in fused_linears))
                     for n, node, _ in entries)
        return GraphPlan(graph.name, entries, keys)


FOLDED = "launch_folded"  # a key attribute of the plan only: the node's work rides in another's launch
FOLDED_FEW_ROWS = "launch_folded_few_rows"  # the same, at the rows fused_linear serves ("plain"/"u12" layer)
FUSED_LINEAR = "fused_linear_layer"  # a plain projection of a layer fused_linear serves at `linear_serves` rows
# The kernel name of fused_linear's launches, whose measured efficiency (gpus.yaml kernel_efficiency)
# prices those projections at the rows it serves.
FUSED_LINEAR_KERNEL = "triton-fused-linear"
# Rows at which the fused stacks run fused_linear (runtime/fused.py's LINEAR_GEMV_MAX_M, LINEAR_MAX_M,
# LINEAR_GAP and GEMV_ROWS, FusedOps.linear_serves): the layer's norms ride in the q|k|v and gate|up GEMMs'
# prologues, SiLU·mul in gate|up's epilogue. tests/test_cost_model.py checks they agree.
LINEAR_MAX_M, LINEAR_GEMV_MAX_M, GEMV_ROWS, LINEAR_GAP = 32, 1, 4, (17, 31)


def linear_serves(rows: int, u12: bool) -> bool:
    """runtime/fused.py's FusedOps.linear_serves at its defaults."""
    if rows > LINEAR_MAX_M:
        return False
    if u12 and GEMV_ROWS < rows <= U12_MANY_ROWS:
        return True
    if LINEAR_GAP[0] <= rows <= LINEAR_GAP[1]:
        return False
    return rows <= LINEAR_GEMV_MAX_M or (rows > GEMV_ROWS and not u12)


# Whether the fused stacks serve u12 layers (runtime/fused.py's U12_LINEAR: u12_fused_linear, for
# weights of the "triton-u12" kernel), keep their norms as rmsnorm kernels (U12_NORMS_APART) and hand
# a norm from the residual u12 GEMV before it to the u12 GEMV after it instead (U12_NORM_HANDOFF).
U12_LINEAR, U12_NORMS_APART, U12_NORM_HANDOFF = True, True, True
U12_MANY_ROWS = 16  # runtime/fused.py's U12_MANY_ROWS: u12 layers served above GEMV_ROWS rows up to this many too
_LAYER_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_JOINED = {"k_proj": "q_proj", "v_proj": "q_proj", "up_proj": "gate_proj"}  # concatenated GEMMs of a fused layer


def folded_launches(nodes: dict[str, tuple[Node, tuple[str, ...]]]) -> set[str]:
    """Nodes of a fused-decoder graph (runtime/fused.py) that launch nothing of their own: residual
    adds (inside the next RMSNorm kernel), a layer's rope where its attention is the split-KV
    kernel (kernels/rope_attention.py) and the k, v and up projections (one GEMM with q's or
    gate's, over concatenated weights: where the formats and kernels agree, as the runtime needs).
    A DFlash layer's k projection, which also reads the target context, keeps its launch: the
    context's k|v GEMM (`nodes`: name -> (node, input names))."""
    if not any(node.op == "rmsnorm" and node.get("kernel") == "triton-fused" for node, _ in nodes.values()):
        return set()
    out = {name for name, (node, _) in nodes.items() if node.op == "add"}
    for name, (node, _) in nodes.items():  # RoPE and the cache write inside the split-KV kernel
        attention = nodes.get(name.rpartition(".")[0] + ".attention", (None,))[0]
        if node.op == "rope" and attention is not None and attention.get("kernel") == "triton-split-kv":
            out.add(name)
    for name, (node, inputs) in nodes.items():
        prefix, _, proj = name.rpartition(".")
        lead = nodes.get(f"{prefix}.{_JOINED.get(proj, '')}", (None,))[0]
        same = lead is not None and (lead["format"], lead["kernel"]) == (node["format"], node["kernel"])
        if node.op == "linear" and same and not (proj == "k_proj" and len(inputs) > 1):
            out.add(name)
    return out


def _fused_layers(nodes: dict[str, tuple[Node, tuple[str, ...]]]) -> dict[str, str]:
    """Layers (name prefixes) of a fused-decoder graph that the fused linears serve: every projection
    plain, in the model's dtype ("plain"), or u12 of the "triton-u12" kernel under U12_LINEAR ("u12"
    where any is); q, k and v of one format and kernel, gate and up too, as their GEMMs are joined."""
    if not any(node.op == "rmsnorm" and node.get("kernel") == "triton-fused" for node, _ in nodes.values()):
        return {}

    def plain(lin):
        return lin["format"] == lin["dtype"]

    def served(lin):
        return lin is not None and (plain(lin) or (U12_LINEAR and (lin["format"], lin["kernel"]) == ("u12", "triton-u12")))

    out: dict[str, str] = {}
    for name, (node, _) in nodes.items():
        prefix, _, part = name.rpartition(".")
        if part != "q_proj" or prefix in out:
            continue
        lin = {proj: nodes.get(f"{prefix}.{proj}", (None,))[0] for proj in _LAYER_LINEARS}
        if not all(served(v) for v in lin.values()) or any(
                (lin[p]["format"], lin[p]["kernel"]) != (lin[lead]["format"], lin[lead]["kernel"])
                for p, lead in _JOINED.items()):
            continue
        out[prefix] = "plain" if all(plain(v) for v in lin.values()) else "u12"
    return out


def _folded_at_few_rows(nodes: dict[str, tuple[Node, tuple[str, ...]]], layers: dict[str, str]) -> dict[str, str]:
    """Nodes of a fused-decoder graph that launch nothing at the rows `linear_serves` takes, in the
    fused linears' `layers` (`_fused_layers`): the SiLU·mul (in gate|up's epilogue), and each norm
    whose GEMM (q|k|v's, gate|up's) is plain or takes u12 norms as prologues (not U12_NORMS_APART),
    or (U12_NORM_HANDOFF) is a u12 GEMV whose norm the u12 residual GEMV before it hands on: a
    layer's o_proj to its gate|up, the previous served layer's down_proj to its q|k|v. Maps each to
    its layer's kind: "plain" or "u12"."""

    def u12(name):
        node = nodes.get(name, (None,))[0]
        return node is not None and node["format"] != node["dtype"]

    def handed(prefix, part):
        if part == "post_norm":
            return u12(f"{prefix}.o_proj") and u12(f"{prefix}.gate_proj")
        base, _, index = prefix.rpartition(".")
        before = f"{base}.{int(index) - 1}" if index.isdigit() else ""
        return before in layers and u12(f"{before}.down_proj") and u12(f"{prefix}.q_proj")

    out: dict[str, str] = {}
    for name, (node, _) in nodes.items():
        prefix, _, part = name.rpartition(".")
        if part not in ("input_norm", "post_norm", "mlp") or prefix not in layers:
            continue
        gemm = {"input_norm": f"{prefix}.q_proj", "post_norm": f"{prefix}.gate_proj"}.get(part)
        if (gemm is None or not u12(gemm) or not U12_NORMS_APART
                or (U12_NORM_HANDOFF and handed(prefix, part))):
            out[name] = layers[prefix]
    return out


def _shapes(plan: GraphPlan, batch: int, q: int, context: int) -> dict[str, tuple[int, int]]:
    """(rows, width) of every node's output, in elements."""
    shapes: dict[str, tuple[int, int]] = {}
    for name, node, inputs in plan.entries:
        ins = [shapes[i] for i in inputs]
        op = node.op
        if op == "input":
            shapes[name] = (batch * context, node.get("dim", 0)) if node["what"] == "target_hidden" else (batch * q, 0)
        elif op in MATMUL_OPS:
            shapes[name] = (sum(r for r, _ in ins), node["out_features"])
        elif op in ("embed", "rmsnorm", "mlp"):
            shapes[name] = (ins[0][0], node["dim"])
        elif op == "attention":
            shapes[name] = (batch * q, node["heads"] * node["head_dim"])
        elif op == "gated_deltanet":
            shapes[name] = (batch * q, node["v_heads"] * node["v_head_dim"])
        elif op == "moe":
            shapes[name] = (ins[0][0], node["hidden"])
        elif op == "argmax":
            shapes[name] = (ins[0][0], 1)
        else:  # rope (a q, k pair), add: shape of the first input
            shapes[name] = ins[0] if ins else (batch * q, 0)
    return shapes


def attention_occupancy(node: Node, gpu: GPU, batch: int, q: int, kv_len: int) -> float:
    """Fraction of the card's bandwidth an attention kernel can draw (see ATTN_Q_TILE)."""
    programs = batch * node["heads"] * math.ceil(q / ATTN_Q_TILE)
    if node["kernel"] == "triton-split-kv" or q == 1:
        programs *= max(1, math.ceil(kv_len / SPLIT_KV_CHUNK))
    return min(1.0, programs * gpu.attention_program_bw / (gpu.bandwidth * gpu.bw_efficiency))


def node_cost(name: str, node: Node, out: tuple[int, int], ins: list[tuple[int, int]], gpu: GPU, *,
              batch: int, q: int, cache_len: int, dtype: str, cuda_graphs: bool,
              escape_rate: float = U12_ESCAPE_RATE, served_by: str = "") -> NodeCost:
    """Cost of one node whose output is `out` = (rows, width) and whose inputs are `ins`;
    `served_by`: the kernel that runs a plain linear in place of the stock GEMM (its measured
    efficiency applies)."""
    a = ACT_BYTES[dtype]
    op = node.op
    rows, width = out
    read = sum(r * w for r, w in ins) * a
    written = rows * width * a
    triton = gpu.runs_triton  # elsewhere (a CPU) the "triton-*" kernels run as their torch references
    kernels = (FUSED_KERNELS[op] if triton and node.get("kernel") == "triton-fused" and op in FUSED_KERNELS
               else KERNELS.get(op, 1))
    if triton and op == "attention" and node.get("kernel") == "triton-split-kv":
        kernels = SPLIT_KV_KERNELS
    c = dict(name=name, op=op, rows=rows, kernels=kernels)
    occupancy, kernel_eff, matmul_rate = 1.0, 1.0, None

    if op == "input":
        c["kernels"] = 0
    elif op == "embed":
        c["weight_bytes"] = rows * node["dim"] * ACT_BYTES[node["dtype"]]  # a gather: only the rows used
        c["act_bytes"] = written
    elif op in MATMUL_OPS:
        c["weight_bytes"], c["escape_bytes"] = matmul_weight_bytes(node, escape_rate)
        c["act_bytes"] = rows * node["in_features"] * a + written
        n = node.get("vocab_subset") or node["out_features"]
        c["tensor_flops"] = 2.0 * rows * node["in_features"] * n
        matmul_rate = gpu.matmul_rate(rows, node["in_features"], n)  # a CPU's, measured at this shape
        if triton and node["format"] == "u12":
            kernel_eff = gpu.efficiency_of_kernel(node["kernel"], rows)
        elif triton and served_by:
            kernel_eff = gpu.efficiency_of_kernel(served_by, rows)
    elif op == "attention":
        hd, kvh = node["head_dim"], node["kv_heads"]
        new_kv_rows = ins[-1][0] if ins else rows  # the v projection's rows
        kv_len = cache_len + new_kv_rows // max(batch, 1)
        c["act_bytes"] = read + written
        # read the cache, append the new K and V
        c["kv_bytes"] = (batch * cache_len + new_kv_rows) * kvh * hd * 2 * a
        c["tensor_flops"] = 4.0 * rows * kv_len * node["heads"] * hd
        occupancy = attention_occupancy(node, gpu, batch, q, kv_len)
    elif op == "gated_deltanet":
        # The float32 state [v_heads, dk, dv] a request is read once and written after every one of
        # the q positions (speculative rollback selects among them); the conv keeps kernel-1 inputs.
        hv, dk, dv, taps = node["v_heads"], node["k_head_dim"], node["v_head_dim"], node["conv_kernel"]
        conv_dim = 2 * node["k_heads"] * dk + hv * dv
        c["weight_bytes"] = conv_dim * taps * a
        c["act_bytes"] = read + written
        c["kv_bytes"] = batch * hv * dk * dv * 4 * (1 + q) + 2 * batch * conv_dim * (taps - 1) * a
        # per token: the conv, then per value head decay, read, delta, update and output (~7 dk·dv)
        c["other_flops"] = rows * (2 * conv_dim * taps + hv * 7 * dk * dv)
    elif op == "moe":
        # the experts the rows route to are read once each: at most rows · topk of them
        hit = min(node["experts"], rows * node["topk"])
        expert_bytes = 3 * node["hidden"] * node["dim"] * ACT_BYTES[node["dtype"]]
        c["weight_bytes"] = hit * expert_bytes
        c["act_bytes"] = read + written
        c["tensor_flops"] = 2.0 * rows * node["topk"] * 3 * node["hidden"] * node["dim"]
        c["kernels"] += 8 * hit
    elif op == "rmsnorm":
        c["weight_bytes"] = node["dim"] * a
        c["act_bytes"] = read + written
        c["other_flops"] = _ELEMENT_FLOPS[op] * rows * width
    elif op == "rope":
        moved = read  # q and k, rotated in place: read and written
        c["act_bytes"] = 2 * moved
        c["other_flops"] = _ELEMENT_FLOPS[op] * moved / a
    elif op == "argmax":
        c["act_bytes"] = read + rows * 8
        c["other_flops"] = _ELEMENT_FLOPS[op] * read / a
    else:  # mlp, add: elementwise over their inputs
        c["act_bytes"] = read + written
        c["other_flops"] = _ELEMENT_FLOPS.get(op, 1) * rows * width

    weight = c.get("weight_bytes", 0.0) + c.get("escape_bytes", 0.0)
    moved = weight + c.get("act_bytes", 0.0) + c.get("kv_bytes", 0.0)
    tensor, other = c.get("tensor_flops", 0.0), c.get("other_flops", 0.0)
    t_memory = moved / gpu.bandwidth
    eff = gpu.bw_efficiency * kernel_eff * occupancy
    t_mem = t_memory / eff if moved else 0.0
    t_comp = tensor / (matmul_rate or gpu.bf16_rate * gpu.mm_efficiency) + other / gpu.fp32_rate
    latency = c["kernels"] * gpu.kernel_latency_s
    return NodeCost(
        **c, t_memory=t_memory, t_compute=tensor / gpu.bf16_rate + other / gpu.fp32_rate, efficiency=eff,
        t_latency=latency, t_kernel=combine(t_mem, t_comp, gpu.overlap) + latency,
        t_launch=0.0 if cuda_graphs else c["kernels"] * gpu.launch_s,
    )


def step_time(graph: "Graph | GraphPlan", gpu: GPU, batch: int = 1, q: int = 1, cache_len: int = 0, *,
              dtype: str = "bfloat16", cuda_graphs: bool = False, context: int | None = None,
              escape_rate: float = U12_ESCAPE_RATE, what: str = "", shared: Graph | None = None) -> StepEstimate:
    """Cost one evaluation of `graph` (a target or drafter model graph) at this shape.

    `shared` is the target graph when `graph` is a drafter that borrows target weights. Pass a
    `GraphPlan.of(graph, shared)` instead of the graph to cost one graph at many shapes quickly."""
    if batch < 1 or q < 1 or cache_len < 0:
        raise ValueError(f"step_time: need batch >= 1, q >= 1, cache_len >= 0 (got {batch}, {q}, {cache_len})")
    plan = GraphPlan.of(graph, shared)
    shapes = _shapes(plan, batch, q, q if context is None else context)
    index: dict[tuple, int] = {}
    costs: list[NodeCost] = []
    counts: list[int] = []
    layout: list[tuple[str, int]] = []
    for (name, node, inputs), key in zip(plan.entries, plan.keys):
        ins = tuple(shapes[i] for i in inputs)
        k = (key, shapes[name], ins)
        i = index.get(k)
        if i is None:
            i = index[k] = len(costs)
            served = gpu.runs_triton and key.get(FUSED_LINEAR) and linear_serves(shapes[name][0], u12=False)
            cost = node_cost(name, node, shapes[name], list(ins), gpu, batch=batch, q=q, cache_len=cache_len,
                             dtype=dtype, cuda_graphs=cuda_graphs, escape_rate=escape_rate,
                             served_by=FUSED_LINEAR_KERNEL if served else "")
            few = key.get(FOLDED_FEW_ROWS)
            if gpu.runs_triton and (key.get(FOLDED) or (few and linear_serves(shapes[name][0], u12=few == "u12"))):
                cost = replace(cost, kernels=0, t_kernel=cost.t_kernel - cost.t_latency, t_latency=0.0, t_launch=0.0)
            costs.append(cost)
            counts.append(0)
        counts[i] += 1
        layout.append((name, i))
    return StepEstimate(what=what or plan.name, graph=plan.name, batch=batch, q=q, cache_len=cache_len,
                        cuda_graphs=cuda_graphs, costs=tuple(costs), counts=tuple(counts), layout=tuple(layout))


def at_floor(step: StepEstimate) -> StepEstimate:
    """The same step with every node at its floor (no efficiency loss, latency or launch)."""
    costs = tuple(replace(r, t_kernel=r.t_floor, t_latency=0.0, t_launch=0.0, efficiency=1.0) for r in step.costs)
    return replace(step, costs=costs, scale=1.0)


def weight_footprint(program: Program, escape_rate: float = U12_ESCAPE_RATE) -> float:
    """Bytes of every weight the deployment stores, each once (borrowed `target/` weights excluded)."""
    total = 0.0
    for graph in (program.target, program.drafter):
        for _, node in graph.items():
            weight = node.get("weight", "")
            if node.op == "lm_head" and node.get("vocab_subset"):  # its own copy of the subset's rows
                total += sum(matmul_weight_bytes(node, escape_rate))
                continue
            if graph is program.drafter and str(weight).startswith(SHARED):
                continue
            if node.op in MATMUL_OPS:
                if node.op == "lm_head" and node.get("tied", False):
                    continue  # the embedding's bytes, counted there
                total += sum(matmul_weight_bytes(node, escape_rate))
            elif node.op == "embed":
                total += node["vocab"] * node["dim"] * ACT_BYTES[node["dtype"]]
            elif node.op == "rmsnorm":
                total += node["dim"] * ACT_BYTES.get(program.attr("dtype", "bfloat16"), 2)
            elif node.op == "moe":  # every expert is stored, whichever ones a step reads
                total += node["experts"] * 3 * node["hidden"] * node["dim"] * ACT_BYTES[node["dtype"]]
            elif node.op == "gated_deltanet":  # the conv taps (A_log, dt_bias, the gated norm: a few vectors)
                conv_dim = 2 * node["k_heads"] * node["k_head_dim"] + node["v_heads"] * node["v_head_dim"]
                total += conv_dim * node["conv_kernel"] * ACT_BYTES.get(program.attr("dtype", "bfloat16"), 2)
    return total

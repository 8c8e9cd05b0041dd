"""`weights-u12{min-numel=N, kernel=K, layout=L}`: store large bf16 matmul weights in the 12-bit format.

Changes the `format` (to "u12") and `kernel` of every `linear`/`lm_head` node of the target and
drafter graphs whose weight is bf16 and has at least `min-numel` elements; weights the drafter
borrows from the target follow the target's node. Lossless: u12 is a bit-exact re-encoding of
bf16 (sign and mantissa byte, 4-bit exponent code, exact escape table), so every weight is
unchanged bit for bit. Logits can still move by rounding, because another kernel sums in another
order; token forcing is the judge of the output tokens.

Kernels: "triton-u12" (fused decode-GEMV/GEMM, GPU) or "torch" (unpack then matmul: the
reference, runs anywhere). Applies only to bfloat16 deployments (u12 encodes bf16 values).

Layout (the node's `layout`, U12Tensor.layout): "rows" (the planes row by row), "tiles" (16 rows
by 64 weights at a time, where N % 16 == 0 and K % 64 == 0; other weights stay rows), or "auto"
(the default): tiles where the deployment's step verifies TILES_FROM_ROWS or more tokens a call
(its verify node's q: the rows the target's matmuls take; the drafter's block as wide), else rows.
A weight whose shape does not tile keeps rows whatever the layout asked (its node says so).
Both hold the
same bytes and every kernel reads either. On the H200 (Llama-3.1-8B, bench/results/step_ab*_h200.json,
753d9c4) the verify(16) step ran 4.613 ms on tiles against 5.151 on rows, the AR step 3.820 against
3.405: tiles for a target that verifies blocks, rows for one-row decoding.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..formats.u12 import tiles_fit
from ..ir import MATMUL_OPS, Node, Program
from ..ir.lower import SHARED
from .base import Pass, PassResult, register

KERNELS = ("triton-u12", "torch")
LAYOUTS = ("auto", "rows", "tiles")
TILES_FROM_ROWS = 3  # kernels/u12's TENSOR_CORE_ROWS: from here the hmma kernel, tiles' gainer


@register
@dataclass(frozen=True)
class WeightsU12(Pass):
    name = "weights-u12"
    lossless = True
    closes = "weight bytes (bf16 -> u12)"
    min_numel: int = 1 << 20
    kernel: str = "triton-u12"
    layout: str = "auto"

    def __post_init__(self):
        if self.min_numel < 1:
            raise ValueError(f"min-numel must be >= 1, got {self.min_numel}")
        if self.kernel not in KERNELS:
            raise ValueError(f"kernel must be one of {', '.join(KERNELS)}, got {self.kernel!r}")
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}, got {self.layout!r}")

    def _eligible(self, node: Node) -> bool:
        return (node.op in MATMUL_OPS and not node["weight"].startswith(SHARED) and node["format"] == "bfloat16"
                and node["in_features"] * node["out_features"] >= self.min_numel)

    def _layout(self, program: Program) -> dict:
        """The nodes' `layout` attribute: "tiles", or absent for rows (so row-layout programs are the
        programs they were); "auto" decided by the step's verify width."""
        layout = self.layout
        if layout == "auto":
            q = max((node["q"] for _, node in program.step.items() if node.op == "verify"), default=1)
            layout = "tiles" if q >= TILES_FROM_ROWS else "rows"
        return {"layout": layout} if layout == "tiles" else {}

    def apply(self, program: Program) -> PassResult:
        if program.attr("dtype") != "bfloat16":
            return PassResult(program, False, f"no change: u12 encodes bf16 weights, deployment is {program.attr('dtype')}")
        total, layout = 0, self._layout(program)

        def rewrite(_: str, node: Node) -> Node | None:
            if not self._eligible(node):
                return None
            tiles = layout and tiles_fit((node["out_features"], node["in_features"]))  # others stay rows
            return node.replace(format="u12", kernel=self.kernel, **(layout if tiles else {}))

        for level in ("target", "drafter"):
            graph, n = program.graph(level).map_nodes(rewrite)
            program, total = program.with_graph(level, graph), total + n
        return PassResult(program, total > 0, f"{total} matmul weights in u12"
                          + (", tiled" if layout else ""))

    @classmethod
    def schedule_space(cls, program: Program) -> list[Pass]:
        candidates = [cls(min_numel=1 << 20), cls(min_numel=1 << 24)]
        return [c for c in candidates if c.apply(program).changed]

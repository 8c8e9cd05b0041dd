"""fp32 linears on the CPU through oneDNN, each weight packed once into oneDNN's blocked layout.

A speculative step's verify runs the target's linears at a few rows (block 4: 4 rows) where AR runs
them at one. MKL's fp32 GEMM, what `F.linear` runs on the CPU, is poor at those row counts: on
SmolLM2-135M (one thread) 4 rows took 1.57x one row's time over the layers and 2.2x at the 49152-row
head; over packed weights 1.40x and 1.15x (bench/results/cpu_spec_step_cpu_smollm2-before-rerun.json,
..._gemv1.json). At one row MKL's GEMV stays: packed, the layers' small matrices lost
(..._packed.json), so AR runs what it ran before packing.

`PackedLinear` keeps the original weight as its `weight` (the same Parameter: a tied head stays tied,
state_dict keys are unchanged, readers of `.weight` see the values they did) beside the packed copy,
so a packed model holds its linear weights twice.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def packed_linear_available() -> bool:
    """Whether this torch has oneDNN and the packed-linear ops (the ones torch's own CPU compiler uses)."""
    mkldnn = getattr(torch.ops, "mkldnn", None)
    return (torch.backends.mkldnn.is_available() and hasattr(mkldnn, "_reorder_linear_weight")
            and hasattr(mkldnn, "_linear_pointwise"))


class PackedLinear(nn.Module):
    """y = x·Wᵀ (+ b) by oneDNN over W packed once; `weight` and `bias` are the tensors given (an
    nn.Linear's own Parameters where `of` builds it)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        if weight.device.type != "cpu" or weight.dtype != torch.float32 or weight.dim() != 2:
            raise ValueError(f"PackedLinear packs fp32 CPU weights [out, in], got {weight.dtype} "
                             f"{tuple(weight.shape)} on {weight.device}")
        self.out_features, self.in_features = weight.shape
        self.weight = weight
        self.bias = bias
        self._packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach())

    @classmethod
    def of(cls, linear: nn.Linear) -> "PackedLinear":
        return cls(linear.weight, linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() <= x.shape[-1]:  # one row (or none): MKL's GEMV by F.linear, as AR ran before packing
            return F.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self._packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def pack_linears(root: nn.Module) -> int:
    """Replace every fp32 CPU `nn.Linear` under `root` (root itself excepted) by a PackedLinear;
    returns how many. Nothing changes where oneDNN's packed linear is not available."""
    if not packed_linear_available():
        return 0
    swapped = 0
    for parent in list(root.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear and child.weight.device.type == "cpu" and child.weight.dtype == torch.float32:
                setattr(parent, name, PackedLinear.of(child))
                swapped += 1
    return swapped

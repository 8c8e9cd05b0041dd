"""Where the kernels meet the runtime: the one module that imports both.

The runtime is pure torch with hook points (`FusedOps` for the fused decoder stacks, an
`Attention.attention` function per layer, a tree builder for the graphed tree loops). This module
fills them: with the Triton kernels where Triton runs (a CUDA GPU, or the interpreter under
TRITON_INTERPRET=1), or with the kernels' own torch references elsewhere, which share their
signatures, so a CPU run exercises the same wiring.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from contextlib import contextmanager

import torch
from torch import nn

from ..kernels import (attention_split_kv, best_first_tree, fused_linear, gdn_tree, rmsnorm, rope_attention, rope_kv,
                       silu_mul, u12)
from ..kernels.overlap import Launch
from ..kernels.tuning import KernelTuning
from ..runtime import batch
from ..runtime.dflash import DFlashDrafter
from ..runtime.fused import FusedDecoder, FusedDFlash, FusedOps, install_fused
from ..runtime.model import Attention, Transformer, Visibility

KINDS = ("triton", "torch")
# The launch of a u12 stack's forwards of few rows (FusedOps.u12_launch_rows): PDL mode 2, each kernel
# waiting for the one before, where the GPU has PDL (docs/experiments/fused-stack.md: U12_PDL).
U12_LAUNCH = Launch(pdl=2)


def triton_runs(device: torch.device) -> bool:
    """Whether Triton kernels run for tensors on `device`: a CUDA GPU, or anything under the interpreter."""
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


# The tuned config tables the kernels consult (kernels/tuning.KernelTuning), by name, and their config class.
TUNING_TYPES = {"fused_linear": fused_linear.FusedLinearConfig, "u12": u12.U12Config, "u12_tiles": u12.U12Config,
                "u12_fused": u12.U12Config}


def builtin_tuning() -> KernelTuning:
    """The tuned tables of this install's kernels: what a compile stores in the engine (engine_tuning.json)."""
    return KernelTuning({"fused_linear": dict(fused_linear.TUNED), "u12": dict(u12.TUNED),
                         "u12_tiles": dict(u12.TUNED_TILES), "u12_fused": dict(u12.TUNED_FUSED)})


def fused_ops(kind: str, u12_linear: bool = True, tuning: KernelTuning | None = None, **fields) -> FusedOps:
    """"triton": the kernels; "torch": their references (same signatures). u12_linear: u12 layers
    take the fused linear too (else their projections run u12_linear with the separate kernels).
    `tuning`: the tuned tables the kernels take their configs from (an engine's own; default the
    kernels' module tables). `fields` override FusedOps' policy defaults."""
    if kind == "triton":
        tuned = functools.partial
        ops = FusedOps(rmsnorm.rmsnorm, rope_kv.rope_qkv, silu_mul.silu_mul, kind,
                       linear=tuned(fused_linear.fused_linear, tuning=tuning),
                       linear_u12=tuned(u12.u12_fused_linear, tuning=tuning),
                       u12_kernel="triton-u12" if u12_linear else "", rope_attention=rope_attention.rope_attention,
                       split_kv=split_kv_attention, u12_project=tuned(u12.u12_linear, tuning=tuning), launch=Launch(),
                       u12_launch=U12_LAUNCH)
    elif kind == "torch":
        ops = FusedOps(rmsnorm.rmsnorm_reference, rope_kv.rope_qkv_reference, silu_mul.silu_mul_reference, kind,
                       linear=fused_linear.fused_linear_reference, linear_u12=u12.u12_fused_linear_reference,
                       u12_kernel="torch" if u12_linear else "", u12_project=u12.u12_linear_reference)
    else:
        raise ValueError(f"fused ops are one of {KINDS}, got {kind!r}")
    ops = dataclasses.replace(ops, new_row_squares=fused_linear.RowSquares, norm_handoff=u12.NormHandoff,
                              u12_fuses=u12.fused_applies)
    return dataclasses.replace(ops, **fields) if fields else ops


def with_launch(ops: FusedOps, launch: Launch) -> FusedOps:
    """`ops` with every forward's kernels launched by `launch` (a PDL mode, the L2 prefetch), the u12
    stacks' few-row forwards included: how a benchmark times a launch setting beside the default."""
    return dataclasses.replace(ops, launch=launch, u12_launch=launch)


def install(model: Transformer | DFlashDrafter, kind: str | None = None,
            tuning: KernelTuning | None = None) -> FusedDecoder | FusedDFlash:
    """Serve `model` with the fused stack: the kernels where Triton runs, the references elsewhere,
    unless `kind` says; the kernels' configs from `tuning` (an engine's own tables)."""
    return install_fused(model, fused_ops(kind or ("triton" if triton_runs(model.device) else "torch"), tuning=tuning))


def split_kv_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, vis: Visibility,
                       launch: Launch | None = None) -> torch.Tensor:
    """The split-KV Triton kernel under `vis` (an `Attention.attention` implementation; the fused
    stacks pass their launch)."""
    return attention_split_kv.attention_split_kv(q, k, v, past=vis.past, mask=vis.new, scale=q.shape[-1] ** -0.5,
                                                 launch=launch)


def ragged_attention(device: torch.device):
    """The batched engine's attention (runtime/batch.py's RaggedAttention): split-KV's ragged mode
    where Triton runs, else the runtime's per-request SDPA."""
    return split_kv_ragged if triton_runs(device) else batch.ragged_attention_reference


def split_kv_ragged(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, r: batch.Ragged) -> torch.Tensor:
    """A RaggedAttention by split-KV's ragged mode: the Ragged's device tensors and its tree masks
    (a StaticRagged's too), no host field read, so a graph captures it."""
    args = r.device_args
    mask = r.mask if isinstance(r.mask, str) else r.tree_masks
    return attention_split_kv.attention_split_kv_ragged(q, k, v, cu_seqlens=args["cu"], slots=args["slots"],
                                                        past=args["pasts"], max_t=r.max_count, mask=mask)


def tree_builder(device: torch.device):
    """The best-first tree builder of the graphed tree loops: the Triton kernel where Triton runs,
    else its reference (a heap on the host)."""
    return best_first_tree.best_first_tree if triton_runs(device) else best_first_tree.best_first_tree_reference


def install_gdn_tree(model: nn.Module, kind: str | None = None) -> int:
    """Serve the tree verify of every Gated DeltaNet layer under `model` (GatedDeltaNet.tree_rule) by
    the Triton kernel where Triton runs, else its reference, unless `kind` says; returns how many."""
    from ..runtime.hybrid import GatedDeltaNet

    kind = kind or ("triton" if triton_runs(next(model.parameters()).device) else "torch")
    if kind not in KINDS:
        raise ValueError(f"gdn tree rule is one of {KINDS}, got {kind!r}")
    rule = gdn_tree.gdn_tree if kind == "triton" else gdn_tree.gdn_tree_reference
    layers = [m for m in model.modules() if isinstance(m, GatedDeltaNet)]
    for layer in layers:
        layer.tree_rule = rule
    return len(layers)


def _modules(model: nn.Module) -> tuple[int, ...]:
    """The identity of every module under `model`: a projection swapped for another (a u12 module
    for a plain one) changes it, so a fused stack kept over the old modules is not reused."""
    return tuple(id(m) for m in model.modules())


@contextmanager
def fused_path(model: Transformer, *others: nn.Module, tuning: KernelTuning | None = None):
    """For the duration: `model` and the DFlash drafters among `others` served by their fused
    stacks (installed once and kept while their modules stay the same) and split-KV attention, as
    the fused-decoder and attention-split-kv passes would build them; the other `others` (PARD
    drafters' models) get split-KV attention only. Restored after, so benchmarks can compare paths
    on one set of weights. Graphed runners are keyed by this setup (graph_decode.runner_for).
    `tuning`: the kernels' tuned tables (an engine's own)."""
    fused = [model, *(m for m in others if isinstance(m, DFlashDrafter))]
    for m in fused:
        if getattr(m, "fused_kept", None) is None or getattr(m, "fused_kept_over", None) != _modules(m):
            m.fused_kept, m.fused_kept_over = install(m, tuning=tuning), _modules(m)
    attentions = [m for root in (model, *others) for m in root.modules() if isinstance(m, Attention)]
    before = [a.attention for a in attentions]
    for m in fused:
        m.fused = m.fused_kept
    for a in attentions:
        a.attention = split_kv_attention
    try:
        yield model
    finally:
        for m in fused:
            m.fused = None
        for a, fn in zip(attentions, before):
            a.attention = fn

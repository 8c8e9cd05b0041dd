"""The counters of the serial split-K semaphore, kept with the weight they serve.

A split-K launch (fused_linear's dot kernel, u12's tile, mma and hmma kernels) stores each
program's fp32 partial; the last program of an output block to arrive (an acq_rel counter per
block, CUTLASS's serial split-K) sums the partials in split order, runs the epilogue and resets
its counter to 0. One launch, no memset, no host sync, deterministic. The counters live with the
weight (a U12Tensor, or a bf16 weight's storage, so views of one concatenated weight share them),
so two streams must not run the same weight at the same time.
"""

from __future__ import annotations

import weakref

import torch

_COUNTERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def split_counters(owner, size: int, device: torch.device) -> torch.Tensor:
    """Zeroed int32 counters for `owner`'s split-K launches; the kernels leave them 0. A larger
    request allocates a new buffer and keeps the old ones alive (a captured CUDA graph may still
    point at them)."""
    bufs = _COUNTERS.setdefault(owner, [])
    if not bufs or bufs[-1].numel() < size:
        bufs.append(torch.zeros(max(size, 1024), dtype=torch.int32, device=device))
    return bufs[-1]


def counters_of(owner) -> list[torch.Tensor]:
    """Every counter buffer kept for `owner` (none: an empty list), for checks that they are 0."""
    return list(_COUNTERS.get(owner, []))

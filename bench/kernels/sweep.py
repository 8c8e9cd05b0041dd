"""What the kernel sweeps share: a config's output checked against the reference, and the summary
printed after a sweep (bench/kernels/u12_linear.py, fused_linear.py, u12_fused_linear.py)."""

from __future__ import annotations

from pathlib import Path

import torch


def check_close(y: torch.Tensor, ref: torch.Tensor, scale: torch.Tensor) -> None:
    """y and ref (bf16) may differ by one bf16 step (2^-7 relative) after fp32 sums of different
    order, whose error grows with K: allow 2^-16 of sum |x| |w| (``scale``; typical is sqrt(K) 2^-24
    of it). AssertionError naming how many outputs differ otherwise."""
    bad = (y.float() - ref.float()).abs() > 2**-7 * ref.float().abs() + 2**-16 * scale
    if bad.any() or not torch.isfinite(y).all():
        raise AssertionError(f"differs from the reference at {int(bad.sum())} of {y.numel()} outputs")


def print_sweep_summary(device: str, out: Path | None, sweep: list[dict], sweep_s: float) -> None:
    """Where the file went, the sweep's row, error and skip counts, its first errors."""
    errors = [r for r in sweep if "error" in r]
    skipped = sum("skipped" in r for r in sweep)
    print(f"{device}: wrote {out or 'nothing (--smoke without --out)'}")
    print(f"sweep: {len(sweep)} rows, {len(errors)} errors, {skipped} skipped, {sweep_s:.0f} s")
    for r in errors[:5]:
        print(f"  error {r['name']} M={r['M']} {r['config']}: {r['error'][:160]}")

"""u12_linear against cuBLAS bf16 (x @ W.T) at the Llama-3.1-8B linear shapes, on one GPU.

For each shape and M in 1, 4, 16, 64: random N(0, 0.02) bf16 weights, a correctness check of
u12_linear against its reference (the registry tolerance), then both timed with
triton.testing.do_bench (CUDA events, L2 flushed before each call, median). Reports time,
achieved bandwidth (bytes read and written / time) and speedup; writes
bench/results/u12_linear_<gpu>.json and prints a short table last. About a minute on an H200,
most of it the autotuner's first calls.

    python bench/u12_linear.py [--out FILE]     (GIT_COMMIT=... where the tree has no .git)
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import subprocess
import sys
from pathlib import Path

import torch

SHAPES = {  # name: (N, K)
    "qkv": (6144, 4096),
    "o": (4096, 4096),
    "gate_up": (28672, 4096),
    "down": (4096, 14336),
    "lm_head": (128256, 4096),
}
MS = (1, 4, 16, 64)
SIGMA = 0.02
ROOT = Path(__file__).resolve().parent.parent


def git_commit() -> str:
    """HEAD, marked dirty when the files behind these numbers differ from it."""
    if os.environ.get("GIT_COMMIT"):  # set where the tree was copied without .git
        return os.environ["GIT_COMMIT"]
    run = lambda *a: subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    commit = run("rev-parse", "HEAD") or "unknown"
    files = ["bench/u12_linear.py", "kernels/u12_linear.py", "specpilot/runtime/u12.py"]
    return commit + ("-dirty" if run("status", "--porcelain", "--", *files) else "")


def check_close(y: torch.Tensor, ref: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """y and ref (bf16) may differ by one bf16 step (2^-7 relative) after fp32 sums of different
    order, whose error grows with K: allow 2^-16 of sum |x| |w| (typical is sqrt(K) 2^-24 of it)."""
    scale = x.abs().float() @ w.abs().float().T
    bad = (y.float() - ref.float()).abs() > 2**-7 * ref.float().abs() + 2**-16 * scale
    if bad.any() or not torch.isfinite(y).all():
        raise AssertionError(f"u12_linear differs from its reference at {int(bad.sum())} of {y.numel()} outputs")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="result file (default bench/results/u12_linear_<gpu>.json)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/u12_linear.py times CUDA kernels and needs a CUDA GPU; none is visible here.")

    import triton
    from triton.testing import do_bench

    from specpilot.kernels.u12_linear import _u12_linear_tuned, u12_linear, u12_linear_reference
    from specpilot.runtime.u12 import pack_u12

    gpu = torch.cuda.get_device_name()
    g = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    do_bench(lambda: a @ a, warmup=500, rep=500)  # clocks up from idle before the first timing
    del a
    rows = []
    for name, (n, k) in SHAPES.items():
        w = (torch.randn(n, k, device="cuda", generator=g) * SIGMA).to(torch.bfloat16)
        t = pack_u12(w)
        for m in MS:
            x = torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16)
            y = u12_linear(x, t)  # first call autotunes
            ref = u12_linear_reference(x, t)
            err = float((y.float() - ref.float()).norm() / ref.float().norm())
            check_close(y, ref, x, w)
            t_cublas = do_bench(lambda: x @ w.T, warmup=25, rep=100, return_mode="median") * 1e3
            t_u12 = do_bench(lambda: u12_linear(x, t), warmup=25, rep=100, return_mode="median") * 1e3
            io = 2 * m * k + 2 * m * n  # x read, y written
            rows.append({
                "name": name, "N": n, "K": k, "M": m,
                "cublas_us": t_cublas, "u12_us": t_u12, "speedup": t_cublas / t_u12,
                "cublas_tb_s": (2 * n * k + io) / t_cublas / 1e6,
                "u12_tb_s": (t.nbytes + io) / t_u12 / 1e6,
                "u12_bytes": t.nbytes, "bf16_bytes": 2 * n * k, "escapes": t.esc_idx.numel(),
                "rel_err_vs_reference": err, "config": str(_u12_linear_tuned.best_config),
            })
        del w, t
        torch.cuda.empty_cache()

    result = {
        "what": "u12_linear vs cuBLAS bf16 x @ W.T, Llama-3.1-8B linear shapes, N(0, 0.02) weights",
        "timing": "triton.testing.do_bench, L2 flushed before each call, median, warmup 25 ms, rep 100 ms",
        "gpu": gpu, "torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda,
        "python": platform.python_version(), "git_commit": git_commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "rows": rows,
    }
    out = args.out or ROOT / "bench" / "results" / f"u12_linear_{re.sub(r'[^a-z0-9]+', '_', gpu.lower()).strip('_')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")

    print(f"{gpu}, torch {torch.__version__}, triton {triton.__version__}; wrote {out}")
    print(f"{'shape':<8} {'M':>3} {'cuBLAS us':>10} {'TB/s':>6} {'u12 us':>8} {'TB/s':>6} {'speedup':>8}  config")
    for r in rows:
        print(f"{r['name']:<8} {r['M']:>3} {r['cublas_us']:>10.1f} {r['cublas_tb_s']:>6.2f} {r['u12_us']:>8.1f} "
              f"{r['u12_tb_s']:>6.2f} {r['speedup']:>7.2f}x  {r['config']}")


if __name__ == "__main__":
    main()

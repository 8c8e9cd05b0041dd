"""attention_split_kv against the runtime's `attend` (torch SDPA) at Llama-3.1-8B attention shapes.

32 query heads, 8 kv heads, head dim 128, bf16, batch 1; T new tokens in 1, 4, 16, 64 under the
causal mask (a chain verify; T = 1 is an AR step) over a cache of S in 512, 4096, 32768 keys,
laid out as the runtime's KVCache (a [1, 8, max_len, 128] buffer viewed up to past + T). For each
shape: a correctness check of the kernel against its fp32 reference (the registry's bf16 tolerance), then
both timed with triton.testing.do_bench (CUDA events, L2 flushed before each call, median).
Reports time, achieved bandwidth on the K/V bytes read (2 · S · 8 · 128 · 2 bytes), the K/V read
floor at the read bandwidth measured here, speedup and the kernel's plan (row blocks, splits);
writes bench/results/attention_split_kv_<gpu>.json and prints a short table last. Well under two
minutes on an H200.

    python bench/attention_split_kv.py [--out FILE]     (GIT_COMMIT=... where the tree has no .git)
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

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128  # Llama-3.1-8B
TS = (1, 4, 16, 64)
SS = (512, 4096, 32768)
ROOT = Path(__file__).resolve().parent.parent


def git_commit() -> str:
    """HEAD, marked dirty when the files behind these numbers differ from it."""
    if os.environ.get("GIT_COMMIT"):  # set where the tree was copied without .git
        return os.environ["GIT_COMMIT"]
    run = lambda *a: subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    commit = run("rev-parse", "HEAD") or "unknown"
    files = ["bench/attention_split_kv.py", "kernels/attention_split_kv.py", "specpilot/runtime/model.py"]
    return commit + ("-dirty" if run("status", "--porcelain", "--", *files) else "")


def read_bandwidth(do_bench) -> float:
    """TB/s of a sum over 2 GiB of bf16; warms the clocks up from idle first."""
    big = torch.empty(1 << 30, device="cuda", dtype=torch.bfloat16)
    do_bench(big.sum, warmup=500, rep=500)
    return big.numel() * 2 / do_bench(big.sum, warmup=25, rep=200, return_mode="median") / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="result file (default bench/results/attention_split_kv_<gpu>.json)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/attention_split_kv.py times CUDA kernels and needs a CUDA GPU; none is visible here.")
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("bench/attention_split_kv.py: unset TRITON_INTERPRET to time compiled kernels.")

    import triton
    from triton.testing import do_bench

    from specpilot.kernels import KERNELS
    from specpilot.kernels.attention_split_kv import attention_split_kv, attention_split_kv_reference, plan, sm_count
    from specpilot.runtime.model import attend, build_mask

    gpu = torch.cuda.get_device_name()
    device = torch.device("cuda")
    atol, rtol = KERNELS["attention_split_kv"].tolerance[torch.bfloat16]
    g = torch.Generator(device="cuda").manual_seed(0)
    read_tb_s = read_bandwidth(do_bench)

    rows = []
    for s_cache in SS:
        for t in TS:
            past = s_cache - t
            buf_k = torch.randn(1, KV_HEADS, s_cache + 64, HEAD_DIM, device="cuda", generator=g).to(torch.bfloat16)
            buf_v = torch.randn(1, KV_HEADS, s_cache + 64, HEAD_DIM, device="cuda", generator=g).to(torch.bfloat16)
            k, v = buf_k[:, :, :s_cache], buf_v[:, :, :s_cache]  # as KVCache.view gives them
            q = torch.randn(1, HEADS, t, HEAD_DIM, device="cuda", generator=g).to(torch.bfloat16)
            mask = build_mask("causal", past, t, device)  # built once a forward in the runtime, not timed

            def kernel():
                return attention_split_kv(q, k, v, past=past, mask="causal")

            def sdpa():
                return attend(q, k, v, mask)

            out, ref = kernel(), attention_split_kv_reference(q, k, v, past=past, mask="causal")  # first call compiles
            torch.testing.assert_close(out, ref, atol=atol, rtol=rtol)
            err = float((out.float() - sdpa().float()).abs().max())
            t_sdpa = do_bench(sdpa, warmup=25, rep=100, return_mode="median") * 1e3
            t_kernel = do_bench(kernel, warmup=25, rep=100, return_mode="median") * 1e3
            kv_bytes = 2 * KV_HEADS * s_cache * HEAD_DIM * 2
            p = plan(1, HEADS, KV_HEADS, t, s_cache, sm_count(device))
            rows.append({
                "T": t, "S": s_cache, "heads": HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM, "mask": "causal",
                "sdpa_us": t_sdpa, "kernel_us": t_kernel, "speedup": t_sdpa / t_kernel,
                "sdpa_tb_s": kv_bytes / t_sdpa / 1e6, "kernel_tb_s": kv_bytes / t_kernel / 1e6,
                "kv_bytes": kv_bytes, "kv_floor_us": kv_bytes / read_tb_s / 1e6,
                "max_abs_err_vs_sdpa": err, "plan": p._asdict(),
            })

    result = {
        "what": "attention_split_kv vs the runtime's attend (torch SDPA), Llama-3.1-8B attention shapes, "
                "bf16, batch 1, causal mask over a KVCache-layout cache",
        "timing": "triton.testing.do_bench, L2 flushed before each call, median, warmup 25 ms, rep 100 ms",
        "bandwidth": "K/V bytes read / time; kv_floor_us at the read bandwidth measured here (sum over 2 GiB)",
        "read_tb_s": read_tb_s, "sms": sm_count(device),
        "gpu": gpu, "torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda,
        "python": platform.python_version(), "git_commit": git_commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "rows": rows,
    }
    slug = re.sub(r"[^a-z0-9]+", "_", gpu.lower()).strip("_")
    out = args.out or ROOT / "bench" / "results" / f"attention_split_kv_{slug}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")

    print(f"{gpu}, torch {torch.__version__}, triton {triton.__version__}; read {read_tb_s:.2f} TB/s; wrote {out}")
    print(f"{'S':>6} {'T':>3} {'SDPA us':>8} {'TB/s':>6} {'kernel us':>10} {'TB/s':>6} {'floor us':>9} {'speedup':>8}  splits")
    for r in rows:
        print(f"{r['S']:>6} {r['T']:>3} {r['sdpa_us']:>8.1f} {r['sdpa_tb_s']:>6.2f} {r['kernel_us']:>10.1f} "
              f"{r['kernel_tb_s']:>6.2f} {r['kv_floor_us']:>9.1f} {r['speedup']:>7.2f}x  {r['plan']['splits']}")


if __name__ == "__main__":
    main()

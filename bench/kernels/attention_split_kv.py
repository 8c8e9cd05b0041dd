"""attention_split_kv against the runtime's `attend` (torch SDPA) at Llama-3.1-8B attention shapes.

32 query heads, 8 kv heads, head dim 128, bf16, batch 1; T new tokens in 1, 4, 16, 64 under the
causal mask (a chain verify; T = 1 is an AR step) over a cache of S in 512, 4096, 32768 keys,
laid out as the runtime's KVCache (a [1, 8, max_len, 128] buffer viewed up to past + T). For each
shape: a correctness check of the kernel against its fp32 reference (the registry's bf16 tolerance), then
both timed with triton.testing.do_bench (CUDA events, L2 flushed before each call, median).
Reports time, achieved bandwidth on the K/V bytes read (2 · S · 8 · 128 · 2 bytes), the K/V read
floor at the read bandwidth measured here (harness.read_bandwidth), speedup and the kernel's plan
(row blocks, splits); writes bench/results/attention_split_kv_<gpu>[_<tag>].json through the harness
and prints a short table last. Well under two minutes on an H200.

    python -m bench.kernels.attention_split_kv [--out FILE|DIR] [--tag TAG]
"""

from __future__ import annotations

import argparse
import sys

import torch

from bench import shapes
from specpilot.bench import harness

_LLAMA = shapes.config(shapes.LLAMA_8B)
HEADS, KV_HEADS, HEAD_DIM = _LLAMA["num_attention_heads"], _LLAMA["num_key_value_heads"], _LLAMA["head_dim"]
TS = (1, 4, 16, 64)
SS = (512, 4096, 32768)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    harness.add_results_args(parser, smoke=False)
    args = parser.parse_args(argv)
    if reason := harness.refuse_device("bench.kernels.attention_split_kv", smoke=False):
        print(reason, file=sys.stderr)
        return 2

    from triton.testing import do_bench

    from specpilot.kernels import KERNELS
    from specpilot.kernels.attention_split_kv import attention_split_kv, attention_split_kv_reference, plan, sm_count
    from specpilot.runtime.model import attend, build_mask

    device = torch.device("cuda")
    atol, rtol = KERNELS["attention_split_kv"].tolerance[torch.bfloat16]
    g = torch.Generator(device="cuda").manual_seed(0)
    read_tb_s = harness.read_bandwidth(device) / 1e12

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

    out = harness.write_run(
        args, "attention_split_kv", device, rows, read_tb_s=read_tb_s, sms=sm_count(device),
        timing="triton.testing.do_bench, L2 flushed before each call, median, warmup 25 ms, rep 100 ms",
        bandwidth="K/V bytes read / time; kv_floor_us at the read bandwidth measured here (sum over 4 GiB)")
    print(f"{harness.device_name(device)}; read {read_tb_s:.2f} TB/s; wrote {out}")
    print(f"{'S':>6} {'T':>3} {'SDPA us':>8} {'TB/s':>6} {'kernel us':>10} {'TB/s':>6} {'floor us':>9} {'speedup':>8}  splits")
    for r in rows:
        print(f"{r['S']:>6} {r['T']:>3} {r['sdpa_us']:>8.1f} {r['sdpa_tb_s']:>6.2f} {r['kernel_us']:>10.1f} "
              f"{r['kernel_tb_s']:>6.2f} {r['kv_floor_us']:>9.1f} {r['speedup']:>7.2f}x  {r['plan']['splits']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Kernel counts of the project runtime's steps at Llama-3.1-8B shapes (the reference stack, as
bench.steps.step_times builds it), and the cost of a host round trip (what an accept on the host
pays a step): the cost model's kernel counts and host_sync_s (docs/COST-MODEL.md).

    python -m bench.steps.runtime_kernels [--out FILE|DIR]     # a CUDA GPU

Writes bench/results/runtime_kernels_<gpu>.json through the harness: target_q1, target_q16 and
draft_q16 (CUDA kernels of one eager step), target_q16_top (the verify step's kernels by name) and
host_roundtrip_us_median.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import Counter

import torch
from torch.profiler import ProfilerActivity, profile

from bench import shapes
from bench.steps import step_times as st
from specpilot.bench import harness
from specpilot.hf.config import DrafterConfig, ModelConfig
from specpilot.runtime.dflash import DFlashDrafter
from specpilot.runtime.model import Transformer

CACHE_LEN = 512


def kernels(fn) -> list[str]:
    """The CUDA kernels one eager call of `fn` launches (after one call unprofiled)."""
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


@torch.inference_mode()
def main(argv: list[str] | None = None) -> int:
    args = harness.add_results_args(argparse.ArgumentParser(description=__doc__.splitlines()[0]),
                                    smoke=False).parse_args(argv)
    if (reason := harness.refuse_device("bench.steps.runtime_kernels", False)) is not None:
        print(reason, file=sys.stderr)
        return 2
    name, device = shapes.LLAMA_8B, torch.device("cuda")
    out: dict = {}
    cfg = ModelConfig.from_hf(st.SHAPES[name], name)
    torch.manual_seed(0)
    with torch.device(device):
        model = Transformer(cfg).to(torch.bfloat16)
    st.random_(model)
    cache = model.new_cache(1, CACHE_LEN + 128)
    for q in (1, 16):
        ids = torch.randint(0, cfg.vocab_size, (1, q), device=device)

        def step(ids=ids):
            cache.length = CACHE_LEN
            return model(ids, cache)
        names = kernels(step)
        out[f"target_q{q}"] = len(names)
        if q == 16:
            out["target_q16_top"] = Counter(n.split("<")[0][:60] for n in names).most_common(25)
    dflash = shapes.dflash_config(name)
    dcfg = DrafterConfig.from_hf({**st.SHAPES[name], **{k: dflash[k] for k in (
        "num_hidden_layers", "block_size", "mask_token_id", "target_layer_ids")}}, name + "-dflash")
    with torch.device(device):
        drafter = DFlashDrafter(dcfg, model.embed, model.head).to(torch.bfloat16)
    st.random_(drafter)
    dcache = drafter.new_cache(1, CACHE_LEN + 128)
    block = torch.full((1, dcfg.block_size), dcfg.mask_token_id, device=device)
    ctx = torch.randn(1, 4, len(dcfg.target_layer_ids) * cfg.hidden_size, device=device, dtype=torch.bfloat16)

    def draft():
        dcache.length = CACHE_LEN
        return drafter(block, ctx, dcache)
    out[f"draft_q{dcfg.block_size}"] = len(kernels(draft))
    # a greedy accept on the host: q ids to the host, the compare, the accepted count back
    a = torch.randint(0, 1000, (16,), device=device)
    b = a.clone()

    def roundtrip():
        x, y = a.tolist(), b.tolist()
        n = next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), len(x))
        return torch.tensor([n], device=device)
    seconds = []
    for _ in range(200):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        roundtrip()
        torch.cuda.synchronize()
        seconds.append(time.perf_counter() - t0)
    out["host_roundtrip_us_median"] = statistics.median(seconds[20:]) * 1e6
    path = harness.write_run(args, "runtime_kernels", device, [], shape=name, cache_len=CACHE_LEN, **out)
    print({k: v for k, v in out.items() if k != "target_q16_top"}, "->", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Step times of the runtime at 8B shapes on a GPU, beside the weight-read floor.

    python bench/step_times.py [--shapes llama-3.1-8b qwen3-8b] [--out bench/results/step_times_<gpu>.json]

Random bf16 weights N(0, 0.02) (never zeros), batch 1, a 512-token cache. Each step (AR q=1,
verify q=4..64, DFlash-style drafter step: 5 layers, block 16) is captured once in a CUDA graph and
replayed; times are CUDA events around single replays after warm-up, median of the repeats.
The floor is the bytes of weights the step reads / the read bandwidth measured in the same run.
Writes a results file (GPU, versions, commit) and prints a short table last.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
from pathlib import Path

import torch

from specpilot.runtime.config import DrafterConfig, ModelConfig
from specpilot.runtime.dflash import DFlashDrafter
from specpilot.runtime.model import Transformer

SHAPES = {
    "llama-3.1-8b": dict(model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                         num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                         rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False,
                         max_position_embeddings=131072),
    "qwen3-8b": dict(model_type="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                     num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                     rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=False,
                     max_position_embeddings=40960),
}
VERIFY_Q = (4, 8, 16, 32, 64)
CACHE_LEN = 512
DRAFT_LAYERS, DRAFT_BLOCK, DRAFT_NEW_CONTEXT = 5, 16, 4


def read_bandwidth(gib: int = 4, repeats: int = 20) -> float:
    """Bytes/s of a full read (a sum) over a `gib` GiB bf16 tensor."""
    x = torch.randn(gib * 2**29, device="cuda", dtype=torch.bfloat16)
    times = time_fn(lambda: x.sum(), repeats)
    return x.numel() * 2 / statistics.median(times)


def time_fn(fn, repeats: int) -> list[float]:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b) / 1e3)
    return out


def graphed(step):
    """Capture `step` in a CUDA graph (after warm-up on a side stream); return the replay function."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        step()
    return g.replay


def random_(module: torch.nn.Module) -> None:
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0.0, 0.02)


def weight_bytes(module: torch.nn.Module, skip: tuple[str, ...] = ()) -> int:
    return sum(p.numel() * p.element_size() for n, p in module.named_parameters() if not n.startswith(skip))


@torch.inference_mode()
def bench_shape(name: str, bw: float, repeats: int) -> list[dict]:
    cfg = ModelConfig.from_hf(SHAPES[name], name)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = Transformer(cfg).to(torch.bfloat16)
    random_(model)
    # per step: every linear and lm_head; the embedding contributes q rows only
    step_bytes = weight_bytes(model, skip=("model.embed_tokens",))
    cache = model.new_cache(1, CACHE_LEN + 128)
    rows = []
    for q in (1,) + VERIFY_Q:
        ids = torch.randint(0, cfg.vocab_size, (1, q), device="cuda")

        def step(ids=ids):
            cache.length = CACHE_LEN
            return model(ids, cache)

        t = statistics.median(time_fn(graphed(step), repeats))
        rows.append(dict(shape=name, what="ar" if q == 1 else "verify", q=q, cache_len=CACHE_LEN, ms=t * 1e3,
                         weight_bytes=step_bytes, floor_ms=step_bytes / bw * 1e3))

    dcfg = DrafterConfig.from_hf(
        {**SHAPES[name], "num_hidden_layers": DRAFT_LAYERS, "block_size": DRAFT_BLOCK,
         "mask_token_id": cfg.vocab_size - 1,
         "target_layer_ids": [1, cfg.num_layers // 4, cfg.num_layers // 2, 3 * cfg.num_layers // 4, cfg.num_layers - 1]},
        name + "-dflash")
    with torch.device("cuda"):
        drafter = DFlashDrafter(dcfg, model.embed, model.head).to(torch.bfloat16)
    random_(drafter)
    dcache = drafter.new_cache(1, CACHE_LEN + 128)
    block = torch.full((1, DRAFT_BLOCK), dcfg.mask_token_id, device="cuda")
    ctx = torch.randn(1, DRAFT_NEW_CONTEXT, len(dcfg.target_layer_ids) * cfg.hidden_size, device="cuda",
                      dtype=torch.bfloat16)

    def draft_step():
        dcache.length = CACHE_LEN
        return drafter(block, ctx, dcache)

    t = statistics.median(time_fn(graphed(draft_step), repeats))
    d_bytes = weight_bytes(drafter) + model.lm_head.weight.numel() * 2  # its layers + the shared lm_head
    rows.append(dict(shape=name, what="draft", q=DRAFT_BLOCK, cache_len=CACHE_LEN, ms=t * 1e3,
                     weight_bytes=d_bytes, floor_ms=d_bytes / bw * 1e3, drafter_layers=DRAFT_LAYERS))
    del model, drafter, cache, dcache
    torch.cuda.empty_cache()
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench/step_times.py needs a CUDA GPU", file=sys.stderr)
        return 2
    gpu = torch.cuda.get_device_name()
    bw = read_bandwidth()
    rows = [r for shape in args.shapes for r in bench_shape(shape, bw, args.repeats)]
    result = {
        "benchmark": "step_times",
        "gpu": gpu,
        "read_bandwidth_Bps": bw,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "commit": os.environ.get("SPECPILOT_COMMIT", "unknown"),
        "method": "CUDA graph per step, CUDA events, median of repeats; random bf16 N(0,0.02) weights; batch 1",
        "rows": rows,
    }
    slug = "h200" if "H200" in gpu else gpu.lower().replace(" ", "-")
    out = args.out or Path(__file__).parent / "results" / f"step_times_{slug}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"{gpu}: read bandwidth {bw / 1e12:.2f} TB/s -> {out}")
    print(f"{'shape':14} {'step':7} {'q':>3} {'ms':>8} {'floor ms':>9} {'x floor':>8}")
    for r in rows:
        print(f"{r['shape']:14} {r['what']:7} {r['q']:>3} {r['ms']:8.3f} {r['floor_ms']:9.3f} {r['ms'] / r['floor_ms']:8.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

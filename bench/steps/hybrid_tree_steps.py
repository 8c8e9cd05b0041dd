"""Hybrid tree-verify step times at an 8B-class hybrid shape, against its chain verify and its AR step.

The shape: Llama-3.1-8B widths (hidden 4096, MLP 14336, 32 layers, 32 query / 8 KV heads of 128,
vocabulary 128256) as a Qwen3-Next-family hybrid whose layers are three of every four Gated DeltaNet
(16 key heads, 32 value heads, dk = dv = 128, conv kernel 4; Qwen3-Next's mixer widths) and every
fourth gated full attention. Random N(0, 0.02) bf16 weights, a 512-token context prefilled.

Steps, each the runtime's HybridTransformer forward (eager modules, captured in one CUDA graph):
  ar               one token;
  chain-q-kernel   a causal verify of q tokens, its Gated DeltaNet layers in WY form on
                   kernels/gdn_tree.py (a chain is a tree of one path); chain-q-torch on the reference;
  tree-n-kernel    a best-first-shaped tree of n nodes plus the anchor under its ancestor mask, the
                   Gated DeltaNet layers on kernels/gdn_tree.py; tree-n-torch the same on the torch
                   reference (a triangular solve); commit-n the accepted path's commit (eager: the
                   attention KV moves by host indices).
Beside each: the weight-read floor (weight bytes / measured read bandwidth) and, for trees, what the
step keeps until its commit against per-node state snapshots (hybrid_tree.tree_state_bytes) and the
peak memory the forward allocates. Writes bench/results/hybrid_tree_steps_<gpu>[_<tag>].json.

    python -m bench.steps.hybrid_tree_steps [--budgets 16,32,64] [--chains 16] [--repeats 30] [--out F|DIR]
    python -m bench.steps.hybrid_tree_steps --smoke --out DIR     # tiny shape on the CPU (interpreter)
"""

from __future__ import annotations

import argparse
import sys

import torch

from bench import shapes
from specpilot.backends.kernel_hooks import install_gdn_tree
from specpilot.bench import harness
from specpilot.hf.config import HybridConfig
from specpilot.runtime.hybrid import HybridTransformer
from specpilot.runtime.hybrid_tree import tree_state_bytes
from specpilot.runtime.tree import Tree, ancestor_mask

CONTEXT = 512


def hybrid_shape(base: str, smoke: bool) -> dict:
    """A Qwen3-Next-family config.json at `base`'s widths, three of every four layers Gated DeltaNet."""
    c = shapes.config(shapes.TINY if smoke else base)
    layers = 4 if smoke else c["num_hidden_layers"]
    heads = {"linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
             "linear_value_head_dim": 16} if smoke else {"linear_num_key_heads": 16, "linear_num_value_heads": 32,
                                                         "linear_key_head_dim": 128, "linear_value_head_dim": 128}
    return {
        "model_type": "qwen3_next", "vocab_size": c["vocab_size"], "hidden_size": c["hidden_size"],
        "intermediate_size": c["intermediate_size"], "num_hidden_layers": layers,
        "num_attention_heads": c["num_attention_heads"], "num_key_value_heads": c["num_key_value_heads"],
        "head_dim": c.get("head_dim", c["hidden_size"] // c["num_attention_heads"]), "rope_theta": 5e5,
        "partial_rotary_factor": 0.25, "rms_norm_eps": 1e-6, "max_position_embeddings": 8192,
        "full_attention_interval": 4, "linear_conv_kernel_dim": 4, "tie_word_embeddings": False, **heads,
    }


def build(config: dict, device: torch.device, dtype: torch.dtype) -> HybridTransformer:
    cfg = HybridConfig.from_hf(config, "hybrid shape")
    with torch.device("meta"):
        model = HybridTransformer(cfg)
    model.to(dtype=dtype).to_empty(device=device)
    g = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.fill_(0.0)
            elif name.endswith(("dt_bias", "norm.weight")):
                p.fill_(1.0 if name.endswith("dt_bias") else 0.0)
            else:
                p.normal_(0.0, 0.02, generator=g)
    return model.eval().requires_grad_(False)


def best_first_shape(n: int, depth: int, device: torch.device) -> Tree:
    """A tree shaped as best-first trees come out: a spine `depth` deep, the rest second and third
    choices hanging along it (each node's parent the node n // 3 before it)."""
    parent, levels = [-1], [0]
    for i in range(1, n + 1):
        p = i - 1 if i <= depth else max(0, (i - depth) % depth)
        parent.append(p)
        levels.append(levels[p] + 1)
    return Tree.from_lists(parent, levels, [1] * (n + 1), device=device)


def time_step(fn, repeats: int, graphs: bool, restore=None) -> tuple[harness.Timing, bool]:
    """fn timed as CUDA-graph replays where it captures, else eagerly (and said so). A failed capture
    may leave fn's forward half done on the cache: `restore` puts the cache back before the eager run."""
    if graphs:
        try:
            return harness.time_graph(fn, repeats=repeats), True
        except RuntimeError as e:  # a host read inside: time it eagerly, and say so
            print(f"  (not capturable: {str(e).splitlines()[0][:100]}; eager)")
            if restore is not None:
                restore()
    return harness.time_events(fn, repeats=repeats), False


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", default=shapes.LLAMA_8B, help="the widths the hybrid takes (a known model)")
    ap.add_argument("--budgets", default="16,32,64", help="tree nodes (besides the anchor)")
    ap.add_argument("--chains", default="16", help="chain verify lengths q")
    ap.add_argument("--depth", type=int, default=15, help="the trees' spine (a DFlash block of 16)")
    ap.add_argument("--repeats", type=int, default=30)
    args = harness.add_results_args(ap).parse_args(argv)
    why = harness.refuse_device("bench.steps.hybrid_tree_steps", args.smoke)
    if why:
        print(why)
        return 2
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    config = hybrid_shape(args.base, args.smoke)
    model = build(config, device, dtype)
    cfg = model.cfg
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    bandwidth = harness.read_bandwidth(device) if device.type == "cuda" else None  # bytes/s
    floor_ms = weight_bytes / bandwidth * 1e3 if bandwidth else None
    graphs = device.type == "cuda"
    budgets = [int(b) for b in args.budgets.split(",")]
    chains = [int(q) for q in args.chains.split(",")]
    context = 16 if args.smoke else CONTEXT
    rows = []

    def record(what: str, timing: harness.Timing, graphed: bool, **extra) -> None:
        rows.append({"what": what, **timing.row(), "cuda_graphs": graphed, "weight_floor_ms": floor_ms, **extra})
        print(f"{what:<18} {timing.median_ms:8.3f} ms (p20 {timing.p20_ms:.3f}, p80 {timing.p80_ms:.3f})"
              + (f"  floor {floor_ms:.3f}" if floor_ms else "") + ("  graph" if graphed else "  eager"), flush=True)

    with torch.inference_mode():
        cache = model.new_cache(1, context + 2 * max(budgets + chains) + 8)
        prefix = torch.ones(1, context, dtype=torch.long, device=device)
        model(prefix, cache)
        start = cache.length

        def restore() -> None:  # the prefix again, from an empty cache
            cache.reset()
            model(prefix, cache)

        def forward(ids, **kw):
            def fn():
                model(ids, cache, **kw)
                cache.rollback(start)
            return fn

        one = torch.ones(1, 1, dtype=torch.long, device=device)
        record("ar", *time_step(forward(one), args.repeats, graphs, restore), q=1)
        for q in chains:
            ids = torch.ones(1, q, dtype=torch.long, device=device)
            for kind in ("triton", "torch"):  # a chain verify runs the same WY rule (a tree of one path)
                install_gdn_tree(model, kind)
                record(f"chain-{q}-{'kernel' if kind == 'triton' else 'torch'}",
                       *time_step(forward(ids), args.repeats, graphs, restore), q=q)
        for n in budgets:
            tree = best_first_shape(n, min(args.depth, n), device)
            anc = ancestor_mask(tree)
            positions = (start + tree.depth)[None]
            ours, snapshots = tree_state_bytes(nodes=n + 1, v_heads=cfg.linear_num_value_heads,
                                               k_heads=cfg.linear_num_key_heads, dk=cfg.linear_key_head_dim,
                                               dv=cfg.linear_value_head_dim, kernel=cfg.linear_conv_kernel_dim,
                                               linear_layers=len(cfg.linear_layers), conv_bytes=torch.finfo(dtype).bits // 8)
            for kind in ("triton", "torch"):
                install_gdn_tree(model, kind)
                if device.type == "cuda":
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats()
                    base_mem = torch.cuda.memory_allocated()
                model(tree.token[None], cache, mask=anc, positions=positions)
                peak = torch.cuda.max_memory_allocated() - base_mem if device.type == "cuda" else None
                pending = cache.pending_bytes()
                cache.rollback(start)
                timing, graphed = time_step(forward(tree.token[None], mask=anc, positions=positions), args.repeats,
                                            graphs, restore)
                record(f"tree-{n}-{'kernel' if kind == 'triton' else 'torch'}", timing, graphed, q=n + 1,
                       pending_bytes=pending, pending_bytes_formula=ours, snapshot_bytes=snapshots,
                       forward_peak_bytes=peak)
            path = torch.nonzero(anc[min(args.depth, n)]).flatten().tolist()

            def commit():
                model(tree.token[None], cache, mask=anc, positions=positions)
                cache.commit_path(start, path)
                cache.kv.rollback(start)  # the next repeat verifies from the same slots

            verify_only = harness.time_events(forward(tree.token[None], mask=anc, positions=positions),
                                              repeats=args.repeats)
            both = harness.time_events(commit, repeats=args.repeats)
            record(f"commit-{n}", harness.Timing.of([max(0.0, both.median_ms - verify_only.median_ms)], both.how),
                   False, q=n + 1, path_nodes=len(path), note="eager verify+commit minus eager verify")
    out = harness.write_run(
        args, "hybrid_tree_steps", device, rows, shape=config, weight_bytes=weight_bytes,
        read_bandwidth_gbs=bandwidth / 1e9 if bandwidth else None, context=context,
        what="hybrid (3 of 4 layers Gated DeltaNet) step times at Llama-3.1-8B widths: AR, chain verify, tree verify "
             "on the gdn_tree kernel and on its torch reference, the accepted path's commit",
        timing="CUDA graphs of the eager forward, CUDA events, median of --repeats after warm-up")
    print(f"wrote {out}" if out else "smoke run: nothing written")
    return 0


if __name__ == "__main__":
    sys.exit(main())

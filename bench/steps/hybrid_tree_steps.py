"""Hybrid tree-verify step times at an 8B-class hybrid shape, against its chain verify and its AR step.

The shape: Llama-3.1-8B widths (hidden 4096, MLP 14336, 32 layers, 32 query / 8 KV heads of 128,
vocabulary 128256) as a Qwen3-Next-family hybrid whose layers are three of every four Gated DeltaNet
(16 key heads, 32 value heads, dk = dv = 128, conv kernel 4; Qwen3-Next's mixer widths) and every
fourth gated full attention. Random N(0, 0.02) bf16 weights, a 512-token context prefilled.

Steps, each the runtime's HybridTransformer forward and the rollback to its start on a device-length
cache (as the graphed loops run them: eager modules, captured in one CUDA graph):
  ar               one token;
  chain-q-kernel   a causal verify of q tokens, its Gated DeltaNet layers in WY form on
                   kernels/gdn_tree.py (a chain is a tree of one path); chain-q-torch on the reference;
  chain-q-tree     the same q tokens as graph_decode verifies a hybrid target's chain: a tree of one
                   path, then commit_path (the kernel);
  tree-n-kernel    a best-first-shaped tree of n nodes plus the anchor under its ancestor mask, the
                   Gated DeltaNet layers on kernels/gdn_tree.py; tree-n-torch the same on the torch
                   reference (a triangular solve);
  commit-n         HybridCache.commit_path alone, the spine accepted: the linear layers' state and conv
                   inputs and the attention KV of the path, by device indices (graphed too).
Beside each: the weight-read floor (weight bytes / measured read bandwidth), the torch ops one step
dispatches (what a graph replays kernel by kernel; views included) and, for trees, what the step
keeps until its commit against per-node state snapshots (hybrid_tree.tree_state_bytes) and the peak
memory the forward allocates. A row that does not capture runs eagerly for about --row-seconds.
Writes bench/results/hybrid_tree_steps_<gpu>[_<tag>].json after every row ("complete" false until
the last), and prints each row with the seconds since the start.

    python -m bench.steps.hybrid_tree_steps [--budgets 16,32,64] [--chains 16] [--repeats 30] [--row-seconds 4] [--out F|DIR]
    python -m bench.steps.hybrid_tree_steps --smoke --out DIR     # tiny shape on the CPU (interpreter)
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from bench import shapes
from specpilot.backends.kernel_hooks import install_gdn_tree
from specpilot.bench import harness
from specpilot.hf.config import HybridConfig
from specpilot.runtime.hybrid import HybridTransformer
from specpilot.runtime.hybrid_tree import tree_state_bytes
from specpilot.runtime.tree import Tree, ancestor_mask

CONTEXT = 512


def hybrid_shape(base: str, smoke: bool, layers: int | None = None) -> dict:
    """A Qwen3-Next-family config.json at `base`'s widths, three of every four layers Gated DeltaNet
    (`layers` of them; default `base`'s count, 4 for a smoke run)."""
    c = shapes.config(shapes.TINY if smoke else base)
    layers = layers or (4 if smoke else c["num_hidden_layers"])
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


class _OpCount(TorchDispatchMode):
    """Counts the torch ops a call dispatches: what a CUDA graph of it replays one kernel at a time,
    views included (they launch nothing), so an upper bound."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


def count_ops(fn) -> int:
    with _OpCount() as c:
        fn()
    return c.ops


def _wall_ms(fn, device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", default=shapes.LLAMA_8B, help="the widths the hybrid takes (a known model)")
    ap.add_argument("--budgets", default="16,32,64", help="tree nodes (besides the anchor)")
    ap.add_argument("--chains", default="16", help="chain verify lengths q")
    ap.add_argument("--depth", type=int, default=15, help="the trees' spine (a DFlash block of 16)")
    ap.add_argument("--repeats", type=int, default=30, help="timed repeats a row (graph replays; eager rows "
                    "take fewer where --row-seconds says)")
    ap.add_argument("--layers", type=int, help="decoder layers (default: the base model's; 4 with --smoke, where 32 "
                    "counts the torch ops of an 8B-class step at tiny widths)")
    ap.add_argument("--row-seconds", type=float, default=4.0, help="an eager row's timed calls stop at about this")
    args = harness.add_results_args(ap).parse_args(argv)
    why = harness.refuse_device("bench.steps.hybrid_tree_steps", args.smoke)
    if why:
        print(why)
        return 2
    began = time.perf_counter()

    def say(msg: str) -> None:
        print(f"[{time.perf_counter() - began:6.1f} s] {msg}", flush=True)

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    config = hybrid_shape(args.base, args.smoke, args.layers)
    model = build(config, device, dtype)
    cfg = model.cfg
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    bandwidth = harness.read_bandwidth(device) if device.type == "cuda" else None  # bytes/s
    floor_ms = weight_bytes / bandwidth * 1e3 if bandwidth else None
    graphs = device.type == "cuda"
    budgets = [int(b) for b in args.budgets.split(",")]
    chains = [int(q) for q in args.chains.split(",")]
    context = 16 if args.smoke else CONTEXT
    planned = 1 + 3 * len(chains) + 3 * len(budgets)
    say(f"built {weight_bytes / 1e9:.2f} GB of weights on {device}; {planned} rows to time")
    rows: list[dict] = []
    summary = dict(shape=config, weight_bytes=weight_bytes, read_bandwidth_gbs=bandwidth / 1e9 if bandwidth else None,
                   context=context, rows_planned=planned,
                   what="hybrid (3 of 4 layers Gated DeltaNet) step times at Llama-3.1-8B widths: AR, chain verify, "
                        "tree verify on the gdn_tree kernel and on its torch reference, the accepted path's commit",
                   timing="CUDA graphs of the eager forward on a device-length cache, CUDA events, median of "
                          "--repeats after warm-up; rows that do not capture run eagerly for about --row-seconds")

    def record(what: str, timing: harness.Timing, graphed: bool, **extra) -> None:
        # path "hybrid": the cost model reads attention targets' step records only (cost.model.parse_records)
        rows.append({"what": what, "path": "hybrid", **timing.row(), "cuda_graphs": graphed,
                     "weight_floor_ms": floor_ms, **extra})
        say(f"{what:<18} {timing.median_ms:8.3f} ms (p20 {timing.p20_ms:.3f}, p80 {timing.p80_ms:.3f}, "
            f"{timing.repeats} repeats)" + (f"  floor {floor_ms:.3f}" if floor_ms else "")
            + ("  graph" if graphed else "  eager") + f"  {extra.get('torch_ops', '?')} torch ops")
        # after every row, so that a run cut by its time limit keeps what it measured
        out = harness.write_run(args, "hybrid_tree_steps", device, rows, **summary, complete=len(rows) == planned)
        if out and len(rows) == 1:
            say(f"writing {out} after every row")

    with torch.inference_mode():
        # a device-length cache, as the graphed loops run: lengths, rollbacks and commits take device values
        cache = model.new_cache(1, context + 2 * max(budgets + chains) + 8, device_length=True)
        prefix = torch.ones(1, context, dtype=torch.long, device=device)
        model(prefix, cache)
        start = cache.length.clone()

        def restore() -> None:  # the prefix again, from an emptied cache (a failed capture may leave it ahead)
            cache.reset()
            model(prefix, cache)

        def forward(ids, **kw):
            def fn():
                model(ids, cache, **kw)
                cache.rollback(start)
            return fn

        def timed(fn, what: str) -> tuple[harness.Timing, bool]:
            """fn as CUDA-graph replays where it captures, else eagerly for about --row-seconds (and said so)."""
            say(f"{what}: {'capturing' if graphs else 'running'}")
            if graphs:
                try:
                    return harness.time_graph(fn, repeats=args.repeats), True
                except RuntimeError as e:  # a host read or copy inside: time it eagerly, and say so
                    say(f"  (not capturable: {str(e).splitlines()[0][:100]}; eager)")
                    restore()
            first = _wall_ms(fn, device)
            repeats = max(3, min(args.repeats, int(args.row_seconds * 1e3 / max(first, 1e-3))))
            return harness.time_events(fn, repeats=repeats, warmup=1), False

        one = torch.ones(1, 1, dtype=torch.long, device=device)
        record("ar", *timed(forward(one), "ar"), q=1, torch_ops=count_ops(forward(one)))
        for q in chains:
            ids = torch.ones(1, q, dtype=torch.long, device=device)
            for kind in ("triton", "torch"):  # a chain verify runs the tree form over a chain (a tree of one path)
                install_gdn_tree(model, kind)
                what = f"chain-{q}-{'kernel' if kind == 'triton' else 'torch'}"
                record(what, *timed(forward(ids), what), q=q, torch_ops=count_ops(forward(ids)))
            # as graph_decode verifies a hybrid target's chain: a tree of one path, then its commit
            chain_mask = torch.ones(q, q, dtype=torch.bool, device=device).tril()
            chain_positions = (start + torch.arange(q, device=device))[None]
            chain_path, chain_last = torch.arange(q, device=device), torch.full((), q - 1, dtype=torch.long, device=device)

            def as_tree():  # the state stays committed past the chain; only the length goes back
                model(ids, cache, mask=chain_mask, positions=chain_positions)
                cache.commit_path(start, chain_path, chain_last)
                cache.rollback(start)

            install_gdn_tree(model, "triton")
            record(f"chain-{q}-tree", *timed(as_tree, f"chain-{q}-tree"), q=q, torch_ops=count_ops(as_tree),
                   note="kernel; the chain as a tree of one path and commit_path of all q (graph_decode's hybrid "
                        "chain step) against chain-q-kernel's causal forward and rollback")
            restore()
        for n in budgets:
            tree = best_first_shape(n, min(args.depth, n), device)
            anc = ancestor_mask(tree)
            positions = (start + tree.depth)[None]
            ours, snapshots = tree_state_bytes(nodes=n + 1, v_heads=cfg.linear_num_value_heads,
                                               k_heads=cfg.linear_num_key_heads, dk=cfg.linear_key_head_dim,
                                               dv=cfg.linear_value_head_dim, kernel=cfg.linear_conv_kernel_dim,
                                               linear_layers=len(cfg.linear_layers), conv_bytes=torch.finfo(dtype).bits // 8)
            verify = forward(tree.token[None], mask=anc, positions=positions)
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
                what = f"tree-{n}-{'kernel' if kind == 'triton' else 'torch'}"
                record(what, *timed(verify, what), q=n + 1, pending_bytes=pending, pending_bytes_formula=ours,
                       snapshot_bytes=snapshots, forward_peak_bytes=peak, torch_ops=count_ops(verify))
            # the commit alone: the accepted spine's state and KV, by device indices, from one verify's vectors
            spine = torch.nonzero(anc[min(args.depth, n)]).flatten()
            path, accepted = spine.to(device), torch.full((), spine.numel() - 1, dtype=torch.long, device=device)
            model(tree.token[None], cache, mask=anc, positions=positions)
            kept = list(cache.tree_pending)  # the verify's per-node vectors, which commit_path consumes

            def commit():  # repeated on the same vectors: the state moves each time, the work is the same
                cache.tree_pending = list(kept)
                cache.commit_path(start, path, accepted)

            ops = count_ops(commit)
            record(f"commit-{n}", *timed(commit, f"commit-{n}"), q=n + 1, path_nodes=spine.numel(), torch_ops=ops,
                   note="commit_path alone (state, conv inputs and attention KV of the accepted path)")
            restore()
    out = harness.write_run(args, "hybrid_tree_steps", device, rows, **summary, complete=len(rows) == planned)
    say(f"wrote {out}" if out else "smoke run: nothing written")
    return 0


if __name__ == "__main__":
    sys.exit(main())

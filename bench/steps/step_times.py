"""Step times of the runtime at 8B shapes on a GPU, beside the weight-read floor.

    python -m bench.steps.step_times [--shapes llama-3.1-8b qwen3-8b] [--out FILE|DIR] [--tag TAG]

Random bf16 weights N(0, 0.02) (never zeros), batch 1, a 512-token context. Each step is captured
once in a CUDA graph and replayed; times are CUDA events around single replays after warm-up,
median of the repeats. Paths of the same model:

  torch   the reference stack (plain torch ops, SDPA) over a host-length cache sized to the step;
  fused   what the fused-decoder, attention-split-kv and cuda-graphs passes build: fused kernels
          (runtime/fused.py), split-KV attention, a device-length cache of 2048 slots (one graph
          serves every length);
  fused-cublas  the fused path with fused_linear off (cuBLAS GEMMs, separate RMSNorm, SiLU·mul and
          residual-add kernels), AR and verify(4) only: what fused_linear replaces;
  fused-rope-apart  the fused AR and verify(16) steps with rope_qkv and the split-KV attention as
          two launches a layer (what kernels/rope_attention.py does in one);
  fused-pdl, fused-pdl-wait, fused-prefetch, fused-pdl-prefetch  the fused AR step's layers with
          programmatic dependent launch (mode 1: trigger then wait; mode 2: wait only) and/or the L2
          prefetch of o_proj (kernels/overlap.py's Launch through FusedOps; off by default);
  fused+u12  the fused path with every linear and lm_head in the u12 format (weights-u12 pass),
          AR (u12_fused_linear's epilogues, the norms as rmsnorm kernels) and verify(16) only;
          fused+u12-unfused: the AR step with u12_linear beside the separate norm, SiLU·mul and add
          kernels; fused+u12-prologue: with u12_fused_linear's norm prologue too.

Steps: AR q=1; chain verify q=4..64; tree verify of k-ary trees (top-4) with 16..128 nodes plus
the anchor; the DFlash-style drafter step (5 layers, block 16), also with its head over DRAFT_VOCAB
token ids (path fused-vocab: the draft-vocab pass). The floor is the bytes of weights
the step reads / the read bandwidth measured in the same run. One eager fused AR step is also
profiled (kernels by GPU time). Writes bench/results/step_times_<gpu>_<tag>.json through the
harness (the tag: the shapes' families, "llama", "qwen", "llama-qwen", unless --tag names one) and
a table last. bench/steps/step_ab.py builds its steps from this module's SHAPES, DEVICE,
CACHE_LEN, CAPACITY, graphed, time_fn, random_, to_u12 and tile_u12.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
from contextlib import nullcontext

import torch

from bench import shapes
from specpilot.bench import harness
from specpilot.kernels.overlap import Launch
from specpilot.hf.config import DrafterConfig, ModelConfig
from specpilot.hf.known import DFLASH_BLOCK, DFLASH_LAYERS
from specpilot.runtime.dflash import DFlashDrafter
from specpilot.runtime.draft_vocab import SubsetHead
from specpilot.backends.kernel_hooks import fused_path, with_launch
from specpilot.runtime.model import Transformer

SHAPES = {name: shapes.config(name) for name in (shapes.LLAMA_8B, shapes.QWEN3_8B, shapes.TINY)}
FAMILY_TAGS = {shapes.LLAMA_8B: "llama", shapes.QWEN3_8B: "qwen", shapes.TINY: "tiny"}  # results names' tags
DEVICE = "cuda"
VERIFY_Q = (4, 8, 16, 32, 64)
TREE_BUDGETS = (15, 16, 31, 32, 64, 128)  # 31: q = 32, the most rows the fused linears serve
CACHE_LEN = 512
CAPACITY = 2048  # the fused path's device-length cache
DRAFT_LAYERS, DRAFT_BLOCK, DRAFT_NEW_CONTEXT = DFLASH_LAYERS, DFLASH_BLOCK, 4  # the DFlash recipe (hf.known)
DRAFT_VOCAB = 32768  # the draft-vocab pass's subset at 8B shapes (FR-Spec's 32k of Llama-3's 128k)


def time_fn(fn, repeats: int) -> list[float]:
    """Seconds of each of `repeats` calls: CUDA events after three warm-up calls on the GPU; one
    wall-clock run a repeat, no warm-up, under --smoke (a correctness run, not a measurement)."""
    cuda = DEVICE == "cuda"
    return [ms / 1e3 for ms in harness.event_samples(fn, repeats, warmup=3 if cuda else 0, cuda=cuda)]


def graphed(step):
    """`step` captured in a CUDA graph (after warm-up on a side stream): the replay function; under
    --smoke, a function running it."""
    return harness.capture(step, cuda=DEVICE == "cuda")


def random_(module: torch.nn.Module) -> None:
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0.0, 0.02)


def weight_bytes(module: torch.nn.Module, skip: tuple[str, ...] = ()) -> int:
    return sum(p.numel() * p.element_size() for n, p in module.named_parameters() if not n.startswith(skip))


def tree_mask(nodes: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(ancestor mask [n+1, n+1], depths [n+1]) of a k-ary top-4 tree of `nodes` nodes + anchor."""
    from specpilot.runtime.tree import ancestor_mask, kary_tree

    g = torch.Generator().manual_seed(nodes)
    logp = torch.rand(DRAFT_BLOCK - 1, 4, generator=g).log().sort(-1, descending=True).values
    ids = torch.randint(0, 1000, (DRAFT_BLOCK - 1, 4), generator=g)
    tree = kary_tree(logp, ids, 0, budget=nodes)
    return ancestor_mask(tree).to(device), tree.depth.to(device)


def profile_step(step, top: int = 12) -> dict:
    """Kernels of one eager step by GPU time: how much is GEMM, how much everything else."""
    if DEVICE == "cpu":
        return {}
    from torch.profiler import ProfilerActivity, profile

    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    rows = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
    total = sum(e.device_time_total for e in rows)
    rows.sort(key=lambda e: -e.device_time_total)
    return dict(kernels=sum(e.count for e in rows), gpu_us=total,
                top=[dict(name=e.key[:90], count=e.count, us=e.device_time_total) for e in rows[:top]])


def to_u12(model: Transformer) -> int:
    """Every projection and lm_head of `model` as the weights-u12 pass builds them (the fused u12
    kernel, its default configs); returns the packed bytes. The next fused_path installs the fused
    decoder over the u12 modules (it keeps a stack only while the modules it was built over stay)."""
    from specpilot.backends.torch_backend import U12Linear
    from specpilot.runtime.model import swap_projection
    from specpilot.formats.u12 import pack_u12

    total = 0
    for name, linear in model.linear_modules().items():
        packed = pack_u12(linear.weight.detach().contiguous())
        swap_projection(model, name, U12Linear(packed, "triton-u12"))
        total += packed.nbytes
    return total


def tile_u12(model: Transformer) -> None:
    """Every u12 projection of `model` (``to_u12``'s) with its weight tiled where the shape allows
    (U12Tensor.layout "tiles": what weights-u12{layout=auto} packs for a target that verifies
    blocks); the next fused_path installs the fused decoder over them."""
    from specpilot.backends.torch_backend import U12Linear
    from specpilot.runtime.model import swap_projection
    from specpilot.formats.u12 import tiles_fit

    for name, module in model.linear_modules().items():
        if tiles_fit(module.packed.shape):
            swap_projection(model, name, U12Linear(module.packed.with_layout("tiles"), module.kernel))


@torch.inference_mode()
def bench_shape(name: str, bw: float, repeats: int, with_u12: bool = True) -> tuple[list[dict], dict]:
    cfg = ModelConfig.from_hf(SHAPES[name], name)
    torch.manual_seed(0)
    with torch.device(DEVICE):
        model = Transformer(cfg).to(torch.bfloat16)
    random_(model)

    # per step: every linear and lm_head; the embedding contributes q rows only
    step_bytes = weight_bytes(model, skip=("model.embed_tokens",))
    floor_ms = step_bytes / bw * 1e3
    rows = []

    eager: dict[tuple, torch.Tensor] = {}

    def record(path, what, q, fn, **extra):
        logits = fn().logits.float()  # eager, same inputs, a zero context: the paths must agree
        if path == "torch":
            eager[what, q] = logits
        else:
            ref = eager[what, q]
            extra.update(max_abs_diff_vs_torch=(logits - ref).abs().max().item(),
                         argmax_agree=(logits.argmax(-1) == ref.argmax(-1)).float().mean().item())
        t = statistics.median(time_fn(graphed(fn), repeats))
        rows.append(dict(shape=name, path=path, what=what, q=q, cache_len=CACHE_LEN, ms=t * 1e3,
                         weight_bytes=step_bytes, floor_ms=floor_ms, **extra))

    g = torch.Generator().manual_seed(1)
    inputs = {q: torch.randint(0, cfg.vocab_size, (1, q), generator=g).to(DEVICE)
              for q in (1,) + VERIFY_Q + tuple(n + 1 for n in TREE_BUDGETS)}  # the same tokens on both paths
    for path in ("torch", "fused"):
        with fused_path(model) if path == "fused" else nullcontext():
            cache = model.new_cache(1, CAPACITY if path == "fused" else CACHE_LEN + 160, device_length=path == "fused")
            if path == "fused":
                start = torch.tensor(CACHE_LEN, device=DEVICE)
                at_context = lambda: cache.length.copy_(start)  # noqa: E731  (inside the graph: no host value)
            else:
                at_context = lambda: setattr(cache, "length", CACHE_LEN)  # noqa: E731
            for q in (1,) + VERIFY_Q:
                ids = inputs[q]

                def step(ids=ids):
                    at_context()
                    return model(ids, cache)

                record(path, "ar" if q == 1 else "verify", q, step)
            for nodes in TREE_BUDGETS:
                mask, depth = tree_mask(nodes, DEVICE)
                ids = inputs[nodes + 1]
                positions = (depth + CACHE_LEN)[None]

                def tree_step(ids=ids, mask=mask, positions=positions):
                    at_context()
                    return model(ids, cache, mask=mask, positions=positions)

                record(path, "tree-verify", nodes + 1, tree_step, budget=nodes)
            if path == "fused":
                profile = {"ar": profile_step(lambda: (at_context(), model(inputs[1], cache)))}
                # the same steps with fused_linear off: cuBLAS GEMMs beside separate norm, SiLU·mul
                # and add kernels (what fused_linear replaces at the rows FusedOps.linear_serves takes)
                ops = model.fused.ops
                model.fused.ops = dataclasses.replace(ops, linear_max_m=0)
                try:
                    for q in (1, 4):
                        record("fused-cublas", "ar" if q == 1 else "verify", q,
                               lambda ids=inputs[q]: (at_context(), model(ids, cache))[1])
                    profile["ar-cublas"] = profile_step(lambda: (at_context(), model(inputs[1], cache)))
                finally:
                    model.fused.ops = ops
                model.fused.ops = dataclasses.replace(ops, rope_attention=None)
                try:
                    for q in (1, 16 if 16 in VERIFY_Q else VERIFY_Q[0]):  # (--smoke has no q = 16)
                        record("fused-rope-apart", "ar" if q == 1 else "verify", q,
                               lambda ids=inputs[q]: (at_context(), model(ids, cache))[1])
                finally:
                    model.fused.ops = ops
                # the AR step's layers with programmatic dependent launch (modes 1, 2) and the L2 prefetch
                # of o_proj, each off by default (kernels/overlap.py's Launch; the lm_head runs plain)
                for label, launch in (("fused-pdl", Launch(pdl=1)), ("fused-pdl-wait", Launch(pdl=2)),
                                      ("fused-prefetch", Launch(prefetch=True)),
                                      ("fused-pdl-prefetch", Launch(pdl=1, prefetch=True))):
                    model.fused.ops = with_launch(ops, launch)
                    try:
                        record(label, "ar", 1, lambda ids=inputs[1]: (at_context(), model(ids, cache))[1])
                    finally:
                        model.fused.ops = ops
                # chain verify of q beside a tree of q nodes + anchor: what the tree mask costs
                q, nodes = (16, 16) if 16 in VERIFY_Q and 16 in TREE_BUDGETS else (VERIFY_Q[0], TREE_BUDGETS[0])
                mask, depth = tree_mask(nodes, DEVICE)
                profile[f"verify-{q}"] = profile_step(lambda: (at_context(), model(inputs[q], cache)))
                profile[f"tree-verify-{nodes + 1}"] = profile_step(
                    lambda: (at_context(), model(inputs[nodes + 1], cache, mask=mask, positions=(depth + CACHE_LEN)[None])))

    # the DFlash recipe's drafter (hf.known.dflash_config's layers and reads), its layers in the
    # target's family as in every committed run
    dflash = {**SHAPES[name], "num_hidden_layers": DRAFT_LAYERS, "block_size": DRAFT_BLOCK,
              "mask_token_id": cfg.vocab_size - 1,
              "target_layer_ids": [1, cfg.num_layers // 4, cfg.num_layers // 2, 3 * cfg.num_layers // 4, cfg.num_layers - 1]}
    dcfg = DrafterConfig.from_hf(dflash, name + "-dflash")
    with torch.device(DEVICE):
        drafter = DFlashDrafter(dcfg, model.embed, model.head).to(torch.bfloat16)
    random_(drafter)
    block = torch.full((1, DRAFT_BLOCK), dcfg.mask_token_id, device=DEVICE)
    ctx = torch.randn(1, DRAFT_NEW_CONTEXT, len(dcfg.target_layer_ids) * cfg.hidden_size, device=DEVICE,
                      dtype=torch.bfloat16)
    d_bytes = weight_bytes(drafter) + model.lm_head.weight.numel() * 2  # its layers + the shared lm_head
    for path in ("torch", "fused"):
        with fused_path(model, drafter) if path == "fused" else nullcontext():  # the drafter's split-KV attention too
            dcache = drafter.new_cache(1, CAPACITY if path == "fused" else CACHE_LEN + 128, device_length=path == "fused")
            start = torch.tensor(CACHE_LEN, device=DEVICE)

            def draft_step(dcache=dcache, path=path):
                if path == "fused":
                    dcache.length.copy_(start)
                else:
                    dcache.length = CACHE_LEN
                return drafter(block, ctx, dcache)

            t = statistics.median(time_fn(graphed(draft_step), repeats))
            rows.append(dict(shape=name, path=path, what="draft", q=DRAFT_BLOCK, cache_len=CACHE_LEN, ms=t * 1e3,
                             weight_bytes=d_bytes, floor_ms=d_bytes / bw * 1e3, drafter_layers=DRAFT_LAYERS))
            if path == "fused":
                profile["draft"] = profile_step(draft_step)
                # the draft-vocab pass: the head over DRAFT_VOCAB ids (which ones does not move the time)
                full_head = drafter.head
                draft_vocab = min(DRAFT_VOCAB, cfg.vocab_size // 2)  # (--smoke's tiny vocab: half of it)
                sub_head = SubsetHead(model.lm_head.weight, torch.arange(draft_vocab, device=DEVICE), cfg.vocab_size)
                drafter.set_head(sub_head)
                try:
                    sub_bytes = weight_bytes(drafter) + sub_head.weight.numel() * 2
                    t = statistics.median(time_fn(graphed(draft_step), repeats))
                    rows.append(dict(shape=name, path="fused-vocab", what="draft", q=DRAFT_BLOCK, cache_len=CACHE_LEN,
                                     ms=t * 1e3, weight_bytes=sub_bytes, floor_ms=sub_bytes / bw * 1e3,
                                     drafter_layers=DRAFT_LAYERS, draft_vocab=draft_vocab))
                    profile["draft-vocab"] = profile_step(draft_step)
                finally:
                    drafter.set_head(full_head)
    if with_u12:  # the weights-u12 pass over the fused stack: every linear and lm_head in u12
        u12_bytes = to_u12(model)
        with fused_path(model):
            cache = model.new_cache(1, CAPACITY, device_length=True)
            start = torch.tensor(CACHE_LEN, device=DEVICE)
            for q in (1, 16 if 16 in VERIFY_Q else VERIFY_Q[0]):
                def u12_step(ids=inputs[q]):
                    cache.length.copy_(start)
                    return model(ids, cache)

                record("fused+u12", "ar" if q == 1 else "verify", q, u12_step, u12_weight_bytes=u12_bytes)
            profile["ar-u12"] = profile_step(lambda: (cache.length.copy_(start), model(inputs[1], cache)))
            # the AR step with u12_linear beside the separate norm, SiLU·mul and add kernels, and with
            # u12_fused_linear's norm prologue too (the default: its epilogues, the norms apart;
            # runtime/fused.py's U12_LINEAR, U12_NORMS_APART)
            ops = model.fused.ops
            try:
                for label, fields in (("fused+u12-unfused", dict(u12_kernel="")),
                                      ("fused+u12-prologue", dict(u12_kernel="triton-u12", u12_norms_apart=False))):
                    model.fused.ops = dataclasses.replace(ops, **fields)
                    record(label, "ar", 1, lambda ids=inputs[1]: (cache.length.copy_(start), model(ids, cache))[1],
                           u12_weight_bytes=u12_bytes)
            finally:
                model.fused.ops = ops
        # verify with every weight tiled: the engine's weights for a target that verifies blocks
        # (weights-u12's layout=auto); one-row decoding keeps the row planes above
        tile_u12(model)
        with fused_path(model):
            q = 16 if 16 in VERIFY_Q else VERIFY_Q[0]
            record("fused+u12-tiles", "verify", q,
                   lambda ids=inputs[q]: (cache.length.copy_(start), model(ids, cache))[1], u12_weight_bytes=u12_bytes)
    model = drafter = None  # the 16 GB of this shape go before the next one is built
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
    return rows, profile


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="+", default=[shapes.LLAMA_8B, shapes.QWEN3_8B], choices=list(SHAPES))
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--no-u12", action="store_true", help="skip the fused+u12 rows (AR and verify(16) with every "
                    "linear in the 12-bit format)")
    args = harness.add_results_args(ap).parse_args(argv)
    global DEVICE, CACHE_LEN, CAPACITY, TREE_BUDGETS, VERIFY_Q
    if (reason := harness.refuse_device("bench.steps.step_times", args.smoke)) is not None:
        print(reason, file=sys.stderr)
        return 2
    if args.smoke:
        DEVICE, CACHE_LEN, CAPACITY, TREE_BUDGETS, VERIFY_Q = "cpu", 24, 96, (4,), (4,)
        args.shapes, args.repeats = [shapes.TINY], 1
    bw = harness.read_bandwidth() if DEVICE == "cuda" else 1e11
    rows, profiles = [], {}
    for shape in args.shapes:
        shape_rows, profiles[shape] = bench_shape(shape, bw, args.repeats, not args.no_u12)
        rows += shape_rows
    args.tag = args.tag or "-".join(FAMILY_TAGS[s] for s in args.shapes)
    out = harness.write_run(args, "step_times", DEVICE, rows, read_bandwidth_Bps=bw,
                            method="CUDA graph per step, CUDA events, median of repeats; random bf16 N(0,0.02) "
                                   "weights; batch 1",
                            profiles_fused=profiles)  # per shape: the fused steps' kernels
    print(f"{harness.device_name(DEVICE)}: read bandwidth {bw / 1e12:.2f} TB/s -> {out or 'no file (--smoke)'}")
    for shape, steps in profiles.items():
        for step, prof in steps.items():
            if prof:
                print(f"{shape} fused {step} step, eager: {prof['kernels']} kernels, {prof['gpu_us'] / 1e3:.3f} ms of GPU time; "
                      "top: " + ", ".join(f"{k['name'][:28]} {k['us']:.0f}us" for k in prof["top"][:5]))
    print(f"{'shape':14} {'path':9} {'step':11} {'q':>4} {'ms':>8} {'floor ms':>9} {'x floor':>8} argmax=torch")
    for r in rows:
        agree = f"{r['argmax_agree']:6.2f}" if "argmax_agree" in r else ""
        print(f"{r['shape']:14} {r['path']:9} {r['what']:11} {r['q']:>4} {r['ms']:8.3f} {r['floor_ms']:9.3f} "
              f"{r['ms'] / r['floor_ms']:8.2f} {agree}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""AR tokens/s of specpilot against HF transformers (eager, and static cache + torch.compile) on the same weights.

    python -m bench.steps.hf_peers [--shape llama-3.1-8b] [--prompt-len 128] [--max-new-tokens 128] [--repeats 2]
                                   [--out FILE|DIR] [--tag TAG]
    python -m bench.steps.hf_peers --smoke --out DIR   # tiny llama on the CPU, fp32: what the tests run

One HF `LlamaForCausalLM` built from a config (no hub), random weights N(0, 0.02) (never zeros; bf16 on
a GPU, fp32 on the CPU); our runtime's `Transformer` is loaded from its state dict with storage shared,
so every path reads the same tensors. Batch 1, one prompt of random tokens, greedy. Paths:

  hf-eager-generate   HF `generate`, default dynamic cache;
  hf-eager-forward    a plain loop of HF forwards over a DynamicCache (generate's own overhead left out);
  hf-static-compile   HF `generate(cache_implementation="static")`: HF compiles the decode forward itself
                      on a GPU (the first call, compile included, is timed apart as compile_s); on the CPU
                      HF does not compile, the row says so;
  specpilot-*         `AR_IMPLS` (our eager loop, the CUDA-graph loop, and on a GPU the fused one).

Times exclude prefill (DESIGN.md): each path is timed from the moment its first output token (the
prefill's) is on the host to the end, with the device synchronised; HF paths are timed through a
streamer whose put() marks each step (their prefill_ms includes generate's own setup).
ms_per_token = decode time / (new tokens - 1), the first token being the prefill's. Every path runs
once as warm-up (full length where a cache, a compile or graphs are sized by the call; 8 tokens for
the eager HF loops), then `--repeats` timed runs; medians are kept.
Agreement is the common prefix with specpilot-eager's tokens (bf16 near-ties may flip a token late).
The weight-read floor is the bytes of all linears and lm_head over a read bandwidth measured in the run.
Writes bench/results/hf_peers_<gpu>[_<tag>].json through the harness; a table is printed last.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import traceback
from collections.abc import Callable

import torch
import transformers
from transformers import AutoModelForCausalLM, DynamicCache, LlamaConfig, LlamaForCausalLM

from bench import shapes
from bench.hf_timing import Run, common_prefix, hf_generate, sync
from specpilot.bench import harness
from specpilot.hf.config import ModelConfig
from specpilot.runtime import decode, graph_decode
from specpilot.runtime.model import Transformer
from specpilot.validate.forcing import check_prompt


def _llama(config: dict) -> dict:
    """`config` as a llama (HF's LlamaForCausalLM) without special tokens: generate never stops early."""
    return {k: v for k, v in config.items() if k not in ("bos_token_id", "eos_token_id")} | {"model_type": "llama"}


SHAPES = {shapes.LLAMA_8B: _llama(shapes.config(shapes.LLAMA_8B)), "smoke": _llama(shapes.config(shapes.TINY))}

# (target, prompt_ids, *, max_new_tokens, eos_token_id) -> decode.Generation
AR_IMPLS: dict[str, Callable[..., decode.Generation]] = {"specpilot-eager": decode.generate_ar}
AR_IMPLS["specpilot-graphed"] = graph_decode.generate_ar_graphed


def fused_graphed(target: Transformer, prompt_ids, **kw) -> decode.Generation:
    """The graphed loop over the fused decoder stack and split-KV attention (what the fused-decoder,
    attention-split-kv and cuda-graphs passes build), on the same weights."""
    from specpilot.backends.kernel_hooks import fused_path

    with fused_path(target):
        return graph_decode.generate_ar_graphed(target, prompt_ids, **kw)


if torch.cuda.is_available():  # Triton kernels: a GPU (the interpreter is too slow here)
    AR_IMPLS["specpilot-fused-graphed"] = fused_graphed


# --- the models -------------------------------------------------------------------------------


def build_models(shape: dict, device: torch.device, dtype: torch.dtype, seed: int) -> tuple[LlamaForCausalLM, Transformer]:
    """HF LlamaForCausalLM with random N(0, 0.02) weights, and our Transformer over the same tensors."""
    cfg = ModelConfig.from_hf(shape, "hf_peers")
    torch.manual_seed(seed)
    with torch.device(device):
        hf = AutoModelForCausalLM.from_config(LlamaConfig(**cfg.to_hf()), dtype=dtype)
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0.0, 0.02)
    hf.eval().requires_grad_(False)
    with torch.device("meta"):
        ours = Transformer(cfg)
    ours.load_state_dict(hf.state_dict(), strict=True, assign=True)  # HF's names are ours: storage is shared
    return hf, ours.eval().requires_grad_(False)


def hf_forward_loop(model: LlamaForCausalLM, prompt: torch.Tensor, max_new_tokens: int) -> Run:
    """HF forwards one token at a time over a DynamicCache, host-side argmax (as our eager loop)."""
    device = prompt.device
    with torch.no_grad():  # as HF's generate: no inference tensors near the model HF later compiles
        cache = DynamicCache(config=model.config)
        sync(device)
        t0 = time.perf_counter()
        token = model(prompt, past_key_values=cache, use_cache=True, logits_to_keep=1).logits[:, -1].argmax(-1, keepdim=True)
        tokens = token[0].tolist()
        t1 = time.perf_counter()
        while len(tokens) < max_new_tokens:
            token = model(token, past_key_values=cache, use_cache=True).logits[:, -1].argmax(-1, keepdim=True)
            tokens += token[0].tolist()
        sync(device)
        t2 = time.perf_counter()
    return Run(tokens=tokens, prefill_s=t1 - t0, decode_s=t2 - t1)


def specpilot_run(impl: Callable[..., decode.Generation]) -> Callable[..., Run]:
    def run(model: Transformer, prompt: torch.Tensor, max_new_tokens: int) -> Run:
        g = impl(model, prompt, max_new_tokens=max_new_tokens, eos_token_id=None)
        return Run(tokens=g.tokens, prefill_s=g.prefill_s, decode_s=g.decode_s)
    return run


def timed(name: str, run: Callable[[int], Run], n: int, warm_n: int, repeats: int) -> tuple[dict, list[int]]:
    """A warm-up of `warm_n` new tokens (timed apart: it holds any compile or graph capture), then
    `repeats` timed runs of `n`; medians."""
    t0 = time.perf_counter()
    run(warm_n)
    warm_s = time.perf_counter() - t0
    runs = [run(n) for _ in range(repeats)]
    per_token = statistics.median(r.decode_s / max(1, r.decode_tokens) for r in runs)
    row = {"impl": name, "ms_per_token": per_token * 1e3, "tokens_per_s": 1.0 / per_token if per_token else 0.0,
           "prefill_ms": statistics.median(r.prefill_s for r in runs) * 1e3, "first_call_s": warm_s,
           "new_tokens": len(runs[-1].tokens), "repeats": repeats,
           "warmup_new_tokens": warm_n, "stable_across_runs": all(r.tokens == runs[0].tokens for r in runs)}
    return row, runs[-1].tokens


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="llama-3.1-8b", choices=list(SHAPES))
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--device", default="auto", help="auto (cuda when available), cuda or cpu")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-compile", action="store_true", help="static cache without HF's auto-compile")
    args = harness.add_results_args(ap).parse_args(argv)  # --smoke: tiny llama, CPU, fp32, 16 + 12 tokens, 1 repeat
    if args.smoke:
        args.shape, args.device, args.prompt_len, args.max_new_tokens, args.repeats = "smoke", "cpu", 16, 12, 1
        torch.set_num_threads(1)  # tiny models on a shared CPU: more threads made decode loops far slower (tests/conftest.py)
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          "cpu" if args.device == "auto" else args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    transformers.logging.set_verbosity_error()

    started = time.perf_counter()
    hf, ours = build_models(SHAPES[args.shape], device, dtype, args.seed)
    vocab = ours.cfg.vocab_size
    prompt = torch.randint(0, vocab, (1, args.prompt_len), generator=torch.Generator().manual_seed(args.seed)).to(device)
    weight_bytes = sum(p.numel() * p.element_size() for n, p in ours.named_parameters()
                       if not n.startswith("model.embed_tokens"))  # a step reads q embedding rows only
    bw = harness.read_bandwidth(device, gib=4 if device.type == "cuda" else 0.0625)
    n = args.max_new_tokens

    # name -> (run(new tokens), warm-up tokens): the static cache (and HF's compile) and our graphs are
    # sized by the call, so those warm up at full length; the slow eager HF loops keep state in no cache
    paths: dict[str, tuple[Callable[[int], Run], int]] = {
        name: ((lambda m, run=specpilot_run(impl): run(ours, prompt, m)), n) for name, impl in AR_IMPLS.items()}
    paths["hf-eager-generate"] = (lambda m: hf_generate(hf, prompt, m), min(n, 8))
    paths["hf-eager-forward"] = (lambda m: hf_forward_loop(hf, prompt, m), min(n, 8))
    paths["hf-static-compile"] = (lambda m: hf_generate(hf, prompt, m, cache_implementation="static",
                                                        disable_compile=args.no_compile), n)
    rows, tokens = [], {}
    for name, (run, warm_n) in paths.items():
        try:
            row, tokens[name] = timed(name, run, n, warm_n, args.repeats)
        except Exception as e:  # one broken peer must not lose the others' numbers: recorded, run goes on
            traceback.print_exc()
            rows.append({"impl": name, "error": f"{type(e).__name__}: {e}"})
            continue
        if name == "hf-static-compile":
            compiled = hasattr(hf, "_compiled_call")  # set by HF's get_compiled_call
            row["compiled"] = compiled
            row["compile_s"] = row["first_call_s"] if compiled else None
            if compiled:
                row["compile_config"] = {k: str(v) for k, v in hf._last_compile_config.to_dict().items()}
            if not compiled:
                row["note"] = "not compiled (HF auto-compiles on a GPU only; --no-compile turns it off): static cache, eager forward"
        rows.append(row)
        print(f"{name:18} {row['ms_per_token']:9.3f} ms/token", flush=True)
    row_dtype = str(dtype).removeprefix("torch.")
    reference_name = "specpilot-eager" if "specpilot-eager" in tokens else next(iter(tokens))
    reference = tokens[reference_name]
    floor_ms = weight_bytes / bw * 1e3
    for row in rows:
        if "error" in row:
            continue
        row["agree_prefix"] = common_prefix(tokens[row["impl"]], reference)
        row["tokens_equal"] = tokens[row["impl"]] == reference
        row["x_floor"] = row["ms_per_token"] / floor_ms
        # random weights give near-flat logits, so paths that round differently part early: token
        # forcing (one teacher-forced pass of our eager model) tells near-ties from wrong tokens
        check = check_prompt(ours, ours.cfg, prompt[0].tolist(), tokens[row["impl"]], row_dtype)
        row["token_forcing"] = {"tokens": check.tokens_checked, "hard_failures": len(check.hard_failures),
                                "near_ties": len(check.near_ties)}

    out = harness.write_run(
        args, "hf_peers", device, rows, shape=args.shape, dtype=row_dtype,
        method="batch 1, greedy, random N(0,0.02) weights shared by HF and specpilot; decode only (prefill apart), "
               "ms_per_token = decode time / (new tokens - 1); warm-up run then median of repeats; "
               f"agree_prefix against {reference_name}; token_forcing of every path's tokens by our eager "
               "model (specpilot/validate/forcing.py: hard failures vs near-ties)",
        reference=reference_name, prompt_len=args.prompt_len, max_new_tokens=n, repeats=args.repeats,
        read_bandwidth_Bps=bw, weight_bytes=weight_bytes, floor_ms_per_token=floor_ms,
        floor_tokens_per_s=1e3 / floor_ms, wall_s=time.perf_counter() - started)
    print(f"\n{harness.device_name(device)} {args.shape} {dtype}: read bandwidth {bw / 1e9:.1f} GB/s, weight-read floor "
          f"{floor_ms:.3f} ms/token -> {out or 'no file (--smoke)'}")
    print(f"{'impl':18} {'ms/token':>9} {'tok/s':>8} {'x floor':>8} {'prefill ms':>10} {'compile s':>9} {'agree':>7} "
          "forced: hard/near-ties")
    for r in rows:
        if "error" in r:
            print(f"{r['impl']:18} failed: {r['error'][:90]}")
            continue
        compile_s = f"{r['compile_s']:.1f}" if r.get("compile_s") is not None else "-"
        print(f"{r['impl']:18} {r['ms_per_token']:9.3f} {r['tokens_per_s']:8.1f} {r['x_floor']:8.2f} "
              f"{r['prefill_ms']:10.2f} {compile_s:>9} {r['agree_prefix']:>3}/{r['new_tokens']:<3} "
              f"{r['token_forcing']['hard_failures']}/{r['token_forcing']['near_ties']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

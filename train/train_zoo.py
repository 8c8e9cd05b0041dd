"""Train the model zoo in one run: a Qwen3 code target, a DFlash drafter and a PARD drafter.

    python -m train.train_zoo --data .cache/zoo --out OUT            # GPU: the real run (~6 min)
    python -m train.train_zoo --data .cache/zoo --out OUT --smoke    # every phase for a few steps, CPU

`--data` holds what train/corpus.py and train/tokenizer.py wrote (corpus.jsonl.gz, heldout.jsonl.gz,
tokenizer.json, manifest.json). Phases, each bounded by its own seconds (and optionally steps):

  target   Qwen3ForCausalLM, next-token loss on random windows of the tokenized corpus;
  distill  the target's own greedy continuations of corpus snippets (our runtime, batched, bf16);
  dflash   a DFlash drafter on those continuations, conditioned on the frozen target's hidden
           states at `target_layer_ids`, every block of a sequence in one pass (train/drafters.py);
  pard     a PARD drafter (a 2-layer Qwen3 started from the target's embedding and first layers)
           filling k-1 mask tokens, every drafting step of a sequence in one pass;
  eval     τ of both drafters with specpilot's own decode loops on held-out prompts (code-heldout),
           and whether each output equals AR greedy.

Writes OUT/{target,dflash,pard}/ (config.json, model.safetensors in bf16, tokenizer.json,
MODEL_CARD.md) and OUT/train_log.json, which is rewritten after every phase. A drafter phase that
fails is logged and the run goes on with the next; the exit status is 1 if any phase failed.
"""

from __future__ import annotations

import argparse
import io
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import time
import traceback
from contextlib import nullcontext
from dataclasses import asdict, dataclass, replace
from pathlib import Path

if __package__ in (None, ""):  # run as a file (python train/train_zoo.py): make `train` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from tokenizers import Tokenizer

from specpilot.bench.prompts import load_prompts
from specpilot.runtime.config import DrafterConfig, ModelConfig
from specpilot.runtime.decode import generate_ar, generate_dflash, generate_pard
from specpilot.runtime.dflash import DFlashDrafter
from specpilot.runtime.load import load_drafter, load_target
from specpilot.runtime.model import Transformer
from train.corpus import CORPUS_FILE, HELDOUT_FILE, MANIFEST_FILE, read_docs, sha256_of_docs
from train.drafters import (
    accepted_prefix,
    dflash_block_labels,
    dflash_block_logits,
    dflash_loss_weights,
    pard_layout,
)
from train.model_card import write_cards
from train.tokenizer import EOS_TOKEN_ID, MASK_TOKEN_ID, TOKENIZER_FILE

ROPE_THETA = 10000.0
RMS_EPS = 1e-6
INIT_STD = 0.02


@dataclass(frozen=True)
class Shapes:
    """Model shapes and batch sizes of a run (FULL on the GPU, SMOKE on a CPU)."""

    hidden: int = 384
    heads: int = 6
    kv_heads: int = 2
    head_dim: int = 64
    intermediate: int = 1024
    target_layers: int = 10
    context: int = 1024  # target training window = max_position_embeddings
    target_batch: int = 32
    target_lr: float = 2e-3
    # distillation: prompts of each length, every one continued greedily by gen_len tokens
    prompt_lens: tuple[int, ...] = (16, 64, 160, 384)  # eval prompts run 10..450 tokens
    gen_len: int = 128
    gen_batch: int = 2048
    val_per_batch: int = 16  # rows of every generated batch kept for validation
    dflash_layers: int = 2
    dflash_block: int = 16
    dflash_target_layers: int = 3  # how many target layers feed the drafter
    dflash_anchors: int = 32  # blocks per sequence per step
    dflash_gamma: float = 7.0
    dflash_batch: int = 64
    dflash_lr: float = 1.5e-3
    pard_layers: int = 2
    pard_k: int = 8
    pard_batch: int = 32
    pard_lr: float = 1e-3
    warmup: int = 100
    eval_prompts: int = 16
    eval_new_tokens: int = 64


FULL = Shapes()
SMOKE = Shapes(
    hidden=64, heads=2, kv_heads=1, head_dim=32, intermediate=128, target_layers=3, context=128,
    target_batch=8, prompt_lens=(8, 16), gen_len=24, gen_batch=8, val_per_batch=2, dflash_anchors=4,
    dflash_batch=4, pard_batch=4, warmup=5, eval_prompts=2, eval_new_tokens=16,
)


class Budget:
    """A phase's limit: `seconds` of wall time, and at most `steps` steps if given."""

    def __init__(self, seconds: float, steps: int | None, device: torch.device) -> None:
        self.seconds, self.steps, self.device = seconds, steps, device
        self.start = time.perf_counter()

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def progress(self, step: int) -> float:
        by_time = self.elapsed() / self.seconds if self.seconds > 0 else 1.0
        by_steps = step / self.steps if self.steps else 0.0
        return min(1.0, max(by_time, by_steps))

    def done(self, step: int) -> bool:
        return self.progress(step) >= 1.0


def lr_at(step: int, progress: float, peak: float, warmup: int) -> float:
    """Linear warm-up, then cosine decay to a tenth of the peak over the phase's progress."""
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * (0.1 + 0.45 * (1 + math.cos(math.pi * progress)))


def make_optimizer(params, lr: float, device: torch.device) -> torch.optim.AdamW:
    params = [p for p in params if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8, fused=device.type == "cuda")


def set_lr(opt: torch.optim.Optimizer, lr: float) -> None:
    for group in opt.param_groups:
        group["lr"] = lr


def autocast(device: torch.device):
    """bf16 autocast on the GPU (float32 master weights); plain float32 on a CPU."""
    return torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else nullcontext()


def runtime_dtype(device: torch.device) -> torch.dtype:
    """The dtype specpilot serves the models in on this device (as pipeline dtype 'auto' does)."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def count_params(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in {id(p): p for p in module.parameters()}.values())


def init_normal(module: torch.nn.Module) -> None:
    for m in module.modules():
        if isinstance(m, (torch.nn.Linear, torch.nn.Embedding)):
            torch.nn.init.normal_(m.weight, std=INIT_STD)


class StepLog:
    """Losses kept on the device; read back (a sync) only every `every` steps."""

    def __init__(self, name: str, every: int = 50) -> None:
        self.name, self.every = name, every
        self.pending: list[torch.Tensor] = []
        self.curve: list[tuple[int, float, float]] = []  # (step, seconds, mean loss of the window)
        self.last: list[float] = []

    def add(self, step: int, loss: torch.Tensor, budget: Budget) -> None:
        self.pending.append(loss.detach().float())
        if len(self.pending) == self.every:
            self.flush(step, budget)

    def flush(self, step: int, budget: Budget) -> None:
        if not self.pending:
            return
        values = torch.stack(self.pending).tolist()
        self.pending = []
        self.last = (self.last + values)[-self.every :]
        self.curve.append((step, round(budget.elapsed(), 2), round(sum(values) / len(values), 4)))
        print(f"  {self.name} step {step:5d}  {budget.elapsed():6.1f}s  loss {self.curve[-1][2]:.4f}", flush=True)

    @property
    def final(self) -> float | None:
        return round(sum(self.last) / len(self.last), 4) if self.last else None


# --- data -----------------------------------------------------------------------------------


def token_stream(tok: Tokenizer, texts: list[str]) -> torch.Tensor:
    """All documents, each followed by EOS, as one int64 tensor."""
    encoded = tok.encode_batch(texts, add_special_tokens=False)
    return torch.cat([torch.tensor(e.ids + [EOS_TOKEN_ID], dtype=torch.long) for e in encoded])


def load_data(data_dir: Path) -> tuple[Tokenizer, torch.Tensor, torch.Tensor, dict]:
    manifest = json.loads((data_dir / MANIFEST_FILE).read_text())
    for name, key in ((CORPUS_FILE, "corpus"), (HELDOUT_FILE, "heldout")):
        sha = sha256_of_docs(data_dir / name)
        if sha != manifest[key]["sha256"]:
            raise SystemExit(f"{data_dir / name}: sha256 {sha} differs from the manifest's {manifest[key]['sha256']}")
    tok = Tokenizer.from_file(str(data_dir / TOKENIZER_FILE))
    train = token_stream(tok, [d["text"] for d in read_docs(data_dir / CORPUS_FILE)])
    heldout = token_stream(tok, [d["text"] for d in read_docs(data_dir / HELDOUT_FILE)])
    return tok, train, heldout, manifest


def windows(stream: torch.Tensor, starts: torch.Tensor, length: int) -> torch.Tensor:
    return stream[starts[:, None] + torch.arange(length, device=stream.device)]


# --- target ---------------------------------------------------------------------------------


def qwen3_config(shapes: Shapes, vocab: int, layers: int):
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=vocab,
        hidden_size=shapes.hidden,
        intermediate_size=shapes.intermediate,
        num_hidden_layers=layers,
        num_attention_heads=shapes.heads,
        num_key_value_heads=shapes.kv_heads,
        head_dim=shapes.head_dim,
        max_position_embeddings=shapes.context,
        rms_norm_eps=RMS_EPS,
        rope_parameters={"rope_type": "default", "rope_theta": ROPE_THETA},
        tie_word_embeddings=True,
        initializer_range=INIT_STD,
        bos_token_id=None,
        eos_token_id=EOS_TOKEN_ID,
        pad_token_id=None,
        use_cache=False,
    )


@torch.no_grad()
def heldout_loss(model, stream: torch.Tensor, context: int, batch: int, device: torch.device) -> float | None:
    """Mean next-token loss over consecutive windows of the held-out text (at most 64 windows)."""
    n = min(64, (len(stream) - 1) // context)
    if n == 0:
        return None
    starts = torch.arange(n, device=device) * context
    total = 0.0
    model.eval()
    for i in range(0, n, batch):
        win = windows(stream, starts[i : i + batch], context + 1)
        with autocast(device):
            logits = model(input_ids=win[:, :-1], use_cache=False).logits
        total += F.cross_entropy(logits.float().flatten(0, 1), win[:, 1:].flatten(), reduction="sum").item()
    model.train()
    return round(total / (n * context), 4)


def train_target(args, shapes: Shapes, tok: Tokenizer, stream: torch.Tensor, heldout: torch.Tensor, out: Path, log: dict):
    from transformers import Qwen3ForCausalLM

    device = args.device
    torch.manual_seed(args.seed)
    model = Qwen3ForCausalLM(qwen3_config(shapes, tok.get_vocab_size(), shapes.target_layers)).to(device)
    model.train()
    opt = make_optimizer(model.parameters(), shapes.target_lr, device)
    gen = torch.Generator(device).manual_seed(args.seed + 1)
    steps_log = StepLog("target")
    t, b = shapes.context, shapes.target_batch
    budget = Budget(args.target_seconds, args.target_steps, device)
    step = 0
    while not budget.done(step):
        set_lr(opt, lr_at(step, budget.progress(step), shapes.target_lr, shapes.warmup))
        win = windows(stream, torch.randint(0, len(stream) - t - 1, (b,), generator=gen, device=device), t + 1)
        with autocast(device):
            logits = model(input_ids=win[:, :-1], use_cache=False).logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), win[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        steps_log.add(step, loss, budget)
    sync(device)
    steps_log.flush(step, budget)
    seconds = budget.elapsed()
    model.eval()
    entry = {
        "parameters": count_params(model),
        "steps": step,
        "seconds": round(seconds, 1),
        "tokens_seen": step * b * t,
        "batch": [b, t],
        "peak_lr": shapes.target_lr,
        "final_train_loss": steps_log.final,
        "heldout_loss": heldout_loss(model, heldout, t, b, device),
        "loss_curve": steps_log.curve,
    }
    save_hf(model, out / "target", args)
    log["phases"]["target"] = entry
    print(f"target: {entry['parameters']} parameters, {step} steps in {seconds:.0f}s, "
          f"loss {entry['final_train_loss']}, held-out loss {entry['heldout_loss']}", flush=True)


def save_hf(model, path: Path, args, extra_config: dict | None = None) -> None:
    """save_pretrained in bf16, plus the tokenizer; extra_config keys are added to config.json."""
    from transformers.utils import logging

    if path.exists():
        shutil.rmtree(path)
    logging.disable_progress_bar()
    model.to(torch.bfloat16).save_pretrained(path)
    if extra_config:
        cfg_path = path / "config.json"
        cfg = json.loads(cfg_path.read_text())
        cfg.update(extra_config)
        cfg_path.write_text(json.dumps(cfg, indent=2) + "\n")
    shutil.copyfile(args.data / TOKENIZER_FILE, path / TOKENIZER_FILE)


# --- distillation data ----------------------------------------------------------------------


@dataclass
class Group:
    """Distilled sequences [N, prompt_len + gen_len]: a corpus prompt, then the target's greedy tokens."""

    prompt_len: int
    train: list[torch.Tensor]
    val: list[torch.Tensor]

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.cat(self.train), torch.cat(self.val)


@torch.no_grad()
def greedy_continue(target: Transformer, prompts: torch.Tensor, gen_len: int) -> torch.Tensor:
    """[B, P] -> [B, P + gen_len]: the target's greedy continuation, batched, static KV cache."""
    b, p = prompts.shape
    cache = target.new_cache(b, p + gen_len)
    token = target(prompts, cache, only_last=True).logits[:, -1].argmax(-1, keepdim=True)
    out = [prompts, token]
    for _ in range(gen_len - 1):
        token = target(token, cache).logits[:, -1].argmax(-1, keepdim=True)
        out.append(token)
    return torch.cat(out, dim=1)


def distill(args, shapes: Shapes, stream: torch.Tensor, out: Path, log: dict) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    device = args.device
    target, _ = load_target(out / "target", dtype=runtime_dtype(device), device=device)
    gen = torch.Generator(device).manual_seed(args.seed + 2)
    groups = {p: Group(p, [], []) for p in shapes.prompt_lens}
    budget = Budget(args.distill_seconds, args.distill_batches, device)
    batches = 0
    while batches == 0 or not budget.done(batches):
        p = shapes.prompt_lens[batches % len(shapes.prompt_lens)]
        starts = torch.randint(0, len(stream) - p, (shapes.gen_batch,), generator=gen, device=device)
        seqs = greedy_continue(target, windows(stream, starts, p), shapes.gen_len)
        groups[p].val.append(seqs[: shapes.val_per_batch])
        groups[p].train.append(seqs[shapes.val_per_batch :])
        batches += 1
    sync(device)
    data = {p: g.tensors() for p, g in groups.items() if g.train}
    generated = sum(len(tr) + len(va) for tr, va in data.values()) * shapes.gen_len
    log["phases"]["distill"] = {
        "batches": batches,
        "seconds": round(budget.elapsed(), 1),
        "sequences": {str(p): [len(tr), len(va)] for p, (tr, va) in data.items()},
        "prompt_lens": list(shapes.prompt_lens),
        "gen_len": shapes.gen_len,
        "generated_tokens": generated,
        "dtype": str(runtime_dtype(device)).removeprefix("torch."),
    }
    print(f"distill: {generated} greedy tokens in {batches} batches, {budget.elapsed():.0f}s", flush=True)
    return data


def pick_group(data: dict, step: int) -> tuple[int, torch.Tensor, torch.Tensor]:
    lens = sorted(data)
    p = lens[step % len(lens)]
    return p, *data[p]


# --- DFlash ---------------------------------------------------------------------------------


def spread_layers(num_layers: int, n: int) -> tuple[int, ...]:
    """n target layers evenly from the second to the second-to-last (DFlash taps a spread of depths)."""
    lo, hi = (1, num_layers - 2) if num_layers >= 4 else (0, num_layers - 1)
    n = min(n, hi - lo + 1)
    if n == 1:
        return (hi,)
    return tuple(sorted({round(lo + i * (hi - lo) / (n - 1)) for i in range(n)}))


def dflash_config(shapes: Shapes, target_cfg: ModelConfig) -> DrafterConfig:
    model = replace(target_cfg, num_layers=shapes.dflash_layers, vocab_size=0, tie_word_embeddings=False, qk_norm=True)
    layers = spread_layers(target_cfg.num_layers, shapes.dflash_target_layers)
    return DrafterConfig(kind="dflash", block_size=shapes.dflash_block, mask_token_id=MASK_TOKEN_ID, model=model,
                         target_layer_ids=layers)


def dflash_batch(target: Transformer, drafter: DFlashDrafter, seqs: torch.Tensor, prompt_len: int, n_anchors: int,
                 gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits [B, N, S-1, V], labels [B, N, S-1]) for random anchors in the greedy part of seqs."""
    b, length = seqs.shape
    s = drafter.block_size
    choices = length - s - prompt_len + 1  # anchors a in [prompt_len, length - s]: labels all greedy
    n = min(n_anchors, choices)
    anchors = torch.rand(b, choices, generator=gen, device=seqs.device).argsort(-1)[:, :n] + prompt_len
    with torch.no_grad():  # the frozen target exactly as it serves (no autocast)
        cache = target.new_cache(b, length)
        hidden = target(seqs, cache, hidden_layers=drafter.target_layer_ids, only_last=True).hidden
    with autocast(seqs.device):
        logits = dflash_block_logits(drafter, hidden, seqs, anchors)
    return logits, dflash_block_labels(seqs, anchors, s)


def train_dflash(args, shapes: Shapes, data: dict, out: Path, log: dict) -> None:
    device = args.device
    target, target_cfg = load_target(out / "target", dtype=runtime_dtype(device), device=device)
    dcfg = dflash_config(shapes, target_cfg)
    torch.manual_seed(args.seed + 3)
    drafter = DFlashDrafter(dcfg, embed=target.embed, head=target.head)
    init_normal(drafter)
    drafter.to(device).train()
    opt = make_optimizer(drafter.parameters(), shapes.dflash_lr, device)
    gen = torch.Generator(device).manual_seed(args.seed + 4)
    weights = dflash_loss_weights(dcfg.block_size, shapes.dflash_gamma, device)
    steps_log = StepLog("dflash")
    budget = Budget(args.dflash_seconds, args.dflash_steps, device)
    step = 0
    while not budget.done(step):
        set_lr(opt, lr_at(step, budget.progress(step), shapes.dflash_lr, shapes.warmup))
        p, train, _ = pick_group(data, step)
        seqs = train[torch.randint(0, len(train), (shapes.dflash_batch,), generator=gen, device=device)]
        logits, labels = dflash_batch(target, drafter, seqs, p, shapes.dflash_anchors, gen)
        ce = F.cross_entropy(logits.flatten(0, 2), labels.flatten(), reduction="none").view(labels.shape)
        loss = (ce * weights).sum() / (weights.sum() * labels.shape[0] * labels.shape[1])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
        opt.step()
        step += 1
        steps_log.add(step, loss, budget)
    sync(device)
    steps_log.flush(step, budget)
    drafter.eval()
    val = dflash_validation(target, drafter, data, shapes, gen)
    entry = {
        "parameters": count_params(drafter),
        "steps": step,
        "seconds": round(budget.elapsed(), 1),
        "batch": [shapes.dflash_batch, shapes.dflash_anchors, dcfg.block_size],
        "peak_lr": shapes.dflash_lr,
        "loss_weights": f"exp(-(k-1)/{shapes.dflash_gamma})",
        "block_size": dcfg.block_size,
        "target_layer_ids": list(dcfg.target_layer_ids),
        "final_train_loss": steps_log.final,
        "validation": val,
        "loss_curve": steps_log.curve,
    }
    save_dflash(drafter, dcfg, out / "dflash", args)
    log["phases"]["dflash"] = entry
    print(f"dflash: {entry['parameters']} parameters, {step} steps, loss {entry['final_train_loss']}, "
          f"validation τ estimate {val['tau_estimate']}", flush=True)


@torch.no_grad()
def dflash_validation(target, drafter, data: dict, shapes: Shapes, gen: torch.Generator) -> dict:
    """Per-draft accuracy and the τ greedy acceptance would give, on the held-back sequences."""
    correct = []
    for p in sorted(data):
        val = data[p][1]
        for i in range(0, len(val), shapes.dflash_batch):
            logits, labels = dflash_batch(target, drafter, val[i : i + shapes.dflash_batch], p, shapes.dflash_anchors, gen)
            correct.append((logits.argmax(-1) == labels).flatten(0, 1))
    correct = torch.cat(correct)
    return {
        "blocks": len(correct),
        "accuracy_by_draft": [round(x, 3) for x in correct.float().mean(0).tolist()],
        "tau_estimate": round(1 + accepted_prefix(correct).float().mean().item(), 3),
    }


def save_dflash(drafter: DFlashDrafter, dcfg: DrafterConfig, path: Path, args) -> None:
    """Through HF's DFlash assistant class, so the files are what transformers itself writes."""
    from transformers import MuseGlimmerAssistantConfig, MuseGlimmerAssistantModel

    m = dcfg.model
    config = MuseGlimmerAssistantConfig(
        hidden_size=m.hidden_size,
        intermediate_size=m.intermediate_size,
        num_hidden_layers=m.num_layers,
        layer_types=["full_attention"] * m.num_layers,
        num_attention_heads=m.num_heads,
        num_key_value_heads=m.num_kv_heads,
        head_dim=m.head_dim,
        max_position_embeddings=m.max_position_embeddings,
        rms_norm_eps=m.rms_norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": m.rope_theta},
        block_size=dcfg.block_size,
        mask_token_id=dcfg.mask_token_id,
        target_layer_ids=list(dcfg.target_layer_ids),
        initializer_range=INIT_STD,
        bos_token_id=None,
        eos_token_id=EOS_TOKEN_ID,
        pad_token_id=None,
    )
    hf = MuseGlimmerAssistantModel(config)
    hf.load_state_dict({k: v.detach().float().cpu() for k, v in drafter.state_dict().items()}, strict=True)
    save_hf(hf, path, args)


# --- PARD -----------------------------------------------------------------------------------


def pard_init_from_target(pard, target_dir: Path) -> list[str]:
    """Embedding, first layers and final norm copied from the target (same names, same shapes)."""
    target_sd = load_file(str(target_dir / "model.safetensors"))
    own = pard.state_dict()
    taken = {k: v.float() for k, v in target_sd.items() if k in own and own[k].shape == v.shape}
    pard.load_state_dict(taken, strict=False)
    return sorted(taken)


def pard_forward(model, layout, seqs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits [B, Q, V] at the layout's trained queries, labels [B, Q])."""
    b = seqs.shape[0]
    ids = layout.inputs(seqs, MASK_TOKEN_ID)
    hidden = model.model(
        input_ids=ids,
        attention_mask=layout.mask[None, None],
        position_ids=layout.positions[None].expand(b, -1),
        use_cache=False,
    ).last_hidden_state
    return model.lm_head(hidden[:, layout.queries]).float(), seqs[:, layout.labels]


def train_pard(args, shapes: Shapes, data: dict, out: Path, log: dict, vocab: int) -> None:
    from transformers import Qwen3ForCausalLM

    device = args.device
    torch.manual_seed(args.seed + 5)
    model = Qwen3ForCausalLM(qwen3_config(shapes, vocab, shapes.pard_layers))
    copied = pard_init_from_target(model, out / "target")
    model.to(device).train()
    layouts = {p: pard_layout(train.shape[1], shapes.pard_k, p, device) for p, (train, _) in data.items()}
    opt = make_optimizer(model.parameters(), shapes.pard_lr, device)
    gen = torch.Generator(device).manual_seed(args.seed + 6)
    steps_log = StepLog("pard")
    budget = Budget(args.pard_seconds, args.pard_steps, device)
    step = 0
    while not budget.done(step):
        set_lr(opt, lr_at(step, budget.progress(step), shapes.pard_lr, shapes.warmup))
        p, train, _ = pick_group(data, step)
        seqs = train[torch.randint(0, len(train), (shapes.pard_batch,), generator=gen, device=device)]
        with autocast(device):
            logits, labels = pard_forward(model, layouts[p], seqs)
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        steps_log.add(step, loss, budget)
    sync(device)
    steps_log.flush(step, budget)
    model.eval()
    val = pard_validation(model, layouts, data, shapes)
    entry = {
        "parameters": count_params(model),
        "steps": step,
        "seconds": round(budget.elapsed(), 1),
        "batch": shapes.pard_batch,
        "peak_lr": shapes.pard_lr,
        "k": shapes.pard_k,
        "initialized_from_target": copied,
        "final_train_loss": steps_log.final,
        "validation": val,
        "loss_curve": steps_log.curve,
    }
    save_hf(model, out / "pard", args, extra_config={"pard_token": MASK_TOKEN_ID, "pard_k": shapes.pard_k})
    log["phases"]["pard"] = entry
    print(f"pard: {entry['parameters']} parameters, {step} steps, loss {entry['final_train_loss']}, "
          f"validation τ estimate {val['tau_estimate']}", flush=True)


@torch.no_grad()
def pard_validation(model, layouts: dict, data: dict, shapes: Shapes) -> dict:
    correct = []
    for p in sorted(data):
        val, layout = data[p][1], layouts[p]
        for i in range(0, len(val), shapes.pard_batch):
            with autocast(val.device):
                logits, labels = pard_forward(model, layout, val[i : i + shapes.pard_batch])
            hit = logits.argmax(-1) == labels  # [B, Q]
            correct.append(hit[:, layout.chains].flatten(0, 1))  # [B * C, k]
    correct = torch.cat(correct)
    return {
        "steps": len(correct),
        "accuracy_by_draft": [round(x, 3) for x in correct.float().mean(0).tolist()],
        "tau_estimate": round(1 + accepted_prefix(correct).float().mean().item(), 3),
    }


# --- evaluation with specpilot's loops ------------------------------------------------------


def spread(items: list, n: int) -> list:
    """n items evenly across the list (the held-out set is sorted by module)."""
    if n >= len(items):
        return list(items)
    return [items[round(i * (len(items) - 1) / (n - 1))] if n > 1 else items[0] for i in range(n)]


def evaluate(args, shapes: Shapes, out: Path, log: dict) -> None:
    device = args.device
    dtype = runtime_dtype(device)
    tok = Tokenizer.from_file(str(out / "target" / TOKENIZER_FILE))
    target, cfg = load_target(out / "target", dtype=dtype, device=device)
    drafters = {}
    for kind in ("dflash", "pard"):
        if (out / kind / "model.safetensors").is_file():
            drafters[kind] = load_drafter(out / kind, target, cfg, dtype=dtype, device=device)
    prompts = spread(load_prompts("code-heldout"), args.eval_prompts or shapes.eval_prompts)
    new = args.eval_new_tokens or shapes.eval_new_tokens
    eos = cfg.eos_token_id

    def run(kind: str, ids: list[int], max_new: int):
        if kind == "ar":
            return generate_ar(target, ids, max_new_tokens=max_new, eos_token_id=eos)
        d = drafters[kind]
        if kind == "dflash":
            return generate_dflash(target, d, ids, block_size=d.block_size, mask_token_id=d.mask_token_id,
                                   max_new_tokens=max_new, eos_token_id=eos)
        return generate_pard(target, d, ids, k=d.k, mask_token_id=d.mask_token_id, max_new_tokens=max_new, eos_token_id=eos)

    kinds = ["ar", *drafters]
    warm = tok.encode("def f(x):\n").ids
    for kind in kinds:  # first calls pay for kernel selection and allocation
        run(kind, warm, 4)
    budget = Budget(args.eval_seconds, None, device)
    rows = []
    for prompt in prompts:
        if rows and budget.done(0):
            break
        ids = tok.encode(prompt).ids
        gens = {kind: run(kind, ids, new) for kind in kinds}
        row = {"prompt_tokens": len(ids), "ar_tokens": len(gens["ar"].tokens),
               "ar_ms_per_token": round(1e3 * gens["ar"].decode_s / max(1, len(gens["ar"].tokens) - 1), 3)}
        for kind in drafters:
            g = gens[kind]
            row[kind] = {"tau": round(g.tau, 3), "steps": g.steps, "accepted": sum(g.accepted),
                         "equals_ar": g.tokens == gens["ar"].tokens,
                         "ms_per_token": round(1e3 * g.decode_s / max(1, len(g.tokens) - 1), 3)}
        if len(rows) < 3:
            row["sample"] = {"prompt": prompt, "ar_completion": tok.decode(gens["ar"].tokens)}
        rows.append(row)
    summary = {}
    for kind in drafters:
        steps = sum(r[kind]["steps"] for r in rows)
        accepted = sum(r[kind]["accepted"] for r in rows)
        summary[kind] = {
            "tau": round(1 + accepted / steps, 3) if steps else None,
            "equals_ar": sum(r[kind]["equals_ar"] for r in rows),
            "prompts": len(rows),
        }
    log["phases"]["eval"] = {
        "prompt_set": "code-heldout",
        "prompts": len(rows),
        "max_new_tokens": new,
        "dtype": str(dtype).removeprefix("torch."),
        "seconds": round(budget.elapsed(), 1),
        "note": "τ counts the bonus token; times are eager decode loops, indicative only",
        "summary": summary,
        "rows": rows,
    }
    print("eval: " + ", ".join(f"{k} τ {v['tau']} ({v['equals_ar']}/{v['prompts']} equal AR)" for k, v in summary.items()),
          flush=True)


# --- driver ---------------------------------------------------------------------------------


def environment(device: torch.device) -> dict:
    import transformers

    return {
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
    }


def git_commit() -> str:
    """HEAD, or $GIT_COMMIT where the tree was copied without .git (the GPU machine)."""
    if os.environ.get("GIT_COMMIT"):
        return os.environ["GIT_COMMIT"]
    try:
        root = Path(__file__).resolve().parents[1]
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                              timeout=10).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def write_log(out: Path, log: dict) -> None:
    tmp = out / "train_log.json.tmp"
    tmp.write_text(json.dumps(log, indent=1) + "\n")
    os.replace(tmp, out / "train_log.json")


PACK_PART = 15 * 2**20  # the device tool returns at most 8 files of 16 MiB each, 64 MiB in all


def pack(out: Path, pack_dir: Path) -> list[Path]:
    """OUT as one tar split into PACK_PART-byte files pack_dir/zoo.tar.part-NN, plus a copy of
    train_log.json. Unpack: cat zoo.tar.part-* | tar -x -C DEST (gives DEST/<OUT's name>/...)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        tar.add(out, arcname=out.name, filter=lambda info: None if info.name.endswith(".tmp") else info)
    data = buf.getvalue()
    pack_dir.mkdir(parents=True, exist_ok=True)
    parts = []
    for i in range(0, len(data), PACK_PART):
        part = pack_dir / f"zoo.tar.part-{i // PACK_PART:02d}"
        tmp = part.with_name(part.name + ".tmp")
        tmp.write_bytes(data[i : i + PACK_PART])
        os.replace(tmp, part)
        parts.append(part)
    for stale in set(pack_dir.glob("zoo.tar.part-*")) - set(parts):
        stale.unlink()
    shutil.copyfile(out / "train_log.json", pack_dir / "train_log.json")
    return parts


# Seconds per phase on the GPU (a tenth with --smoke), and the step caps --smoke sets.
PHASE_SECONDS = {"target": 150, "distill": 30, "dflash": 70, "pard": 60, "eval": 20}
SMOKE_CAPS = {"target_steps": 30, "distill_batches": 4, "dflash_steps": 12, "pard_steps": 12}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", type=Path, default=Path(".cache/zoo"), help="corpus and tokenizer folder")
    ap.add_argument("--out", type=Path, required=True, help="output folder")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, a few steps per phase, on the CPU")
    ap.add_argument("--device", default=None, help="default: cuda if available (cpu with --smoke)")
    ap.add_argument("--seed", type=int, default=0)
    for phase, seconds in PHASE_SECONDS.items():
        ap.add_argument(f"--{phase}-seconds", type=float, default=None, help=f"default {seconds} ({seconds // 10} with --smoke)")
    for name, cap in SMOKE_CAPS.items():
        ap.add_argument(f"--{name.replace('_', '-')}", type=int, default=None, help=f"optional cap ({cap} with --smoke)")
    ap.add_argument("--eval-prompts", type=int, default=None)
    ap.add_argument("--eval-new-tokens", type=int, default=None)
    ap.add_argument("--pack", type=Path, default=None,
                    help="after every phase, also write OUT as zoo.tar.part-NN files of 15 MiB (and train_log.json) here")
    args = ap.parse_args(argv)
    args.argv = list(argv if argv is not None else sys.argv[1:])
    for phase, seconds in PHASE_SECONDS.items():
        if getattr(args, f"{phase}_seconds") is None:
            setattr(args, f"{phase}_seconds", seconds // 10 if args.smoke else seconds)
    for name, cap in SMOKE_CAPS.items():
        if args.smoke and getattr(args, name) is None:
            setattr(args, name, cap)
    args.device = torch.device(args.device or ("cuda" if torch.cuda.is_available() and not args.smoke else "cpu"))
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    shapes = SMOKE if args.smoke else FULL
    if args.device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    torch.manual_seed(args.seed)
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    tok, train_stream, heldout_stream, manifest = load_data(args.data)
    log = {
        "argv": args.argv,
        "commit": git_commit(),
        "environment": environment(args.device),
        "shapes": asdict(shapes),
        "smoke": args.smoke,
        "data": {
            "python": manifest["python"],
            "corpus_sha256": manifest["corpus"]["sha256"],
            "corpus_files": manifest["corpus"]["files"],
            "corpus_tokens": len(train_stream),
            "heldout_modules": manifest["heldout_modules"],
            "heldout_tokens": len(heldout_stream),
            "tokenizer_sha256": manifest.get("tokenizer", {}).get("sha256"),
            "vocab_size": tok.get_vocab_size(),
            "tokenize_seconds": round(time.perf_counter() - t0, 1),
        },
        "phases": {},
        "failed": {},
    }
    print(f"data: {len(train_stream)} training tokens, {len(heldout_stream)} held-out tokens "
          f"({time.perf_counter() - t0:.1f}s); device {args.device}", flush=True)
    train_stream, heldout_stream = train_stream.to(args.device), heldout_stream.to(args.device)

    def phase(name: str, fn, *fn_args):
        start = time.perf_counter()
        try:
            return fn(*fn_args)
        except KeyboardInterrupt:  # `timeout -s INT`: keep what the finished phases wrote, then stop
            log["failed"][name] = "interrupted"
            raise
        except Exception:
            log["failed"][name] = traceback.format_exc()
            print(f"{name}: FAILED\n{log['failed'][name]}", file=sys.stderr, flush=True)
            return None
        finally:
            log.setdefault("wall_seconds", {})[name] = round(time.perf_counter() - start, 1)
            log["total_seconds"] = round(time.perf_counter() - t0, 1)
            write_cards(out, log)
            write_log(out, log)
            if args.pack:
                pack(out, args.pack)

    phase("target", train_target, args, shapes, tok, train_stream, heldout_stream, out, log)
    if "target" not in log["failed"]:
        data = phase("distill", distill, args, shapes, train_stream, out, log)
        if data:
            phase("dflash", train_dflash, args, shapes, data, out, log)
            phase("pard", train_pard, args, shapes, data, out, log, tok.get_vocab_size())
            del data
        phase("eval", evaluate, args, shapes, out, log)
    print(f"done in {time.perf_counter() - t0:.0f}s -> {out}" + (f"; FAILED: {sorted(log['failed'])}" if log["failed"] else ""))
    return 1 if log["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())

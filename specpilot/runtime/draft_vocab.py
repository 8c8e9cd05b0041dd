"""A reduced draft vocabulary (FR-Spec): the drafter scores only a corpus's most frequent tokens.

A drafter's LM head is the largest matrix it reads a step: a DFlash drafter borrows the target's
(Llama-3.1-8B: 128256 x 4096, 1.05 GB, a quarter of a 5-layer drafter's bytes) and a PARD drafter
carries its own over the same vocabulary. A drafter only proposes; greedy verification accepts a
drafted token only where it equals the target's argmax. So restricting the proposals to a subset S
of the vocabulary moves τ (a token outside S cannot be drafted) and never the output.

`SubsetHead` holds the rows of S (sorted ids) and returns float32 logits over the whole vocabulary,
-inf outside S, so every consumer (a chain's argmax, a tree's top-k, the device accept, CUDA graphs)
runs unchanged. Its price: a fill and a scatter of [rows, V] float32 (8 MB for 16 rows at
128256) against reading |S| / V of the head's weight. The logits of S are the full head's rows
(a GEMM over fewer rows may sum in another order: a drafter's rounding, which verification judges).

S (`select_subset`): the `size` most frequent ids of a corpus tokenized with the target's
tokenizer, ties by the smaller id, with the end-of-sequence id always in (a drafter must be able
to propose the end). The corpus (`read_corpus`) is local text, never the benchmark prompts:
"stdlib" is this Python's standard-library sources, without the files any bundled prompt set is
drawn from (`code-heldout` names its source files), read in path order up to CORPUS_BYTES; or a
path: a text file, a .jsonl / .jsonl.gz file of {"text"} or {"prompt"} objects, or a folder
(its files in path order, as text). An engine stores S beside the drafter (VOCAB_FILE), covered
by the engine's checksums like every file.
"""

from __future__ import annotations

import gzip
import sysconfig
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from fnmatch import fnmatch
from importlib import resources
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import nn

from ..errors import EngineError, SpecError
from ..jsonl import parse_jsonl

VOCAB_FILE = "draft_vocab.safetensors"
CORPUS_BYTES = 8 << 20  # the frequency table's text: top-N ranks settle within a few MB of code
STDLIB = "stdlib"
# Folders of Lib/ never read (train/corpus.py's EXCLUDED_DIRS: packages, compiled and generated files)
_STDLIB_SKIP = ("site-packages", "lib-dynload", "__pycache__", "pydoc_data", "encodings", "config-*")


def _heldout_sources() -> frozenset[str]:
    """Stdlib files the bundled prompt sets are drawn from (and their tests): kept out of "stdlib"."""
    data = resources.files("specpilot.bench") / "data" / "code-heldout.jsonl"
    sources = parse_jsonl(data.read_text(encoding="utf-8"), "specpilot/bench/data/code-heldout.jsonl", ("source",))
    modules = {s.split(":")[0].removesuffix(".py") for s in sources}  # "base64.py:b64encode"
    return frozenset(p for m in modules for p in (f"{m}.py", f"test/test_{m}.py"))


def _stdlib_texts() -> Iterator[str]:
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = _heldout_sources()
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel in skip or any(fnmatch(part, d) for part in path.relative_to(root).parts[:-1] for d in _STDLIB_SKIP):
            continue
        try:
            yield path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue


def _jsonl_texts(path: Path, where: str) -> list[str]:
    raw = path.read_bytes()
    text = (gzip.decompress(raw) if path.suffix == ".gz" else raw).decode("utf-8")
    try:
        return parse_jsonl(text, str(path), fields=("text", "prompt"))
    except SpecError as e:
        raise SpecError(f"{where}: {e}") from None


def _path_texts(path: Path, where: str) -> Iterator[str]:
    if path.is_dir():
        for f in sorted(p for p in path.rglob("*") if p.is_file()):
            try:
                yield f.read_text(encoding="utf-8")
            except UnicodeDecodeError:
                continue
    elif path.name.endswith((".jsonl", ".jsonl.gz")):
        yield from _jsonl_texts(path, where)
    else:
        yield path.read_text(encoding="utf-8", errors="replace")


def read_corpus(corpus: str, where: str = "draft-vocab corpus", max_bytes: int = CORPUS_BYTES) -> list[str]:
    """The corpus's texts in order, up to max_bytes of UTF-8 (the last text cut at the limit)."""
    if corpus == STDLIB:
        texts = _stdlib_texts()
    else:
        path = Path(corpus)
        try:
            found = path.exists()
        except (OSError, ValueError):  # a name no file system takes (NUL bytes, too long)
            found = False
        if not found:
            raise SpecError(f"{where}: {corpus!r} does not exist (expected {STDLIB!r}, a text or .jsonl file, "
                            f"or a folder)")
        texts = _path_texts(path, where)
    out, left = [], max_bytes
    for t in texts:
        b = t.encode("utf-8")
        if len(b) >= left:
            out.append(b[:left].decode("utf-8", errors="ignore"))
            break
        out.append(t)
        left -= len(b)
    if not any(out):
        raise SpecError(f"{where}: {corpus!r} holds no text")
    return out


def token_counts(tokenizer, texts: Sequence[str], vocab_size: int) -> torch.Tensor:
    """int64 [vocab_size]: how often each id occurs in the texts tokenized (no special tokens added)."""
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for enc in tokenizer.encode_batch(list(texts), add_special_tokens=False):
        ids = torch.tensor(enc.ids, dtype=torch.int64)
        if ids.numel():
            if int(ids.max()) >= vocab_size:
                raise SpecError(f"the tokenizer produced id {int(ids.max())} past the model's vocabulary of {vocab_size}")
            counts += torch.bincount(ids, minlength=vocab_size)
    return counts


def select_subset(counts: torch.Tensor, size: int, always: Sequence[int] = ()) -> torch.Tensor:
    """The `size` most frequent ids (ties: smaller id first), `always` included, sorted ascending."""
    vocab = counts.numel()
    if not 1 <= size <= vocab:
        raise ValueError(f"a draft vocabulary of {size} tokens must be within 1..{vocab}")
    forced = sorted({int(i) for i in always if 0 <= int(i) < vocab})
    if len(forced) > size:
        raise ValueError(f"a draft vocabulary of {size} tokens cannot hold the {len(forced)} required ids {forced}")
    # Sort by (-count, id): a stable sort of the ids by descending count keeps ties in id order.
    order = torch.sort(counts, descending=True, stable=True).indices
    chosen = set(forced)
    for i in order.tolist():
        if len(chosen) == size:
            break
        chosen.add(i)
    return torch.tensor(sorted(chosen), dtype=torch.int64)


def coverage(counts: torch.Tensor, ids: torch.Tensor) -> float:
    """The share of the corpus's tokens that the subset holds."""
    total = int(counts.sum())
    return float(counts[ids].sum()) / total if total else 0.0


class SubsetHead(nn.Module):
    """logits [..., V] float32: the head's rows `ids` at their ids, -inf at every other id."""

    def __init__(self, weight: torch.Tensor, ids: torch.Tensor, vocab_size: int) -> None:
        super().__init__()
        if weight.dim() != 2 or weight.shape[0] != vocab_size:
            raise ValueError(f"a head weight [{vocab_size}, hidden] is needed, got {tuple(weight.shape)}")
        ids = ids.to(device=weight.device, dtype=torch.int64)
        self.vocab_size = vocab_size
        self.register_buffer("ids", ids, persistent=False)
        # The subset's rows as a linear of their own: a backend may serve it with another kernel
        # (runtime/cpu_linear.py's packed linear on the CPU).
        self.rows = nn.Linear(weight.shape[1], ids.numel(), bias=False, device="meta")
        self.rows.weight = nn.Parameter(weight.detach()[ids].contiguous(), requires_grad=False)

    @property
    def weight(self) -> torch.Tensor:
        """The subset's rows [|S|, hidden]."""
        return self.rows.weight

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        sub = self.rows(h).float()
        out = torch.full((*h.shape[:-1], self.vocab_size), float("-inf"), dtype=torch.float32, device=h.device)
        return out.index_copy_(-1, self.ids, sub)


def head_weight(module: nn.Module) -> torch.Tensor:
    """The [V, hidden] weight a head module serves, in its values (u12 planes unpacked: exact)."""
    from ..formats.u12 import U12Tensor, unpack_u12

    packed = getattr(module, "packed", None)
    if isinstance(packed, U12Tensor):
        return unpack_u12(packed)
    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.Tensor):
        raise EngineError(f"cannot read a head weight from {type(module).__name__}")
    return weight.detach()


def save_vocab(path: Path, ids: torch.Tensor, *, corpus: str, coverage_share: float | None, vocab_size: int) -> None:
    meta = {"corpus": corpus, "vocab_size": str(vocab_size)}
    if coverage_share is not None:
        meta["coverage"] = repr(coverage_share)
    save_file({"ids": ids.to("cpu", torch.int64).contiguous()}, str(path), metadata=meta)


def load_vocab(path: Path, size: int, vocab_size: int, corpus: str) -> torch.Tensor:
    """The stored subset, checked against what the IR asks for (size, vocabulary, corpus)."""
    try:
        with safe_open(str(path), "pt") as f:
            stored_corpus = (f.metadata() or {}).get("corpus")
            ids = f.get_tensor("ids")
    except (SafetensorError, OSError) as e:
        raise EngineError(f"{path}: not a draft vocabulary file ({e})") from None
    if stored_corpus != corpus:
        raise EngineError(f"{path}: its subset comes from corpus {stored_corpus!r}, the IR asks for {corpus!r}")
    ok = (ids.dim() == 1 and ids.numel() == size and ids.dtype == torch.int64 and bool((ids[1:] > ids[:-1]).all())
          and (size == 0 or (int(ids[0]) >= 0 and int(ids[-1]) < vocab_size)))
    if not ok:
        raise EngineError(f"{path}: expected {size} sorted distinct token ids below {vocab_size} "
                          f"(the drafter lm_head's vocab_subset)")
    return ids


@dataclass(frozen=True)
class DraftVocab:
    """A drafter head's subset: its ids, where they came from, and the corpus share they cover
    (None when read back from an engine)."""

    ids: torch.Tensor
    corpus: str
    coverage: float | None = None


def build_vocab(tokenizer, corpus: str, size: int, vocab_size: int, eos_token_id: int | None) -> DraftVocab:
    """Count the corpus's tokens and take the subset (the end of sequence always in)."""
    where = f"draft-vocab{{corpus={corpus!r}}}"
    counts = token_counts(tokenizer, read_corpus(corpus, where), vocab_size)
    always = () if eos_token_id is None else (eos_token_id,)
    ids = select_subset(counts, size, always)
    return DraftVocab(ids, corpus, coverage(counts, ids))

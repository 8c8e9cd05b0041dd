"""`draft-vocab{size=N, corpus=C}`: the drafter's LM head scores only N frequent token ids (FR-Spec).

Changes the drafter graph's `lm_head` node: `vocab_subset` = N and `vocab_corpus` = C. The backend
picks the N ids most frequent in corpus C under the target's tokenizer (runtime/draft_vocab.py:
"stdlib", this Python's standard-library sources without the files a bundled prompt set comes
from, or a local path) and serves the head with those rows only; its logits stay V wide, -inf at
the other ids. The head's weight bytes a draft step reads drop to N / V (the cost model prices
that); the end-of-sequence id is always in.

Lossless: a drafter only proposes, and greedy verification accepts a token only where it equals
the target's argmax, so the output stays AR greedy's. What moves is τ: a token outside the
subset cannot be drafted. How much is measured, not modelled (no acceptance model of a subset
yet), so the pass declares no `closes`: the cost model does not offer it as a what-if, and a search
measures its schedule space (sizes from V/16 up to below V, stdlib corpus) rather than predicting it.
On the CPU with the zoo pair, size 1024 of 8192 was the largest single gain measured
(docs/experiments/agent-cpu.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..errors import PipelineError
from ..ir import Program
from ..runtime.draft_vocab import STDLIB
from .base import Pass, PassResult, register


# FR-Spec's sizes and smaller ones for small vocabularies; those in [V/16, V) are offered
CANDIDATE_SIZES = (512, 1024, 2048, 4096, 8192, 16384, 32768)


@register
@dataclass(frozen=True)
class DraftVocab(Pass):
    name = "draft-vocab"
    lossless = True
    size: int = 32768
    corpus: str = STDLIB

    def __post_init__(self):
        if self.size < 1:
            raise ValueError(f"size must be >= 1, got {self.size}")
        if not self.corpus:
            raise ValueError(f"corpus must be {STDLIB!r} or a path, got an empty string")

    def check(self, program: Program, where: str = "") -> None:
        """A corpus no file system could hold (a NUL byte, a name too long) is refused here; whether a
        corpus exists is asked when the backend reads it."""
        if self.corpus == STDLIB:
            return
        try:
            Path(self.corpus).exists()
        except (OSError, ValueError):
            shown = self.corpus if len(self.corpus) <= 80 else self.corpus[:77] + "..."
            raise PipelineError(f"{where}pass {self.name!r}: parameter 'corpus' = {shown!r} is no path a file system "
                                f"takes (expected {STDLIB!r}, a text or .jsonl file, or a folder)") from None

    def apply(self, program: Program) -> PassResult:
        heads = program.drafter.find("lm_head")
        if len(heads) != 1:
            return PassResult(program, False, f"the drafter has {len(heads)} lm_head nodes, expected one")
        name, head = heads[0], program.drafter.node(heads[0])
        vocab = head["out_features"]
        if self.size >= vocab:
            return PassResult(program, False, f"no change: {self.size} tokens hold the whole vocabulary of {vocab}")
        if head.get("vocab_subset") == self.size and head.get("vocab_corpus") == self.corpus:
            return PassResult(program, False, "draft vocabulary already set")
        graph = program.drafter.with_node(name, head.replace(vocab_subset=self.size, vocab_corpus=self.corpus))
        return PassResult(program.with_graph("drafter", graph), True,
                          f"drafter head scores {self.size} of {vocab} tokens (corpus {self.corpus})")

    @classmethod
    def schedule_space(cls, program: Program) -> list[Pass]:
        heads = program.drafter.find("lm_head")
        if len(heads) != 1:
            return []
        vocab = program.drafter.node(heads[0])["out_features"]
        return [p for p in (cls(size=n) for n in CANDIDATE_SIZES if vocab / 16 <= n < vocab) if p.apply(program).changed]

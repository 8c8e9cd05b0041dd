"""Rewrite passes over the IR: one pass per file, registered by name (see base.py)."""

from .base import REGISTRY, Pass, PassResult, lookup, register
from .manager import PassRecord, all_lossless, pipeline_string, run_passes
from . import attention_split_kv, block_size, cuda_graphs, draft_vocab, fused_decoder, tree_verify, weights_u12  # noqa: F401  (registers the built-in passes)
from . import ragged_verify, spec_control, verify_budget  # noqa: F401  (the batched engine's mechanisms)
from . import two_level_verify  # noqa: F401

__all__ = [
    "REGISTRY", "Pass", "PassRecord", "PassResult", "all_lossless", "lookup", "pipeline_string",
    "register", "run_passes",
]

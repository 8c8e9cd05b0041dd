"""Built-in model names: pairs specpilot ships or builds locally, with no download.

`code-qwen3` is the zoo's trained pair (zoo/code-qwen3: a 12.8M-parameter Qwen3 code target with
DFlash and PARD drafters distilled from it; see its model cards); `code-qwen3-next` the hybrid
pair (a Gated DeltaNet + attention target and its DFlash drafter). `tiny-qwen3` and `tiny-llama`
are randomly initialised pairs built from configs in `tiny.py`: enough to run and check every
mechanism, meaningless for τ. They are built once into the cache folder ($SPECPILOT_CACHE,
default ~/.cache/specpilot).
"""

from __future__ import annotations

import os
from pathlib import Path

from ..errors import CheckpointError
from ..zoo import PAIRS as ZOO_PAIRS
from ..zoo import pair_dir
from .tiny import build_tiny_models

BUILTIN_PAIRS = {"tiny-qwen3": "qwen3", "tiny-llama": "llama"}
TINY_VERSION = "v1"  # bump when tiny.py changes what it builds


def cache_root() -> Path:
    return Path(os.environ.get("SPECPILOT_CACHE", Path.home() / ".cache" / "specpilot"))


def is_builtin(name: str) -> bool:
    return name.split("/")[0] in BUILTIN_PAIRS or name.split("/")[0] in ZOO_PAIRS


def resolve_builtin(name: str) -> Path:
    """`tiny-qwen3` -> its target dir; `tiny-qwen3/dflash` or `tiny-qwen3/pard` -> that drafter's dir."""
    pair, _, part = name.partition("/")
    part = part or "target"
    if pair in ZOO_PAIRS and part in ("target", "dflash", "pard"):
        return pair_dir(pair) / part
    if pair not in BUILTIN_PAIRS or part not in ("target", "dflash", "pard"):
        known = ", ".join(f"{p}, {p}/dflash, {p}/pard" for p in (*ZOO_PAIRS, *BUILTIN_PAIRS))
        raise CheckpointError(f"unknown built-in model {name!r} (built-ins: {known})")
    root = cache_root() / "models" / f"{pair}-{TINY_VERSION}"
    if not (root / part / "config.json").is_file():
        build_tiny_models(root, family=BUILTIN_PAIRS[pair], seed=0)
    return root / part

"""Load targets and drafters from local HF model directories (read by specpilot.hf) into runtime modules.

Every mistake a user can make with a model directory is a CheckpointError naming the path and what
was expected: missing directory / config.json / weights, missing or unexpected tensor names, shape
mismatches, a drafter that does not fit its target.
"""

from __future__ import annotations

from pathlib import Path
from typing import Union

import torch
from torch import nn

from specpilot.hf.checkpoint import model_dir, read_config, read_tensors
from specpilot.hf.config import HYBRID_FAMILIES, DrafterConfig, HybridConfig, ModelConfig, check_drafter_fits
from specpilot.runtime.dflash import DFlashDrafter
from specpilot.runtime.hybrid import HybridTransformer
from specpilot.runtime.model import PardDrafter, Transformer

Drafter = Union[PardDrafter, DFlashDrafter]
Target = Union[Transformer, HybridTransformer]
TargetConfig = Union[ModelConfig, HybridConfig]


def load_target(path: str | Path, *, dtype: torch.dtype, device: torch.device | str) -> tuple[Target, TargetConfig]:
    """A llama/qwen3 `Transformer`, or a `HybridTransformer` for a qwen3_next directory, with its config."""
    root = model_dir(path)
    raw, source = read_config(root)
    cfg: TargetConfig
    if raw.get("model_type") in HYBRID_FAMILIES:
        cfg = HybridConfig.from_hf(raw, source)
        with torch.device("meta"):
            model = HybridTransformer(cfg)
    else:
        cfg = ModelConfig.from_hf(raw, source)
        with torch.device("meta"):
            model = Transformer(cfg)
    optional = {"lm_head.weight"} if cfg.tie_word_embeddings else set()
    _load_weights(model, root, dtype=dtype, device=device, optional=optional)
    return model.eval().requires_grad_(False), cfg


def load_drafter(
    path: str | Path, target: Target, target_cfg: TargetConfig, *, dtype: torch.dtype, device: torch.device | str
) -> Drafter:
    """A PardDrafter (its own causal LM) or a DFlashDrafter bound to the target's embed/head."""
    root = model_dir(path)
    raw, source = read_config(root)
    dcfg = DrafterConfig.from_hf(raw, source)
    check_drafter_fits(dcfg, target_cfg, source)
    if dcfg.kind == "pard":
        with torch.device("meta"):
            model = Transformer(dcfg.model)
        optional = {"lm_head.weight"} if dcfg.model.tie_word_embeddings else set()
        _load_weights(model, root, dtype=dtype, device=device, optional=optional)
        return PardDrafter(model=model.eval().requires_grad_(False), mask_token_id=dcfg.mask_token_id, k=dcfg.block_size)
    with torch.device("meta"):
        drafter = DFlashDrafter(dcfg, embed=target.embed, head=target.head)
    _load_weights(drafter, root, dtype=dtype, device=device, optional=set())
    return drafter.eval().requires_grad_(False)


def _load_weights(
    module: nn.Module, root: Path, *, dtype: torch.dtype, device: torch.device | str, optional: set[str]
) -> None:
    """Fill a module built on the meta device from the directory's safetensors (names and shapes checked)."""
    expected = {name: p.shape for name, p in module.state_dict().items()}
    tensors = read_tensors(root, expected, optional=optional, dtype=dtype, device=device)
    module.load_state_dict(tensors, strict=True, assign=True)

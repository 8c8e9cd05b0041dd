"""Load targets and drafters from local HF model directories (read by specpilot.hf) into runtime modules.

Every mistake a user can make with a model directory is a CheckpointError naming the path and what
was expected: missing directory / config.json / weights, missing or unexpected tensor names, shape
mismatches, a drafter that does not fit its target.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Union

import torch
from torch import nn

from specpilot.errors import CheckpointError
from specpilot.hf.checkpoint import model_dir, read_config, read_tensors
from specpilot.hf.config import HYBRID_FAMILIES, DrafterConfig, HybridConfig, ModelConfig, check_drafter_fits
from specpilot.runtime.dflash import DFlashDrafter
from specpilot.runtime.hybrid import HybridTransformer
from specpilot.runtime.model import PardDrafter, Transformer
from specpilot.runtime.shared_weights import shared_tensors

Drafter = Union[PardDrafter, DFlashDrafter]
Target = Union[Transformer, HybridTransformer]
TargetConfig = Union[ModelConfig, HybridConfig]
# Weights a directory may leave out because it stores them in another format beside its checkpoint
# (an engine's 12-bit planes): name -> a function giving the tensor, bit for bit.
Stored = Mapping[str, Callable[[], torch.Tensor]]


def load_target(path: str | Path, *, dtype: torch.dtype, device: torch.device | str,
                stored: Stored | None = None) -> tuple[Target, TargetConfig]:
    """A llama/qwen3 `Transformer`, or a `HybridTransformer` for a qwen3_next directory, with its config.
    A weight the checkpoint lacks comes from `stored`, where that has it."""
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
    _load_weights(model, root, dtype=dtype, device=device, optional=optional, stored=stored)
    return model.eval().requires_grad_(False), cfg


def load_drafter(
    path: str | Path, target: Target, target_cfg: TargetConfig, *, dtype: torch.dtype, device: torch.device | str,
    stored: Stored | None = None,
) -> Drafter:
    """A PardDrafter (its own causal LM) or a DFlashDrafter bound to the target's embed/head (weights
    the checkpoint lacks from `stored`, as load_target)."""
    root = model_dir(path)
    raw, source = read_config(root)
    dcfg = DrafterConfig.from_hf(raw, source)
    check_drafter_fits(dcfg, target_cfg, source)
    if dcfg.kind == "pard":
        with torch.device("meta"):
            model = Transformer(dcfg.model)
        optional = {"lm_head.weight"} if dcfg.model.tie_word_embeddings else set()
        _load_weights(model, root, dtype=dtype, device=device, optional=optional, stored=stored)
        return PardDrafter(model=model.eval().requires_grad_(False), mask_token_id=dcfg.mask_token_id, k=dcfg.block_size)
    with torch.device("meta"):
        drafter = DFlashDrafter(dcfg, embed=target.embed, head=target.head)
    _load_weights(drafter, root, dtype=dtype, device=device, optional=set(), stored=stored)
    return drafter.eval().requires_grad_(False)


def _load_weights(
    module: nn.Module, root: Path, *, dtype: torch.dtype, device: torch.device | str, optional: set[str],
    stored: Stored | None = None,
) -> None:
    """Fill a module built on the meta device from the directory's safetensors (names and shapes
    checked), taking a weight the files lack from `stored` where that has it. Inside a
    `sharing_weights` scope a second load of the same directory gets the first one's tensors."""
    expected = {name: p.shape for name, p in module.state_dict().items()}
    stored = {name: get for name, get in (stored or {}).items() if name in expected}

    def read() -> dict[str, torch.Tensor]:
        tensors = read_tensors(root, expected, optional=optional | set(stored), dtype=dtype, device=device)
        for name, get in stored.items():
            if name not in tensors:
                tensor = get()
                if tuple(tensor.shape) != tuple(expected[name]):
                    raise CheckpointError(f"{root}: stored weight {name!r} has shape {list(tensor.shape)}; "
                                          f"expected {list(expected[name])}")
                tensors[name] = tensor.to(dtype=dtype, device=device)
        return tensors

    key = ("checkpoint", str(Path(root).resolve()), type(module).__qualname__, str(dtype), str(torch.device(device)),
           tuple(sorted(stored)))
    module.load_state_dict(shared_tensors(key, read), strict=True, assign=True)

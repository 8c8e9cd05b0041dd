"""Load targets and drafters from local HF model directories into our runtime modules.

Every mistake a user can make with a model directory is a CheckpointError naming the path and what
was expected: missing directory / config.json / weights, missing or unexpected tensor names, shape
mismatches, a drafter that does not fit its target.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Union

import torch
from safetensors import safe_open
from torch import nn

from specpilot.errors import CheckpointError
from specpilot.runtime.config import HYBRID_FAMILIES, DrafterConfig, HybridConfig, ModelConfig
from specpilot.runtime.dflash import DFlashDrafter
from specpilot.runtime.hybrid import HybridTransformer
from specpilot.runtime.model import PardDrafter, Transformer

Drafter = Union[PardDrafter, DFlashDrafter]
Target = Union[Transformer, HybridTransformer]
TargetConfig = Union[ModelConfig, HybridConfig]

# Tensors some HF checkpoints carry that are not weights (recomputed at run time).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# Qwen3-Next checkpoints carry a multi-token-prediction head that HF also skips.
_IGNORED_PREFIXES = ("mtp.",)


def load_target(path: str | Path, *, dtype: torch.dtype, device: torch.device | str) -> tuple[Target, TargetConfig]:
    """A llama/qwen3 `Transformer`, or a `HybridTransformer` for a qwen3_next directory, with its config."""
    model_dir = _model_dir(path)
    raw, source = _read_config(model_dir)
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
    _load_weights(model, model_dir, dtype=dtype, device=device, optional=optional)
    return model.eval().requires_grad_(False), cfg


def load_drafter(
    path: str | Path, target: Target, target_cfg: TargetConfig, *, dtype: torch.dtype, device: torch.device | str
) -> Drafter:
    """A PardDrafter (its own causal LM) or a DFlashDrafter bound to the target's embed/head."""
    model_dir = _model_dir(path)
    raw, source = _read_config(model_dir)
    dcfg = DrafterConfig.from_hf(raw, source)
    _check_fits_target(dcfg, target_cfg, source)
    if dcfg.kind == "pard":
        with torch.device("meta"):
            model = Transformer(dcfg.model)
        optional = {"lm_head.weight"} if dcfg.model.tie_word_embeddings else set()
        _load_weights(model, model_dir, dtype=dtype, device=device, optional=optional)
        return PardDrafter(model=model.eval().requires_grad_(False), mask_token_id=dcfg.mask_token_id, k=dcfg.block_size)
    with torch.device("meta"):
        drafter = DFlashDrafter(dcfg, embed=target.embed, head=target.head)
    _load_weights(drafter, model_dir, dtype=dtype, device=device, optional=set())
    return drafter.eval().requires_grad_(False)


def _check_fits_target(dcfg: DrafterConfig, target_cfg: TargetConfig, source: str) -> None:
    vocab = target_cfg.vocab_size
    if dcfg.kind == "pard" and dcfg.model.vocab_size != vocab:
        raise CheckpointError(
            f"{source}: field 'vocab_size' is {dcfg.model.vocab_size}; expected the target's vocabulary size {vocab}"
        )
    if dcfg.kind == "dflash" and dcfg.model.vocab_size not in (0, vocab):
        raise CheckpointError(
            f"{source}: field 'vocab_size' is {dcfg.model.vocab_size}; expected the target's vocabulary size {vocab}"
        )
    mask_field = "pard_token" if dcfg.kind == "pard" else "mask_token_id"
    if not 0 <= dcfg.mask_token_id < vocab:
        raise CheckpointError(
            f"{source}: field '{mask_field}' is {dcfg.mask_token_id}; expected a token id below the target's vocabulary size {vocab}"
        )
    if dcfg.kind == "dflash":
        if dcfg.model.hidden_size != target_cfg.hidden_size:
            raise CheckpointError(
                f"{source}: field 'hidden_size' is {dcfg.model.hidden_size}; a DFlash drafter shares the target's "
                f"embedding, expected {target_cfg.hidden_size}"
            )
        bad = [i for i in dcfg.target_layer_ids if i >= target_cfg.num_layers]
        if bad:
            raise CheckpointError(
                f"{source}: field 'target_layer_ids' has {bad}; the target has layers 0..{target_cfg.num_layers - 1}"
            )


def _model_dir(path: str | Path) -> Path:
    model_dir = Path(path)
    if not model_dir.is_dir():
        raise CheckpointError(f"{model_dir}: model directory not found (only local directories are accepted)")
    return model_dir


def _read_config(model_dir: Path) -> tuple[dict[str, Any], str]:
    config_path = model_dir / "config.json"
    if not config_path.is_file():
        raise CheckpointError(f"{config_path}: missing config.json")
    try:
        return json.loads(config_path.read_text()), str(config_path)
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{config_path}: not valid JSON ({e})") from None


def _weight_files(model_dir: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError):
            raise CheckpointError(f"{index}: expected JSON with a 'weight_map' object") from None
        files = {name: model_dir / shard for name, shard in weight_map.items()}
        for shard in sorted(set(files.values())):
            if not shard.is_file():
                raise CheckpointError(f"{shard}: shard listed in {index.name} is missing")
        return files
    single = model_dir / "model.safetensors"
    if not single.is_file():
        raise CheckpointError(f"{model_dir}: no weights: expected model.safetensors or model.safetensors.index.json")
    with safe_open(str(single), framework="pt") as f:
        return {name: single for name in f.keys()}


def _few(names: list[str] | set[str], n: int = 5) -> str:
    names = sorted(names)
    more = f" (and {len(names) - n} more)" if len(names) > n else ""
    return ", ".join(names[:n]) + more


def _load_weights(
    module: nn.Module, model_dir: Path, *, dtype: torch.dtype, device: torch.device | str, optional: set[str]
) -> None:
    """Fill a module built on the meta device from the directory's safetensors, checking names and shapes."""
    files = {n: f for n, f in _weight_files(model_dir).items()
             if not n.endswith(_IGNORED_SUFFIXES) and not n.startswith(_IGNORED_PREFIXES)}
    expected = {name: p.shape for name, p in module.state_dict().items()}
    missing = set(expected) - set(files) - optional
    if missing:
        raise CheckpointError(f"{model_dir}: missing tensors {_few(missing)}")
    unexpected = set(files) - set(expected)
    if unexpected:
        raise CheckpointError(f"{model_dir}: unexpected tensors {_few(unexpected)}")
    tensors: dict[str, torch.Tensor] = {}
    for path in sorted(set(files.values())):
        with safe_open(str(path), framework="pt", device=str(device)) as f:
            for name in f.keys():
                if name not in expected:
                    continue
                shape = tuple(f.get_slice(name).get_shape())
                if shape != tuple(expected[name]):
                    raise CheckpointError(
                        f"{path}: tensor '{name}' has shape {list(shape)}; expected {list(expected[name])}"
                    )
                tensors[name] = f.get_tensor(name).to(dtype)
    module.load_state_dict(tensors, strict=True, assign=True)

"""Reading a local HF model directory: its config.json and its safetensors weights.

This is the one reader of model directories: the IR lowering takes the config from here, the
runtime the config and the tensors. Every way a directory can be wrong (missing, not JSON, not
UTF-8, weights missing or unreadable, a safetensors header that lies, a tensor of the wrong name or
shape) is a `CheckpointError` naming the file and what was expected, never a library traceback.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from ..errors import CheckpointError

CONFIG = "config.json"
SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
# Tensors some HF checkpoints carry that are not weights (recomputed at run time), and Qwen3-Next's
# multi-token-prediction head, which HF skips too.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
IGNORED_PREFIXES = ("mtp.",)


def model_dir(path: str | Path) -> Path:
    """`path` as a model directory, or a CheckpointError saying it is not one."""
    root = Path(path)
    if not root.is_dir():
        raise CheckpointError(f"{root}: model directory not found (only local directories are accepted)")
    return root


def read_json(path: Path, what: str) -> Any:
    """The JSON document at `path`; `what` says what it should be, for the error."""
    try:
        return json.loads(path.read_bytes().decode("utf-8"))
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing {what}") from None
    except UnicodeDecodeError as e:
        raise CheckpointError(f"{path}: not UTF-8 text (byte {e.start}); expected {what}") from None
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: not valid JSON ({e.msg}, line {e.lineno}); expected {what}") from None
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read {what} ({e.strerror})") from None


def read_config(root: Path) -> tuple[dict[str, Any], str]:
    """(the config.json dict, its path as the source every parse error quotes)."""
    path = root / CONFIG
    cfg = read_json(path, "an HF config.json object")
    if not isinstance(cfg, dict):
        raise CheckpointError(f"{path}: expected a JSON object, got {type(cfg).__name__}")
    return cfg, str(path)


def weight_files(root: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it (one file, or the shards of an index)."""
    index = root / INDEX
    if index.is_file():
        doc = read_json(index, "a safetensors index")
        weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise CheckpointError(f"{index}: expected JSON with a 'weight_map' object of tensor name -> shard file")
        files = {name: root / shard for name, shard in weight_map.items()}
        for shard in sorted(set(files.values())):
            if not shard.is_file():
                raise CheckpointError(f"{shard}: shard listed in {index.name} is missing")
        return files
    single = root / SINGLE
    if not single.is_file():
        raise CheckpointError(f"{root}: no weights: expected {SINGLE} or {INDEX}")
    return {name: single for name in _names(single)}


def _names(path: Path) -> list[str]:
    try:
        with safe_open(str(path), framework="pt") as f:
            return list(f.keys())
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(f"{path}: not a readable safetensors file ({_first_line(e)})") from None


def _first_line(e: Exception) -> str:
    text = str(e).strip() or type(e).__name__
    return text.splitlines()[0]


def few(names, n: int = 5) -> str:
    """Up to n sorted names, and how many more there are."""
    names = sorted(names)
    more = f" (and {len(names) - n} more)" if len(names) > n else ""
    return ", ".join(names[:n]) + more


def read_tensors(root: Path, expected: Mapping[str, torch.Size | tuple[int, ...]], *, optional: set[str],
                 dtype: torch.dtype, device: torch.device | str) -> dict[str, torch.Tensor]:
    """The tensors `expected` names (name -> shape), cast to `dtype` on `device`, from the
    directory's safetensors. Tensors the checkpoint lacks must be in `optional`; tensors it has
    beyond `expected` are an error unless HF ignores them too."""
    files = {n: f for n, f in weight_files(root).items()
             if not n.endswith(IGNORED_SUFFIXES) and not n.startswith(IGNORED_PREFIXES)}
    missing = set(expected) - set(files) - optional
    if missing:
        raise CheckpointError(f"{root}: missing tensors {few(missing)}")
    unexpected = set(files) - set(expected)
    if unexpected:
        raise CheckpointError(f"{root}: unexpected tensors {few(unexpected)}")
    tensors: dict[str, torch.Tensor] = {}
    for path in sorted(set(files.values())):
        try:
            with safe_open(str(path), framework="pt", device=str(device)) as f:
                for name in f.keys():
                    if name not in expected:
                        continue
                    shape = tuple(f.get_slice(name).get_shape())
                    if shape != tuple(expected[name]):
                        raise CheckpointError(f"{path}: tensor '{name}' has shape {list(shape)}; "
                                              f"expected {list(expected[name])}")
                    tensors[name] = f.get_tensor(name).to(dtype)
        except (SafetensorError, OSError, ValueError, RuntimeError) as e:
            raise CheckpointError(f"{path}: not a readable safetensors file ({_first_line(e)})") from None
    return tensors

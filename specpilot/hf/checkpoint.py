"""Reading a local HF model directory: its config.json and its safetensors weights.

This is the one reader of model directories: the IR lowering takes the config from here, the
runtime the config and the tensors. Every way a directory can be wrong (missing, not JSON, not
UTF-8, weights missing or unreadable, a safetensors header that lies, a tensor of the wrong name or
shape) is a `CheckpointError` naming the file and what was expected, never a library traceback.
"""

from __future__ import annotations

import json
import math
import re
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
# safetensors' element types and their sizes in bytes (the format's spec)
SAFETENSORS_DTYPES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
                      "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}
MAX_HEADER_BYTES = 100_000_000  # the largest header the safetensors library reads
LAYER_NAME = re.compile(r"^(?:model\.)?layers\.(\d+)\.")  # a decoder layer's weights: model.layers.3. / layers.3.


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
            if not _is_file(shard) or shard.resolve().parent != root.resolve():
                raise CheckpointError(f"{index}: shard {shard.name!r} is missing (expected a file in {root})")
        return files
    single = root / SINGLE
    if not single.is_file():
        raise CheckpointError(f"{root}: no weights: expected {SINGLE} or {INDEX}")
    return {name: single for name in _names(single)}


def _names(path: Path) -> list[str]:
    return [name for name in read_header(path) if name != "__metadata__"]


def read_header(path: Path) -> dict[str, Any]:
    """The header of a safetensors file, checked against the file before any tensor is read: the
    header length fits the file, the header is a JSON object, every tensor names a known dtype, a
    shape of sizes >= 0 and data offsets that hold exactly that many bytes, and the tensors cover
    the data that follows the header without gaps or overlaps. A CheckpointError names the file and
    what is wrong; nothing the header claims is allocated."""
    def bad(what: str) -> CheckpointError:
        return CheckpointError(f"{path}: not a valid safetensors file ({what})")

    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise bad(f"{size} bytes: shorter than the 8-byte header length")
            n = int.from_bytes(head, "little")
            if n > size - 8:
                raise bad(f"the header claims {n} bytes; the file holds {size - 8} after the length")
            if n > MAX_HEADER_BYTES:
                raise bad(f"the header claims {n} bytes; safetensors reads at most {MAX_HEADER_BYTES}")
            raw = f.read(n)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read ({e.strerror or e})") from None
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        raise bad("the header is not JSON text") from None
    if not isinstance(header, dict):
        raise bad(f"the header is a JSON {type(header).__name__}, expected an object")
    data = size - 8 - n
    spans = []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(entry, dict):
            raise bad(f"tensor {name!r}: expected an object with dtype, shape and data_offsets")
        dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
        if dtype not in SAFETENSORS_DTYPES:
            raise bad(f"tensor {name!r}: dtype {dtype!r}; expected one of {', '.join(SAFETENSORS_DTYPES)}")
        if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
            raise bad(f"tensor {name!r}: shape {shape!r}; expected a list of sizes >= 0")
        if (not isinstance(offsets, list) or len(offsets) != 2 or not all(type(o) is int for o in offsets)
                or not 0 <= offsets[0] <= offsets[1] <= data):
            raise bad(f"tensor {name!r}: data_offsets {offsets!r}; expected [begin, end] within the {data} data bytes")
        if offsets[1] - offsets[0] != math.prod(shape) * SAFETENSORS_DTYPES[dtype]:
            raise bad(f"tensor {name!r}: data_offsets {offsets} hold {offsets[1] - offsets[0]} bytes; "
                      f"shape {shape} of {dtype} needs {math.prod(shape) * SAFETENSORS_DTYPES[dtype]}")
        spans.append((offsets[0], offsets[1], name))
    end = 0
    for begin, stop, name in sorted(spans):
        if begin != end:
            raise bad(f"tensor {name!r} starts at data byte {begin}; the tensors before it end at {end}")
        end = stop
    if end != data:
        raise bad(f"the tensors cover {end} of the {data} data bytes (truncated, or bytes appended)")
    return header


def check_layer_count(root: Path, cfg: Mapping[str, Any], source: str) -> None:
    """CheckpointError unless the config's num_hidden_layers is the number of decoder layers the
    directory's weights hold (read from the safetensors headers, before any graph or module of that
    many layers is built)."""
    n = cfg.get("num_hidden_layers")
    if type(n) is not int:
        return  # the config parser names the field
    held = {int(m.group(1)) for name in weight_files(root) if (m := LAYER_NAME.match(name))}
    if held != set(range(n)):
        found = f"layers 0..{max(held)}" if held and held == set(range(max(held) + 1)) else f"{len(held)} layers"
        raise CheckpointError(f"{source}: field 'num_hidden_layers' is {n}; the weights in {root} hold {found}")


def _is_file(path: Path) -> bool:
    try:
        return path.is_file()
    except (OSError, ValueError):  # a name no file system takes: no file
        return False


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
        wanted = [name for name, f in files.items() if f == path and name in expected]
        header = read_header(path)
        for name in wanted:  # every shape checked before any tensor is read
            if name not in header:
                raise CheckpointError(f"{path}: tensor '{name}' is missing (the index lists it in this file)")
            if tuple(header[name]["shape"]) != tuple(expected[name]):
                raise CheckpointError(f"{path}: tensor '{name}' has shape {header[name]['shape']}; "
                                      f"expected {list(expected[name])}")
        try:
            with safe_open(str(path), framework="pt", device=str(device)) as f:
                for name in wanted:
                    tensors[name] = f.get_tensor(name).to(dtype)
        except (SafetensorError, OSError, ValueError, RuntimeError) as e:
            raise CheckpointError(f"{path}: not a readable safetensors file ({_first_line(e)})") from None
    return tensors

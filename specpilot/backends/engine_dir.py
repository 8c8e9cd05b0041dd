"""Engine directories: what serving an engine needs and nothing else, written atomically, read back checked.

Layout:
    engine.json       manifest: engine format, name, pipeline, IR hash, dtype, sources, the specpilot and
                      library versions and the device it was built on, sha256 of every other file
    spec.yaml         the pipeline spec as compiled
    pipeline.txt      the pass pipeline string (reproduces the compilation)
    ir.txt            the optimized IR (parse_program reads it back)
    target/, drafter/ config.json, tokenizer files, and each weight once, in its final format: a weight
                      the passes stored as 12-bit planes (u12.safetensors) is left out of the checkpoint's
                      *.safetensors (rewritten without it), so no bf16 copy sits beside its planes
    kernel_tuning.json  the tuned config tables the engine's kernels were built with (kernels/tuning.py's
                      KernelTuning): loading hands them to the kernels, so a copied engine runs the
                      configs it was built and validated with, whatever the serving install's tables say
    validation.json   the token-forcing report
    report.json, report.md
A compile writes everything into a temporary sibling folder and renames it into place at the end,
so a failed or interrupted compile leaves no half-written engine behind. Loading refuses an engine
whose files fail their checksums or are missing (naming the file), one of another engine format or
specpilot version, and one built on a GPU of another kind (engine.json names what it was built for).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from ..errors import EngineError
from ..formats.digest import file_sha256
from ..kernels.tuning import KernelTuning
from .kernel_hooks import TUNING_TYPES

MANIFEST = "engine.json"
ENGINE_FORMAT = 3  # 2: versions and build device in the manifest; weights stored once, in their final format;
# 3: the kernels' tuned tables in kernel_tuning.json
TUNING_FILE = "kernel_tuning.json"
CHECKPOINT_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json")



@contextmanager
def atomic_dir(final: Path) -> Iterator[Path]:
    """Yield a temporary folder beside `final`; on success it replaces `final`, on error it vanishes."""
    final = Path(final).absolute()
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".tmp", dir=final.parent))
    try:
        yield tmp
        if final.exists():
            old = final.with_name(f".{final.name}.old")
            if old.exists():
                shutil.rmtree(old)
            os.rename(final, old)
            os.rename(tmp, final)
            shutil.rmtree(old)
        else:
            os.rename(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _link_or_copy(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def copy_checkpoint(src: Path, dst: Path, leave_out: frozenset[str] = frozenset()) -> None:
    """Copy a model directory's config, tokenizer and safetensors (hard links where possible), without
    the tensors named in `leave_out` (stored in another format beside it): a safetensors file holding
    one is rewritten without it (its metadata kept), a shard left empty is dropped, and the index's
    weight map follows."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    dst.mkdir(parents=True)
    kept_files: set[str] = set()
    for item in sorted(Path(src).iterdir()):
        if item.name in CHECKPOINT_FILES:
            _link_or_copy(item, dst / item.name)
        elif item.suffix == ".safetensors":
            with safe_open(str(item), framework="pt") as f:
                names, metadata = list(f.keys()), f.metadata()
                if not leave_out.intersection(names):
                    _link_or_copy(item, dst / item.name)
                    kept_files.add(item.name)
                    continue
                tensors = {n: f.get_tensor(n) for n in names if n not in leave_out}
            if tensors:
                save_file(tensors, str(dst / item.name), metadata=metadata)
                kept_files.add(item.name)
    for index in Path(src).glob("*.safetensors.index.json"):
        data = json.loads(index.read_text())
        data["weight_map"] = {n: f for n, f in data.get("weight_map", {}).items()
                              if n not in leave_out and f in kept_files}
        (dst / index.name).write_text(json.dumps(data, indent=2) + "\n")


def write_tuning(root: Path, tuning: KernelTuning) -> None:
    (Path(root) / TUNING_FILE).write_text(json.dumps(tuning.to_json(), indent=1) + "\n")


def read_tuning(root: Path) -> KernelTuning:
    """The engine's kernel_tuning.json (EngineError naming the file, and the table and entry, when it
    is missing or not what write_tuning writes)."""
    path = Path(root) / TUNING_FILE
    if not path.is_file():
        raise EngineError(f"{path}: missing (an engine holds its kernels' tuned tables): recompile the engine")
    try:
        return KernelTuning.from_json(json.loads(path.read_text()), TUNING_TYPES, str(path))
    except json.JSONDecodeError as e:
        raise EngineError(f"{path}: not valid JSON ({e.msg})") from None
    except ValueError as e:
        raise EngineError(str(e)) from None


def write_manifest(root: Path, info: dict) -> None:
    files = {
        str(p.relative_to(root)): file_sha256(p)
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.name != MANIFEST
    }
    (root / MANIFEST).write_text(json.dumps({**info, "files": files}, indent=2) + "\n")


def read_manifest(root: Path) -> dict:
    """Load engine.json and verify every listed file's checksum."""
    root = Path(root)
    path = root / MANIFEST
    if not path.is_file():
        raise EngineError(f"{root}: not an engine directory (no {MANIFEST})")
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise EngineError(f"{path}: not valid JSON ({e.msg})") from None
    for name, digest in manifest.get("files", {}).items():
        f = root / name
        if not f.is_file():
            raise EngineError(f"{root}: file {name} listed in {MANIFEST} is missing")
        if file_sha256(f) != digest:
            raise EngineError(f"{root}: file {name} does not match its checksum in {MANIFEST}")
    return manifest


def check_compatible(root: Path, manifest: dict, version: str, gpu: str) -> None:
    """EngineError unless this specpilot (`version`) on this device (`gpu`: "cpu", or the GPU kind's
    slug, "h200") may serve the engine without recompiling: the same engine format and specpilot
    version, and for an engine built on a GPU the same kind of GPU (its kernel configurations and
    CUDA graphs are that GPU's). An engine built on a CPU runs the torch reference path anywhere."""
    path = Path(root) / MANIFEST
    found = manifest.get("format")
    if found != ENGINE_FORMAT:
        raise EngineError(f"{path}: engine format {found if found is not None else '(none: an older specpilot)'}; "
                          f"this specpilot reads format {ENGINE_FORMAT}: recompile the engine (specpilot compile)")
    if manifest.get("specpilot") != version:
        raise EngineError(f"{path}: built by specpilot {manifest.get('specpilot')}; this is specpilot {version}: "
                          "recompile the engine with this version (specpilot compile)")
    built = manifest.get("built_on", {})
    built_gpu = built.get("gpu", "cpu")
    if built_gpu != "cpu" and built_gpu != gpu:
        here = "no GPU" if gpu == "cpu" else f"a GPU of kind {gpu!r}"
        raise EngineError(f"{path}: field 'built_on.gpu': built for GPU kind {built_gpu!r} "
                          f"({built.get('device', '?')}); this machine has {here}: recompile the engine here")

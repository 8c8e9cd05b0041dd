"""Engine directories: written atomically, read back with their checksums verified.

Layout:
    engine.json       manifest: name, pipeline, IR hash, dtype, sources, sha256 of every file
    spec.yaml         the pipeline spec as compiled
    pipeline.txt      the pass pipeline string (reproduces the compilation)
    ir.txt            the optimized IR (parse_program reads it back)
    target/, drafter/ checkpoints as the passes left them (config.json, *.safetensors, tokenizer.json)
    validation.json   the token-forcing report
    report.json, report.md
A compile writes everything into a temporary sibling folder and renames it into place at the end,
so a failed or interrupted compile leaves no half-written engine behind.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from ..errors import EngineError

MANIFEST = "engine.json"
CHECKPOINT_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json")


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


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


def copy_checkpoint(src: Path, dst: Path) -> None:
    """Copy a model directory's config, tokenizer and safetensors (hard links where possible)."""
    dst.mkdir(parents=True)
    for item in sorted(Path(src).iterdir()):
        if item.name in CHECKPOINT_FILES or item.suffix == ".safetensors" or item.name.endswith(".safetensors.index.json"):
            try:
                os.link(item, dst / item.name)
            except OSError:
                shutil.copy2(item, dst / item.name)


def write_manifest(root: Path, info: dict) -> None:
    files = {
        str(p.relative_to(root)): sha256_file(p)
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
        if sha256_file(f) != digest:
            raise EngineError(f"{root}: file {name} does not match its checksum in {MANIFEST}")
    return manifest

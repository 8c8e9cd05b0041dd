"""The model zoo: small trained pairs shipped with specpilot (`specpilot.zoo`), each a folder of
target/, dflash/ and pard/ HF model directories with model cards. Retrain with train/train_zoo.py.

Stored compressed, so that the tree travels (one GPU call takes at most 64 MiB of it): every large
file (weights, tokenizer) as `NAME.xz`, plain xz that `xz -d` (or Python's lzma) turns back into
NAME, and `manifest.json` beside the pair's folders lists every file's sha256 and size as used.
`pair_dir(name, cache)` materializes the plain directories once into `cache/zoo/<name>-<key>/`,
key: a digest of the stored files' sha256, written into a temporary sibling and renamed into place
(concurrent processes are safe: the first rename wins, the others drop their copy); every file is
checked against the manifest on the way, so a materialized model is the trained one byte for byte.
`store_pair` writes that stored form from a plain pair folder (the training scripts' writer).
"""

from __future__ import annotations

import hashlib
import json
import lzma
import os
import shutil
import tempfile
from importlib.resources import files
from pathlib import Path

from ..errors import CheckpointError

PAIRS = ("code-qwen3", "code-qwen3-next")
MANIFEST = "manifest.json"
SUFFIX = ".xz"
COMPRESSED = (".safetensors", "tokenizer.json")  # file names ending so are stored as NAME.xz
# bf16 weights come in 2-byte units: no literal context, 2-byte positions. code-qwen3's target:
# 0.688 of its bytes (xz -6: 0.705, xz -9e: 0.704). Text (tokenizer.json): xz -9's defaults.
WEIGHT_FILTERS = ({"id": lzma.FILTER_LZMA2, "preset": 9, "lc": 0, "lp": 1, "pb": 1},)
TEXT_FILTERS = ({"id": lzma.FILTER_LZMA2, "preset": 9},)
CHUNK = 1 << 20


def pair_source(name: str) -> Path:
    """The pair's stored folder inside the package (compressed files and the manifest)."""
    return Path(str(files(__name__) / name))


def pair_dir(name: str, cache: Path) -> Path:
    """The pair's plain HF directories (target/, dflash/, pard/), materialized under `cache` once."""
    return materialize(pair_source(name), cache)


def file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
    return h.hexdigest()


def stored_files(src: Path) -> list[Path]:
    return sorted(p for p in src.rglob("*") if p.is_file() and not p.name.endswith(".tmp"))


_KEYS: dict[tuple, str] = {}  # memo: the stored files' (path, size, mtime) -> their key


def stored_key(src: Path) -> str:
    """sha256 over every stored file's relative path and sha256 (hashed once per process while unchanged)."""
    stamp = tuple((str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in stored_files(src))
    if stamp not in _KEYS:
        h = hashlib.sha256()
        for p in stored_files(src):
            h.update(f"{p.relative_to(src).as_posix()} {file_digest(p)}\n".encode())
        _KEYS[stamp] = h.hexdigest()
    return _KEYS[stamp]


def materialize(src: Path, cache: Path) -> Path:
    """cache/zoo/<src's name>-<key>/: `src`'s files with every NAME.xz decompressed to NAME, each
    checked against src/manifest.json (a CheckpointError naming the file where one differs)."""
    if not (src / MANIFEST).is_file():
        raise CheckpointError(f"{src / MANIFEST}: missing (a zoo pair lists its files' sha256 there; "
                              f"write the folder with specpilot.zoo.store_pair)")
    out = cache / "zoo" / f"{src.name}-{stored_key(src)[:16]}"
    if (out / MANIFEST).is_file():  # the manifest is copied last: its presence means complete
        return out
    try:
        expected = json.loads((src / MANIFEST).read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{src / MANIFEST}: not a zoo manifest with a 'files' object ({e})") from None
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        written = set()
        for path in stored_files(src):
            rel = path.relative_to(src).as_posix()
            if rel == MANIFEST:
                continue
            plain = rel.removesuffix(SUFFIX)
            entry = expected.get(plain)
            if not isinstance(entry, dict):
                raise CheckpointError(f"{src / MANIFEST}: no entry for {plain} (stored as {rel})")
            dst = tmp / plain
            dst.parent.mkdir(parents=True, exist_ok=True)
            sha = copy_plain(path, dst, rel.endswith(SUFFIX))
            if sha != entry.get("sha256"):
                raise CheckpointError(f"{path}: gives a file of sha256 {sha}; {src / MANIFEST} records "
                                      f"{entry.get('sha256')} for {plain}")
            written.add(plain)
        if missing := sorted(set(expected) - written):
            raise CheckpointError(f"{src}: missing {', '.join(missing)} (listed in {MANIFEST})")
        shutil.copyfile(src / MANIFEST, tmp / MANIFEST)
        try:
            os.rename(tmp, out)
        except OSError:  # another process materialized it first
            if not (out / MANIFEST).is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def copy_plain(src: Path, dst: Path, compressed: bool) -> str:
    """dst = src (decompressed when `compressed`); returns dst's sha256."""
    h = hashlib.sha256()
    with open(src, "rb") as raw, open(dst, "wb") as out:
        f = lzma.open(raw, "rb") if compressed else raw
        try:
            while chunk := f.read(CHUNK):
                h.update(chunk)
                out.write(chunk)
        except lzma.LZMAError as e:
            raise CheckpointError(f"{src}: not a valid xz file ({e})") from None
    return h.hexdigest()


def store_pair(plain: Path, dest: Path, names: tuple[str, ...] | None = None) -> dict:
    """dest/ = the stored form of a plain pair folder (only its entries `names`, when given): files
    named as COMPRESSED says as NAME.xz, the rest as they are, and manifest.json (every plain file's
    sha256 and size). Written into a temporary sibling and renamed over dest; returns the manifest."""
    if names is not None and (missing := [n for n in names if not (plain / n).exists()]):
        raise CheckpointError(f"{plain}: missing {', '.join(missing)}")
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
    try:
        manifest = {"format": "specpilot zoo pair", "compression": "xz (LZMA2 preset 9; weights lc 0, lp 1, pb 1): "
                    "`xz -d NAME.xz` gives NAME", "files": {}}
        for path in stored_files(plain):
            rel = path.relative_to(plain).as_posix()
            if rel == MANIFEST or (names is not None and rel.split("/")[0] not in names):
                continue
            data = path.read_bytes()
            manifest["files"][rel] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
            out = tmp / rel
            out.parent.mkdir(parents=True, exist_ok=True)
            if path.name.endswith(COMPRESSED):
                out = out.with_name(out.name + SUFFIX)
                filters = WEIGHT_FILTERS if path.name.endswith(".safetensors") else TEXT_FILTERS
                data = lzma.compress(data, format=lzma.FORMAT_XZ, check=lzma.CHECK_CRC64, filters=list(filters))
                manifest["files"][rel]["stored"] = out.relative_to(tmp).as_posix()
            out.write_bytes(data)
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
        old = dest.with_name(f".{dest.name}.old{os.getpid()}")
        if dest.exists():
            os.rename(dest, old)
        os.rename(tmp, dest)
        shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return manifest

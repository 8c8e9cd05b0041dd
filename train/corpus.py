"""The training corpus: this machine's CPython standard library sources (Lib/*.py), normalised.

    python -m train.corpus --out .cache/zoo

writes, deterministically (same bytes for the same Lib/ and the same arguments):

- `corpus.jsonl.gz`: one {"path", "text"} object per training file, sorted by path;
- `heldout.jsonl.gz`: the same for the held-out files (HELDOUT_MODULES and their tests), which
  are never trained on: the held-out loss and the `code-heldout` prompt set come from them;
- `manifest.json`: Python version, counts, the rules below, and the sha256 of each file's
  uncompressed JSONL (gzip is written with mtime 0, but zlib versions may differ, so the digest
  is taken before compression).

Rules: every `*.py` under Lib/ except the folders in EXCLUDED_DIRS; files that are not UTF-8 or
hold a line longer than MAX_LINE characters (data blobs) are skipped and listed in the manifest.
Text: a leading BOM dropped, NFC, newlines as "\\n", trailing whitespace stripped from every
line, exactly one final newline; files empty after that are skipped.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import platform
import sysconfig
import unicodedata
from collections.abc import Iterator
from pathlib import Path

CORPUS_FILE = "corpus.jsonl.gz"
HELDOUT_FILE = "heldout.jsonl.gz"
MANIFEST_FILE = "manifest.json"

# Folders of Lib/ never read: installed packages, compiled and generated files, codec tables.
EXCLUDED_DIRS = ("site-packages", "lib-dynload", "__pycache__", "pydoc_data", "encodings", "config-*")
MAX_LINE = 1000

# Modules kept out of training: pure Python, with documented functions, present in CPython
# 3.10 to 3.13. Their tests (test/test_<name>.py) are held out with them.
HELDOUT_MODULES = (
    "base64", "bisect", "calendar", "difflib", "filecmp", "fileinput", "fnmatch", "fractions",
    "glob", "heapq", "ipaddress", "pprint", "quopri", "secrets", "shlex", "statistics",
    "textwrap", "timeit", "zipapp",
)


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def heldout_paths() -> frozenset[str]:
    """Lib/-relative paths of the held-out files (modules and their tests)."""
    return frozenset(p for m in HELDOUT_MODULES for p in (f"{m}.py", f"test/test_{m}.py"))


def normalize(text: str) -> str:
    text = unicodedata.normalize("NFC", text.removeprefix("\ufeff"))
    lines = text.replace("\r\n", "\n").replace("\r", "\n").split("\n")
    body = "\n".join(line.rstrip() for line in lines).strip("\n")
    return body + "\n" if body else ""


def _excluded(rel: Path) -> bool:
    return any(part == d or (d.endswith("*") and part.startswith(d[:-1])) for part in rel.parts[:-1] for d in EXCLUDED_DIRS)


def source_files(root: Path) -> list[str]:
    """Lib/-relative posix paths of the candidate files, sorted (code point order)."""
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*.py") if not _excluded(p.relative_to(root)))


def read_source(root: Path, rel: str) -> tuple[str | None, str]:
    """(normalised text, "") or (None, why it was skipped)."""
    try:
        text = (root / rel).read_bytes().decode("utf-8")
    except UnicodeDecodeError:
        return None, "not UTF-8"
    text = normalize(text)
    if not text:
        return None, "empty"
    if max(len(line) for line in text.split("\n")) > MAX_LINE:
        return None, f"a line longer than {MAX_LINE} characters"
    return text, ""


def jsonl_bytes(docs: list[dict[str, str]]) -> bytes:
    return b"".join((json.dumps(d, ensure_ascii=False, sort_keys=True) + "\n").encode("utf-8") for d in docs)


def write_gzip(path: Path, data: bytes) -> None:
    """gzip without a file name or time stamp in its header, so equal data gives equal files."""
    with open(path, "wb") as raw, gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0, compresslevel=9) as f:
        f.write(data)


def read_docs(path: str | Path) -> list[dict[str, str]]:
    """The {"path", "text"} records of a corpus.jsonl.gz / heldout.jsonl.gz file."""
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def sha256_of_docs(path: str | Path) -> str:
    with gzip.open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def build_corpus(out_dir: str | Path, root: Path | None = None, max_files: int | None = None) -> dict:
    """Write the corpus, held-out and manifest files into out_dir; returns the manifest.

    max_files keeps the first n training candidates in sorted order, and every held-out file
    (small corpora for tests).
    """
    root = Path(root) if root is not None else stdlib_root()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    held = heldout_paths()
    train_docs, heldout_docs, skipped = [], [], {}
    for rel in source_files(root):
        if max_files is not None and rel not in held and len(train_docs) + len(skipped) >= max_files:
            continue
        text, why = read_source(root, rel)
        if text is None:
            skipped[rel] = why
            continue
        (heldout_docs if rel in held else train_docs).append({"path": rel, "text": text})
    manifest = {
        "python": platform.python_version(),
        "source": "CPython standard library Lib/*.py",
        "excluded_dirs": list(EXCLUDED_DIRS),
        "max_line": MAX_LINE,
        "normalization": "BOM dropped, NFC, \\n newlines, trailing whitespace stripped, one final newline",
        "max_files": max_files,
        "heldout_modules": list(HELDOUT_MODULES),
        "skipped": skipped,
    }
    for name, docs, key in ((CORPUS_FILE, train_docs, "corpus"), (HELDOUT_FILE, heldout_docs, "heldout")):
        data = jsonl_bytes(docs)
        write_gzip(out / name, data)
        manifest[key] = {
            "file": name,
            "files": len(docs),
            "chars": sum(len(d["text"]) for d in docs),
            "sha256": hashlib.sha256(data).hexdigest(),
        }
    manifest["heldout"]["paths"] = [d["path"] for d in heldout_docs]
    previous = _read_manifest(out)
    if "tokenizer" in previous and previous.get("corpus", {}).get("sha256") == manifest["corpus"]["sha256"]:
        manifest["tokenizer"] = previous["tokenizer"]  # still trained on this very corpus
    write_manifest(out, manifest)
    return manifest


def _read_manifest(out: Path) -> dict:
    path = out / MANIFEST_FILE
    return json.loads(path.read_text()) if path.is_file() else {}


def write_manifest(out: Path, manifest: dict) -> None:
    (Path(out) / MANIFEST_FILE).write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")


def iter_texts(path: str | Path) -> Iterator[str]:
    for doc in read_docs(path):
        yield doc["text"]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=".cache/zoo", help="output folder (default .cache/zoo)")
    ap.add_argument("--root", default=None, help="Lib/ folder (default: this Python's stdlib)")
    ap.add_argument("--max-files", type=int, default=None, help="only the first N training files (tests)")
    args = ap.parse_args(argv)
    m = build_corpus(args.out, Path(args.root) if args.root else None, args.max_files)
    c, h = m["corpus"], m["heldout"]
    print(f"corpus: {c['files']} files, {c['chars']} chars, sha256 {c['sha256']}")
    print(f"held out: {h['files']} files, {h['chars']} chars, sha256 {h['sha256']}")
    print(f"skipped: {len(m['skipped'])} files; written to {Path(args.out) / MANIFEST_FILE}")


if __name__ == "__main__":
    main()

"""The `code-heldout` prompt set: signatures and docstrings of functions the zoo never trained on.

    python -m train.heldout_prompts --data .cache/zoo

reads `heldout.jsonl.gz` (the held-out modules, see train/corpus.py) and writes
specpilot/bench/data/code-heldout.jsonl: one {"prompt", "source"} per public function or method
with a docstring and a body, in source order, at most PER_MODULE per module. A prompt runs from
the `def` line (decorators included; for a method, the class line first) through the end of the
docstring, so a model continues with the body, as in HumanEval. Test files are not used.
"""

from __future__ import annotations

import argparse
import ast
import json
from pathlib import Path

from train.corpus import HELDOUT_FILE, read_docs

OUT_FILE = Path(__file__).resolve().parents[1] / "specpilot" / "bench" / "data" / "code-heldout.jsonl"
PER_MODULE = 6
MAX_CHARS = 1200


def _prompt(lines: list[str], fn: ast.FunctionDef | ast.AsyncFunctionDef, cls: ast.ClassDef | None) -> str:
    first = min([fn.lineno, *(d.lineno for d in fn.decorator_list)])
    doc_end = fn.body[0].end_lineno
    head = [lines[cls.lineno - 1]] if cls is not None else []
    return "\n".join(head + lines[first - 1 : doc_end]) + "\n"


def _functions(tree: ast.Module):
    """(function, enclosing class or None) in source order: top-level functions and class methods."""
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node, None
        elif isinstance(node, ast.ClassDef):
            for sub in node.body:
                if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    yield sub, node


def prompts_of_module(path: str, text: str, limit: int | None = PER_MODULE) -> list[dict[str, str]]:
    """The module's prompts in source order, at most `limit` (None: all)."""
    lines = text.split("\n")
    out = []
    for fn, cls in _functions(ast.parse(text)):
        if fn.name.startswith("_") or ast.get_docstring(fn) is None or len(fn.body) < 2:
            continue
        if cls is not None and cls.name.startswith("_"):
            continue
        prompt = _prompt(lines, fn, cls)
        if len(prompt) > MAX_CHARS:
            continue
        name = f"{cls.name}.{fn.name}" if cls is not None else fn.name
        out.append({"prompt": prompt, "source": f"{path}:{name}"})
        if len(out) == limit:
            break
    return out


def training_prompts(docs: list[dict[str, str]]) -> list[dict[str, str]]:
    """Every prompt of the training corpus's modules (the zoo's distillation prompts, which have the
    shape of HumanEval's); files that do not parse under this Python are skipped."""
    out = []
    for d in docs:
        if d["path"].startswith("test/"):
            continue
        try:
            out += prompts_of_module(d["path"], d["text"], limit=None)
        except SyntaxError:
            continue
    return out


def build_prompts(data_dir: str | Path, out_file: Path = OUT_FILE) -> list[dict[str, str]]:
    docs = [d for d in read_docs(Path(data_dir) / HELDOUT_FILE) if not d["path"].startswith("test/")]
    records = [r for d in docs for r in prompts_of_module(d["path"], d["text"])]
    out_file.parent.mkdir(parents=True, exist_ok=True)
    out_file.write_text("".join(json.dumps(r, ensure_ascii=False, sort_keys=True) + "\n" for r in records))
    return records


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", default=".cache/zoo", help="folder holding heldout.jsonl.gz (default .cache/zoo)")
    ap.add_argument("--out", default=str(OUT_FILE))
    args = ap.parse_args(argv)
    records = build_prompts(args.data, Path(args.out))
    print(f"{len(records)} prompts from {len({r['source'].split(':')[0] for r in records})} modules -> {args.out}")


if __name__ == "__main__":
    main()

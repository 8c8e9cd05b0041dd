"""Prompt sets for benchmarks and validation: built-in names, or a .jsonl file of {"prompt": ...}."""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import SpecError

# A few code prompts that need no package and no file: the default for smoke runs.
CODE_SMOKE = [
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "import os\n\n\ndef list_python_files(root):\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n",
    'def is_palindrome(text: str) -> bool:\n    """Check whether text reads the same backwards."""\n',
    "for i in range(10):\n    if i % 2 == 0:\n",
    "def merge_sorted(a, b):\n    result = []\n    i = j = 0\n",
    "with open(path) as f:\n    for line in f:\n",
    'def parse_args(argv):\n    """Parse command-line arguments."""\n    import argparse\n',
]

PROMPT_SETS = {"code-smoke": lambda: list(CODE_SMOKE)}


def load_jsonl(path: Path) -> list[str]:
    prompts = []
    for n, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise SpecError(f"{path}:{n}: not valid JSON ({e.msg})") from None
        if not isinstance(record, dict) or not isinstance(record.get("prompt"), str):
            raise SpecError(f"{path}:{n}: expected an object with a string field 'prompt'")
        prompts.append(record["prompt"])
    if not prompts:
        raise SpecError(f"{path}: no prompts")
    return prompts


def load_prompts(name_or_path: str, limit: int | None = None, source: str = "pipeline.yaml") -> list[str]:
    """The prompts of a named set or a .jsonl file, the first `limit` of them."""
    if name_or_path in PROMPT_SETS:
        prompts = PROMPT_SETS[name_or_path]()
    elif name_or_path.endswith(".jsonl"):
        path = Path(name_or_path)
        if not path.is_file():
            raise SpecError(f"{source}: field 'benchmark.prompts': no such file {name_or_path!r}")
        prompts = load_jsonl(path)
    else:
        known = ", ".join(sorted(PROMPT_SETS))
        raise SpecError(f"{source}: field 'benchmark.prompts': expected a prompt-set name ({known}) "
                        f"or a .jsonl path, got {name_or_path!r}")
    return prompts[:limit] if limit else prompts

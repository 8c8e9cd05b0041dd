"""JSON-lines text files of strings (prompt sets, corpora, held-out source lists), read with
errors that name the file and the line."""

from __future__ import annotations

import json

from .errors import SpecError


def json_records(text: str, path: str):
    """(line number, parsed value) of each non-blank JSON line; errors name `path` and the line."""
    for n, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            yield n, json.loads(line)
        except json.JSONDecodeError as e:
            raise SpecError(f"{path}:{n}: not valid JSON ({e.msg})") from None
        except RecursionError:
            raise SpecError(f"{path}:{n}: JSON nested too deeply") from None


def parse_jsonl(text: str, path: str, fields: tuple[str, ...] = ("prompt",)) -> list[str]:
    """The first of `fields` present in each JSON line (a prompt set: 'prompt'); `path` names the
    source in errors."""
    prompts = []
    for n, record in json_records(text, path):
        value = next((record[f] for f in fields if f in record), None) if isinstance(record, dict) else None
        if not isinstance(value, str):
            names = " or ".join(f"'{f}'" for f in fields)
            raise SpecError(f"{path}:{n}: expected an object with a string field {names}")
        prompts.append(value)
    if not prompts:
        raise SpecError(f"{path}: no {fields[0]}s")
    return prompts

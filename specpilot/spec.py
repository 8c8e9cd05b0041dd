"""pipeline.yaml: the deployment a user asks specpilot to compile, validated on load.

    name: demo
    target: tiny-qwen3              # a built-in model name, or a local HF model directory
    drafter:
      kind: dflash                  # dflash | pard
      path: tiny-qwen3/dflash       # built-in drafter or local directory (default: the built-in pair's)
      block_size: 8                 # optional: overrides the drafter config's own
    gpu: h200                       # a GPU of the database, or an alias such as a100 (`--gpu` overrides it)
    serving:
      batch_sizes: [1]              # only [1] until batching exists
      max_new_tokens: 64
      greedy: true                  # only greedy decoding is supported
    benchmark:
      prompts: code-smoke           # a prompt-set name, or a .jsonl file ({"prompt": ...} per line)
      num_prompts: 4
    passes: "draft-block-size{size=8}"   # optional pass pipeline
    rules: [rules/mine.rules]       # optional DSL files defining custom passes
    plugins: [my_passes.py]         # optional Python plugins (trusted code, imported): local module
                                    # files, or installed plugin distributions by name
    dtype: auto                     # auto (bf16 on a GPU, fp32 on CPU) | float32 | bfloat16

Every error names the file, the field and what was expected. Relative paths are taken relative
to the directory of the YAML file. `name` names the default engine directory (engines/NAME), so
it is one plain path component.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from .cost.gpu import resolve_gpu
from .errors import SpecError

DRAFTER_KINDS = ("dflash", "pard")
DTYPES = ("auto", "float32", "bfloat16")  # auto: bf16 on a GPU, fp32 on CPU
BUILTIN_PREFIX = "builtin:"
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")  # one path component, never "." or ".."


@dataclass(frozen=True)
class DrafterSpec:
    kind: str
    path: str | None = None
    block_size: int | None = None


@dataclass(frozen=True)
class ServingSpec:
    batch_sizes: tuple[int, ...] = (1,)
    max_new_tokens: int = 64
    greedy: bool = True


@dataclass(frozen=True)
class BenchmarkSpec:
    prompts: str = "code-smoke"
    num_prompts: int = 4


@dataclass(frozen=True)
class PipelineSpec:
    source: str
    name: str
    target: str
    drafter: DrafterSpec
    gpu: str
    serving: ServingSpec = field(default_factory=ServingSpec)
    benchmark: BenchmarkSpec = field(default_factory=BenchmarkSpec)
    passes: str = ""
    rules: tuple[str, ...] = ()
    plugins: tuple[str, ...] = ()
    dtype: str = "auto"

    def with_gpu(self, gpu: str | None, where: str = "--gpu") -> "PipelineSpec":
        """The spec for another GPU (its database name; `where` names the source in an error)."""
        if gpu is None:
            return self
        try:
            return replace(self, gpu=resolve_gpu(gpu))
        except SpecError as e:
            raise SpecError(f"{where}: {e}") from None

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "target": self.target,
            "drafter": {k: v for k, v in vars(self.drafter).items() if v is not None},
            "gpu": self.gpu,
            "serving": {"batch_sizes": list(self.serving.batch_sizes), "max_new_tokens": self.serving.max_new_tokens,
                        "greedy": self.serving.greedy},
            "benchmark": vars(self.benchmark).copy(),
            "passes": self.passes,
            "rules": list(self.rules),
            "plugins": list(self.plugins),
            "dtype": self.dtype,
        }


class _Reader:
    """Reads one mapping of the YAML document, naming `file: field` in every error."""

    def __init__(self, source: str, data: Any, prefix: str = ""):
        self.source, self.prefix = source, prefix
        if not isinstance(data, dict):
            where = f"field '{prefix[:-1]}'" if prefix else "the document"
            raise SpecError(f"{source}: {where}: expected a mapping, got {_show(data)}")
        self.data = data
        self.seen: set[str] = set()

    def fail(self, key: str, expected: str, got: Any) -> SpecError:
        return SpecError(f"{self.source}: field '{self.prefix}{key}': expected {expected}, got {_show(got)}")

    def get(self, key: str, kind: type | tuple, expected: str, default: Any = ..., check=None) -> Any:
        self.seen.add(key)
        if key not in self.data or self.data[key] is None:
            if default is ...:
                raise SpecError(f"{self.source}: missing field '{self.prefix}{key}' ({expected})")
            return default
        value = self.data[key]
        if isinstance(value, bool) and kind in (int, str):
            raise self.fail(key, expected, value)
        if not isinstance(value, kind) or (check is not None and not check(value)):
            raise self.fail(key, expected, value)
        return value

    def sub(self, key: str) -> "_Reader":
        self.seen.add(key)
        return _Reader(self.source, self.data.get(key) or {}, f"{self.prefix}{key}.")

    def finish(self) -> None:
        unknown = sorted((str(k) for k in self.data if k not in self.seen))  # YAML keys may be numbers, dates, ...
        if unknown:
            known = ", ".join(sorted(self.seen))
            raise SpecError(f"{self.source}: unknown field {self.prefix + unknown[0][:40]!r} (known fields here: {known})")


def _show(value: Any) -> str:
    if isinstance(value, (dict, list)):
        return type(value).__name__
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _positive(v) -> bool:
    return v >= 1


def parse_spec(data: Any, source: str) -> PipelineSpec:
    r = _Reader(source, data)
    name = r.get("name", str, "a name of letters, digits, '.', '_' and '-' (it names the engine directory)",
                 default=Path(source).stem, check=NAME.fullmatch)
    if not NAME.fullmatch(name):  # the file's own stem, when `name` is not given
        raise SpecError(f"{source}: missing field 'name': the file name {name!r} is no engine directory name; "
                        f"expected a name of letters, digits, '.', '_' and '-'")
    target = r.get("target", str, "a built-in model name or a local model directory")
    d = r.sub("drafter")
    drafter = DrafterSpec(
        kind=d.get("kind", str, f"one of {', '.join(DRAFTER_KINDS)}", check=lambda v: v in DRAFTER_KINDS),
        path=d.get("path", str, "a built-in drafter name or a local model directory", default=None),
        block_size=d.get("block_size", int, "an integer >= 1", default=None, check=_positive),
    )
    d.finish()
    gpu = r.get("gpu", str, "a GPU name such as h200", default="h200")
    try:
        gpu = resolve_gpu(gpu)
    except SpecError as e:
        raise SpecError(f"{source}: field 'gpu': {e}") from None
    s = r.sub("serving")
    batch = s.get("batch_sizes", list, "[1] (batching is not implemented yet)", default=[1],
                  check=lambda v: v == [1] and type(v[0]) is int)
    serving = ServingSpec(
        batch_sizes=tuple(batch),
        max_new_tokens=s.get("max_new_tokens", int, "an integer >= 1", default=64, check=_positive),
        greedy=s.get("greedy", bool, "true (only greedy decoding is supported)", default=True, check=lambda v: v is True),
    )
    s.finish()
    b = r.sub("benchmark")
    bench = BenchmarkSpec(
        prompts=b.get("prompts", str, "a prompt-set name or a .jsonl path", default="code-smoke"),
        num_prompts=b.get("num_prompts", int, "an integer >= 1", default=4, check=_positive),
    )
    b.finish()
    passes = r.get("passes", str, "a pass pipeline string", default="")
    rules = r.get("rules", list, "a list of rule file paths", default=[],
                  check=lambda v: all(isinstance(x, str) for x in v))
    plugins = r.get("plugins", list, "a list of plugins: local module files (.py) or installed plugin names",
                    default=[], check=lambda v: all(isinstance(x, str) and x for x in v))
    dtype = r.get("dtype", str, f"one of {', '.join(DTYPES)}", default="auto", check=lambda v: v in DTYPES)
    r.finish()
    base = Path(source).parent
    return PipelineSpec(
        source=source,
        name=name,
        target=_resolve(target, base),
        drafter=replace(drafter, path=_resolve(drafter.path, base) if drafter.path else None),
        gpu=gpu,
        serving=serving,
        benchmark=replace(bench, prompts=_resolve(bench.prompts, base) if bench.prompts.endswith(".jsonl") else bench.prompts),
        passes=passes,
        rules=tuple(_resolve(x, base) for x in rules),
        plugins=tuple(_resolve(x, base) if x.endswith(".py") else x for x in plugins),
        dtype=dtype,
    )


def _resolve(value: str, base: Path) -> str:
    """Paths that exist relative to the spec's folder become absolute; names stay names (and so do
    strings no file system takes: too long, NUL bytes)."""
    candidate = base / value
    try:
        if not Path(value).is_absolute() and candidate.exists():
            return str(candidate.resolve())
    except (OSError, ValueError):
        pass
    return value


def load_spec(path: str | Path) -> PipelineSpec:
    path = Path(path)
    source = str(path)
    if not path.is_file():
        raise SpecError(f"{source}: no such file")
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise SpecError(f"{source}: not UTF-8 text (byte {e.start}); expected a YAML pipeline spec") from None
    except OSError as e:
        raise SpecError(f"{source}: cannot read ({e.strerror or e})") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f":{mark.line + 1}:{mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or "not valid YAML"
        raise SpecError(f"{source}{where}: {problem}") from None
    except RecursionError:
        raise SpecError(f"{source}: nested too deeply to be a pipeline spec") from None
    return parse_spec(data, source)

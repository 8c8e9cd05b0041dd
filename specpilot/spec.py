"""pipeline.yaml: the deployment a user asks specpilot to compile, validated on load.

    name: demo
    target: tiny-qwen3              # a built-in model name, or a local HF model directory, or by shape:
                                    # {shape: llama-3.1-8b | qwen3-8b | ..., weights: random, seed: 0}
    drafter:
      kind: dflash                  # dflash | pard | replay
      path: tiny-qwen3/dflash       # built-in drafter or local directory (default: the built-in pair's)
      block_size: 8                 # optional: overrides the drafter config's own
      # kind replay: profile: dflash-qwen3-8b (specpilot/profiles), shape: dflash | pard (default: the
      # profile's), benchmark: humaneval (default: the profile's), seed: 0 (the accept-length draws)
    gpu: h200                       # a GPU of the database, or an alias such as a100 (`--gpu` overrides it)
    serving:
      batch_sizes: [1]              # concurrencies compile measures (batched engine above 1)
      max_new_tokens: 64
      greedy: true                  # compiled and token-forced greedy (sampling is chosen per request)
    benchmark:
      prompts: code-smoke           # a prompt-set name (ifeval: through the target's chat template), or a .jsonl file ({"prompt": ...} per line)
      num_prompts: 4
    passes: "draft-block-size{size=8}"   # optional pass pipeline
    rules: [rules/mine.rules]       # optional DSL files defining custom passes
    plugins: [my_passes.py]         # optional Python plugins (trusted code, imported): local module
                                    # files, or installed plugin distributions by name
    dtype: auto                     # auto (bf16 on a GPU, fp32 on CPU) | float32 | bfloat16
    backend: torch                  # torch | trtllm (also writes TensorRT-LLM artifacts: PARD drafters only)

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
from .hf.known import SHAPES
from .profiles import DRAFTER_SHAPES, ProfileError, load_profile, profile_names

DRAFTER_KINDS = ("dflash", "pard", "replay")
TARGET_WEIGHTS = ("random",)  # a target given by shape: N(0, 0.02) weights built on the device, seeded
DTYPES = ("auto", "float32", "bfloat16")  # auto: bf16 on a GPU, fp32 on CPU
BACKENDS = ("torch", "trtllm")  # trtllm: the torch engine plus TensorRT-LLM artifacts (backends/trtllm.py)
BUILTIN_PREFIX = "builtin:"
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")  # one path component, never "." or ".."


@dataclass(frozen=True)
class ShapeTarget:
    """A target given by a released model's shape (specpilot/hf/known.py) instead of its weights."""

    shape: str
    weights: str = "random"
    seed: int = 0


@dataclass(frozen=True)
class DrafterSpec:
    kind: str
    path: str | None = None
    block_size: int | None = None
    profile: str | None = None  # replay: the acceptance profile its accept lengths are drawn from
    shape: str | None = None  # replay: the drafter network it runs (random weights): dflash | pard
    benchmark: str | None = None  # replay: the profile's benchmark
    seed: int = 0  # replay: the seed of the accept-length draws and of the drafter's weights

    def to_dict(self) -> dict:
        out = {k: v for k, v in vars(self).items() if v is not None}
        if self.kind != "replay":
            out.pop("seed")
        return out


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
    target_shape: ShapeTarget | None = None  # set when `target` names a shape (then `target` is its name)
    backend: str = "torch"

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
            "target": vars(self.target_shape).copy() if self.target_shape else self.target,
            "drafter": self.drafter.to_dict(),
            "gpu": self.gpu,
            "serving": {"batch_sizes": list(self.serving.batch_sizes), "max_new_tokens": self.serving.max_new_tokens,
                        "greedy": self.serving.greedy},
            "benchmark": vars(self.benchmark).copy(),
            "passes": self.passes,
            "rules": list(self.rules),
            "plugins": list(self.plugins),
            "dtype": self.dtype,
            **({"backend": self.backend} if self.backend != "torch" else {}),
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
    target_shape = None
    if isinstance(r.data.get("target"), dict):
        t = r.sub("target")
        target_shape = ShapeTarget(
            shape=t.get("shape", str, f"one of {', '.join(SHAPES)}", check=lambda v: v in SHAPES),
            weights=t.get("weights", str, f"one of {', '.join(TARGET_WEIGHTS)}", default="random",
                          check=lambda v: v in TARGET_WEIGHTS),
            seed=t.get("seed", int, "an integer >= 0", default=0, check=lambda v: v >= 0),
        )
        t.finish()
        target = target_shape.shape
    else:
        target = r.get("target", str, "a built-in model name, a local model directory, or {shape: ..., weights: random}")
    d = r.sub("drafter")
    drafter = DrafterSpec(
        kind=d.get("kind", str, f"one of {', '.join(DRAFTER_KINDS)}", check=lambda v: v in DRAFTER_KINDS),
        path=d.get("path", str, "a built-in drafter name or a local model directory", default=None),
        block_size=d.get("block_size", int, "an integer >= 1", default=None, check=_positive),
        profile=d.get("profile", str, f"one of {', '.join(profile_names())}", default=None),
        shape=d.get("shape", str, f"one of {', '.join(DRAFTER_SHAPES)}", default=None,
                    check=lambda v: v in DRAFTER_SHAPES),
        benchmark=d.get("benchmark", str, "a benchmark of the profile", default=None),
        seed=d.get("seed", int, "an integer >= 0", default=0, check=lambda v: v >= 0),
    )
    drafter = _check_drafter(source, drafter, d, target_shape)
    d.finish()
    gpu = r.get("gpu", str, "a GPU name such as h200", default="h200")
    try:
        gpu = resolve_gpu(gpu)
    except SpecError as e:
        raise SpecError(f"{source}: field 'gpu': {e}") from None
    s = r.sub("serving")
    batch = s.get("batch_sizes", list, "an increasing list of distinct integers >= 1, such as [1, 8, 32]", default=[1],
                  check=lambda v: bool(v) and all(type(x) is int and x >= 1 for x in v) and v == sorted(set(v)))
    serving = ServingSpec(
        batch_sizes=tuple(batch),
        max_new_tokens=s.get("max_new_tokens", int, "an integer >= 1", default=64, check=_positive),
        greedy=s.get("greedy", bool, "true (engines are compiled and token-forced greedy; sampling is chosen per "
                     "request: specpilot run --temperature)", default=True, check=lambda v: v is True),
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
    backend = r.get("backend", str, f"one of {', '.join(BACKENDS)}", default="torch", check=lambda v: v in BACKENDS)
    if backend == "trtllm" and (drafter.kind != "pard" or target_shape is not None):
        raise r.fail("backend", "'torch' for this drafter: 'trtllm' writes TensorRT-LLM's PARD decoding, so it needs a "
                     "pard drafter and a target read from a model directory", backend)
    r.finish()
    base = Path(source).parent
    return PipelineSpec(
        source=source,
        name=name,
        target=target if target_shape else _resolve(target, base),
        drafter=replace(drafter, path=_resolve(drafter.path, base) if drafter.path else None),
        gpu=gpu,
        serving=serving,
        benchmark=replace(bench, prompts=_resolve(bench.prompts, base) if bench.prompts.endswith(".jsonl") else bench.prompts),
        passes=passes,
        rules=tuple(_resolve(x, base) for x in rules),
        plugins=tuple(_resolve(x, base) if x.endswith(".py") else x for x in plugins),
        dtype=dtype,
        target_shape=target_shape,
        backend=backend,
    )


def _check_drafter(source: str, drafter: DrafterSpec, d: _Reader, target_shape: ShapeTarget | None) -> DrafterSpec:
    """A replay drafter's profile, benchmark and shape resolved and checked; the replay fields refused
    on other drafters, and any drafter but a replay one on a target with random weights."""
    replay_fields = [k for k in ("profile", "shape", "benchmark", "seed") if k in d.data]
    if drafter.kind != "replay":
        if replay_fields:
            raise d.fail(replay_fields[0], "a field of drafter kind 'replay' only (this drafter is "
                         f"{drafter.kind!r})", d.data[replay_fields[0]])
        if target_shape is not None:
            raise d.fail("kind", "'replay' (a target given by shape has random weights: only a replay drafter "
                         "makes its acceptance meaningful)", drafter.kind)
        return drafter
    if drafter.path is not None:
        raise d.fail("path", "no path (a replay drafter runs a random network of its `shape`)", drafter.path)
    if target_shape is None:
        raise d.fail("kind", "dflash or pard for a target read from a model directory ('replay' drafts for a target "
                     "given by shape: {shape: ..., weights: random})", drafter.kind)
    if drafter.profile is None:
        raise SpecError(f"{source}: missing field 'drafter.profile' (one of {', '.join(profile_names())})")
    try:
        profile = load_profile(drafter.profile)
        benchmark = drafter.benchmark or profile.default_benchmark
        profile.check(benchmark)
    except ProfileError as e:  # an unknown profile, one without τ, or a benchmark it lacks
        where = "benchmark" if drafter.benchmark and "no benchmark" in str(e) else "profile"
        raise SpecError(f"{source}: field 'drafter.{where}': {e}") from None
    return replace(drafter, benchmark=benchmark, shape=drafter.shape or profile.drafter)


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

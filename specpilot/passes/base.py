"""What a pass is, and the registry that names them.

A pass is a frozen dataclass: its class variable `name` is how pipelines spell it (kebab-case),
its fields are its parameters (spelled kebab-case in pipelines: `min_numel` is `min-numel`), and
`apply(program)` returns a new program and whether anything changed. `schedule_space(program)`
lists the parameterised instances that would change this program: what a search may try.
`lossless` is the contract: True means the engine's output tokens must equal AR greedy.
`closes` names the gap a pass closes, in words ("weight bytes"): a pass that declares one (and is
lossless) is offered to searches as what-ifs (what_if.py: the cost model's gaps and ceiling); a pass
without one runs only where a pipeline names it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

from ..errors import PipelineError
from ..ir import Program
from ..ir.text import format_literal

REGISTRY: dict[str, type["Pass"]] = {}


@dataclass(frozen=True)
class PassResult:
    program: Program
    changed: bool
    summary: str = ""


@dataclass(frozen=True)
class Pass:
    name: ClassVar[str] = ""
    lossless: ClassVar[bool] = True
    closes: ClassVar[str] = ""

    def apply(self, program: Program) -> PassResult:
        raise NotImplementedError

    def check(self, program: Program, where: str = "") -> None:
        """Raise PipelineError if a parameter is outside what this deployment holds (ir.limits:
        positions, vocabulary); nothing is built before every pass of a pipeline has checked."""

    def out_of_range(self, param: str, lo: int, hi: int | None, why: str, where: str = "") -> None:
        """PipelineError unless parameter `param` (its field name) lies in lo..hi (hi None: no upper bound)."""
        value = getattr(self, param)
        if value < lo or (hi is not None and value > hi):
            allowed = f"{lo}..{hi}" if hi is not None else f">= {lo}"
            raise PipelineError(f"{where}pass {self.name!r}: parameter {param.replace('_', '-')!r} = {value} is out of "
                                f"range for this deployment: expected {allowed} ({why})")

    @classmethod
    def schedule_space(cls, program: Program) -> list["Pass"]:
        return []

    # -- how a pass is written in a pipeline string
    @classmethod
    def params(cls) -> list[dataclasses.Field]:
        return list(dataclasses.fields(cls))

    def spec(self) -> str:
        """The pipeline-string form, e.g. `weights-u12{min-numel=1048576}`; omits nothing."""
        fields = self.params()
        if not fields:
            return self.name
        args = ", ".join(f"{f.name.replace('_', '-')}={format_literal(getattr(self, f.name))}" for f in fields)
        return f"{self.name}{{{args}}}"

    @classmethod
    def from_params(cls, params: dict[str, Any], where: str = "") -> "Pass":
        """Build from pipeline parameters (kebab-case keys), checking names and types."""
        fields = {f.name.replace("_", "-"): f for f in cls.params()}
        kwargs = {}
        for key, value in params.items():
            if key not in fields:
                known = ", ".join(fields) or "none"
                raise PipelineError(f"{where}pass {cls.name!r} has no parameter {key!r} (parameters: {known})")
            f = fields[key]
            kwargs[f.name] = _coerce(cls.name, key, f.type, value, where)
        missing = [k for k, f in fields.items() if f.name not in kwargs and f.default is dataclasses.MISSING]
        if missing:
            raise PipelineError(f"{where}pass {cls.name!r} needs parameter(s): {', '.join(missing)}")
        try:
            instance = cls(**kwargs)
        except ValueError as e:
            raise PipelineError(f"{where}pass {cls.name!r}: {e}") from None
        except Exception as e:
            from .plugins import plugin_fault

            fault = plugin_fault(cls, "could not be built from its parameters", e, where)
            if fault is None:
                raise
            raise fault from None
        return instance


_TYPES = {"int": int, "float": float, "str": str, "bool": bool, int: int, float: float, str: str, bool: bool}


def _coerce(pass_name: str, key: str, annotation: Any, value: Any, where: str) -> Any:
    want = _TYPES.get(annotation, None)
    if want is None:
        return value
    if want is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, want) and not (want is int and isinstance(value, bool)):
        return value
    raise PipelineError(
        f"{where}pass {pass_name!r}: parameter {key!r} expects {want.__name__}, got {format_literal(value)}")


class NameTaken(TypeError):
    """`register` of a pass under a name another pass holds."""

    def __init__(self, name: str, holder: type[Pass]):
        super().__init__(f"pass name {name!r} is taken by {holder.__module__}.{holder.__qualname__}")
        self.name, self.holder = name, holder


def register(cls: type[Pass]) -> type[Pass]:
    """Class decorator: make a pass available to pipelines under `cls.name`."""
    if not cls.name:
        raise TypeError(f"{cls.__name__} has no pass name")
    if cls.name in REGISTRY and REGISTRY[cls.name] is not cls:
        raise NameTaken(cls.name, REGISTRY[cls.name])
    REGISTRY[cls.name] = cls
    return cls


def lookup(name: str, where: str = "", *, plugins: bool = False) -> type[Pass]:
    """The pass registered as `name`. `plugins`: where none is, load the installed plugin that
    declares it (plugins.py: trusted code, imported; callers allow it for the user's own pipelines,
    never for proposals)."""
    if name not in REGISTRY and plugins:
        from .plugins import load_pass_plugin

        load_pass_plugin(name, where)
    if name not in REGISTRY:
        known = ", ".join(sorted(REGISTRY))
        raise PipelineError(f"{where}unknown pass {name!r} (known passes: {known})")
    return REGISTRY[name]

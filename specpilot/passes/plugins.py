"""Passes (and weight formats, kernels) from outside specpilot: installed plugins and local modules.

A plugin is trusted Python code that the user installs or names on purpose: specpilot imports it,
and it runs with the user's rights. Rules files and whatever the search agent proposes are data and
never come here: a pipeline string loads a plugin only where its caller allows it
(`parse_pipeline(..., plugins=True)`, which the compiler does for the user's own pipeline.yaml and
`--passes`, never for a proposal), and nothing in the DSL names a module.

Where plugins come from:

- an installed distribution's entry points (pyproject.toml):

      [project.entry-points."specpilot.passes"]           # name: the pass; value: "module:Class"
      verify-width = "specpilot_verify_width:VerifyWidth"
      [project.entry-points."specpilot.weight_formats"]   # name: the format; value: the module whose import registers it
      [project.entry-points."specpilot.kernels"]          # name: the kernel; value: the module whose import registers it

- pipeline.yaml's `plugins:` field: a local module file (`my_passes.py`, imported from that path;
  whatever it registers is its), or the name of an installed plugin distribution (every entry
  point it declares is loaded, so a search is offered its passes without the pipeline naming them).

Loading is lazy. An installed plugin is imported only when a user's pipeline names one of its passes
(a name no built-in, rules file or local module holds), when pipeline.yaml names its distribution,
when an engine's IR names its weight format, or when `specpilot passes` lists what is installed. A
broken plugin therefore never breaks a command that does not ask for it. Everything a plugin does
wrong (cannot be imported, raises, returns an invalid IR, takes a name that is taken) is one
PluginError naming the plugin and the pass; a failed import leaves no pass of it registered.
"""

from __future__ import annotations

import hashlib
import importlib.util
import re
import sys
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from ..errors import PluginError, SpecpilotError
from ..ir.node import WEIGHT_FORMATS
from .base import REGISTRY, NameTaken, Pass, register

PASSES, WEIGHT_FORMATS_GROUP, KERNELS_GROUP = "specpilot.passes", "specpilot.weight_formats", "specpilot.kernels"
GROUPS = (PASSES, WEIGHT_FORMATS_GROUP, KERNELS_GROUP)
TRUST = ("Plugins are trusted Python code: specpilot imports what you install or name in `plugins:`. "
         "Rules files and the search agent's proposals are data and never become Python.")


@dataclass(frozen=True)
class Origin:
    """Where a pass (or format, kernel) came from: `kind` is built-in, rules, plugin, module or python
    (registered by code in the user's own process); `where` the rules file, the distribution with its
    version, the module file or the Python module."""

    kind: str
    where: str = ""

    def __str__(self) -> str:
        return f"{self.kind} {self.where}" if self.where else self.kind


BUILT_IN = Origin("built-in")
_ORIGINS: dict[type, Origin] = {}  # pass classes a plugin or local module registered
_MODULES: dict[Path, tuple[type[Pass], ...]] = {}  # local module files imported, with the passes each registered
_LOADED_ENTRIES: dict[tuple[str, str], Origin] = {}  # (group, name) of weight formats and kernels loaded


def origin_of(cls: type[Pass]) -> Origin:
    if cls in _ORIGINS:
        return _ORIGINS[cls]
    module = cls.__module__
    if module.startswith("specpilot.passes."):
        return BUILT_IN
    if module == "specpilot.dsl.rules":  # a RulePass: its rules file
        return Origin("rules", getattr(cls, "source", ""))
    return Origin("python", module)


def is_plugin(cls: type) -> bool:
    """Whether a plugin or a local module registered `cls` (its faults are reported, not raised)."""
    return cls in _ORIGINS


def plugin_fault(cls: type, doing: str, error: BaseException, where: str = "") -> PluginError | None:
    """The PluginError for `error` raised by plugin pass `cls` while `doing` something; None where
    `cls` is no plugin's or `error` is already one a user can act on (a SpecpilotError)."""
    if not is_plugin(cls) or isinstance(error, SpecpilotError) or not isinstance(error, Exception):
        return None
    return PluginError(f"{where}{_ORIGINS[cls]}: pass {cls.name!r} {doing}: {_exception(error)} (a fault of the "
                       f"plugin, not of the pipeline)")


def _exception(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__


def _distribution(ep: metadata.EntryPoint) -> str:
    dist = getattr(ep, "dist", None)
    return f"{dist.name} {dist.version}" if dist is not None else ep.value.split(":")[0]


def _normalized(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def entry_points(group: str, name: str | None = None) -> list[metadata.EntryPoint]:
    """The installed entry points of `group` (named `name`, if given): metadata only, nothing imported."""
    try:
        found = metadata.entry_points(group=group)
    except Exception as e:  # a distribution with unreadable metadata
        raise PluginError(f"cannot read the installed plugins' entry points ({group}): {_exception(e)}") from None
    return [ep for ep in found if name is None or ep.name == name]


def _import(load, origin: Origin, what: str, where: str):
    """Run `load()` (an entry point's or a module file's import); the passes it registers are the
    plugin's. A failed import unregisters what it had registered."""
    before = dict(REGISTRY)
    try:
        obj = load()
    except Exception as e:
        REGISTRY.clear()
        REGISTRY.update(before)
        if isinstance(e, NameTaken):
            raise PluginError(f"{where}{origin}: pass {e.name!r}: the name is taken by the {origin_of(e.holder)} pass "
                              f"{e.name!r}; the plugin must rename its pass") from None
        raise PluginError(f"{where}{origin}: {what}: cannot be imported: {_exception(e)}") from None
    for name, cls in REGISTRY.items():
        if name not in before:
            _ORIGINS[cls] = origin
    return obj


PASS_NAME = re.compile(r"[a-z][a-z0-9]*(-[a-z0-9]+)*")  # grammar/specpilot.lark's PASS_NAME


def _check_pass_class(cls, name: str, origin: Origin, where: str) -> type[Pass]:
    """The class an entry point (or a local module) gives must be a frozen dataclass Pass that
    pipelines can name, registered as `name`; else it is unregistered and a PluginError raised."""
    problem = None
    if not (isinstance(cls, type) and issubclass(cls, Pass)):
        problem = f"the entry point gives {cls!r}, expected a Pass subclass"
    elif cls.name != name:
        problem = (f"the entry point's class {cls.__qualname__} is named {cls.name!r}; the entry point's name and "
                   f"the pass's `name` must agree")
    elif not PASS_NAME.fullmatch(name):
        problem = "a pass name is kebab-case (lower-case letters and digits joined by '-'), as pipelines spell it"
    elif not _frozen_dataclass(cls):
        problem = f"{cls.__qualname__} must be a frozen dataclass (@dataclass(frozen=True))"
    elif REGISTRY.get(name) not in (None, cls):
        held = REGISTRY[name]
        raise PluginError(f"{where}{origin}: pass {name!r}: the name is taken by the {origin_of(held)} pass {name!r}; "
                          f"the plugin must rename its pass")
    if problem is not None:
        if REGISTRY.get(name) is cls and _ORIGINS.get(cls) == origin:
            del REGISTRY[name], _ORIGINS[cls]
        raise PluginError(f"{where}{origin}: pass {name!r}: {problem}")
    if name not in REGISTRY:
        register(cls)
    _ORIGINS[cls] = origin
    return cls


def _frozen_dataclass(cls: type) -> bool:
    """Made by @dataclass(frozen=True) itself (a subclass without the decorator inherits the flag but
    none of its fields); rule passes built in Python (dsl.rule_pass) are frozen by construction."""
    if any(base.__module__ == "specpilot.dsl.rules" and base.__name__ == "RulePass" for base in cls.__mro__):
        return True
    params = cls.__dict__.get("__dataclass_params__")
    return params is not None and params.frozen


def _load_pass_entry(ep: metadata.EntryPoint, where: str) -> type[Pass]:
    origin = Origin("plugin", _distribution(ep))
    held = REGISTRY.get(ep.name)
    if held is not None and origin_of(held) != origin:
        raise PluginError(f"{where}{origin}: pass {ep.name!r}: the name is taken by the {origin_of(held)} pass "
                          f"{ep.name!r}; the plugin must rename its pass")
    cls = _import(ep.load, origin, f"pass {ep.name!r} ({ep.value})", where)
    return _check_pass_class(cls, ep.name, origin, where)


def load_pass_plugin(name: str, where: str = "") -> type[Pass] | None:
    """Import the installed plugin that declares pass `name` (entry-point group specpilot.passes) and
    return its class; None where no installed plugin declares it."""
    found = entry_points(PASSES, name)
    if not found:
        return None
    if len({_distribution(ep) for ep in found}) > 1:
        raise PluginError(f"{where}pass {name!r} is declared by several installed plugins "
                          f"({', '.join(sorted({_distribution(ep) for ep in found}))}); keep one")
    return _load_pass_entry(found[0], where)


def load_module(path: str | Path, where: str = "") -> tuple[type[Pass], ...]:
    """Import a local module file (pipeline.yaml's `plugins:`); the passes it registers are its.
    A file is imported once per process."""
    path = Path(path).resolve()
    if path in _MODULES:
        return _MODULES[path]
    origin = Origin("module", str(path))
    # a name of its own, so that two files of one name, or one named like an installed module, never collide
    name = f"specpilot_plugin_{path.stem}_{hashlib.sha256(str(path).encode()).hexdigest()[:10]}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise PluginError(f"{where}{origin}: not a Python module file (expected a .py file)")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses resolve their annotations through sys.modules

    def load():
        spec.loader.exec_module(module)

    try:
        _import(load, origin, "the module", where)
        passes = tuple(cls for cls, o in list(_ORIGINS.items()) if o == origin)
        for cls in passes:
            _check_pass_class(cls, cls.name, origin, where)
    except PluginError:
        sys.modules.pop(name, None)
        for cls in [c for c, o in _ORIGINS.items() if o == origin]:
            REGISTRY.pop(cls.name, None)
            del _ORIGINS[cls]
        raise
    _MODULES[path] = passes
    return passes


def load_weight_format(name: str, where: str = "") -> bool:
    """Import the installed plugin that declares weight format `name` (specpilot.weight_formats);
    False where none does. Its module must register the format (backends.torch_backend.register_weight_format)."""
    found = entry_points(WEIGHT_FORMATS_GROUP, name)
    if not found:
        return False
    _load_registering(found[0], lambda: name in WEIGHT_FORMATS, "weight format", where)
    return True


def load_kernel(name: str, where: str = "") -> bool:
    """Import the installed plugin that declares kernel `name` (specpilot.kernels); False where none
    does. Its module must register a KernelSpec of that name (kernels.registry.register)."""
    from ..kernels.registry import KERNELS

    found = entry_points(KERNELS_GROUP, name)
    if not found:
        return False
    _load_registering(found[0], lambda: name in KERNELS, "kernel", where)
    return True


def _load_registering(ep: metadata.EntryPoint, registered, what: str, where: str) -> None:
    origin = Origin("plugin", _distribution(ep))
    if (ep.group, ep.name) in _LOADED_ENTRIES:
        return
    _import(ep.load, origin, f"{what} {ep.name!r} ({ep.value})", where)
    if not registered():
        raise PluginError(f"{where}{origin}: {what} {ep.name!r}: importing {ep.value} registered no {what} of that name")
    _LOADED_ENTRIES[(ep.group, ep.name)] = origin


def loaded_origin(group: str, name: str) -> Origin | None:
    """The plugin a weight format or kernel was loaded from (None: not loaded from a plugin)."""
    return _LOADED_ENTRIES.get((group, name))


def load_distribution(name: str, where: str = "") -> list[str]:
    """Load every entry point an installed plugin distribution declares in specpilot's groups; the
    names loaded. PluginError where no installed distribution of that name declares any."""
    declared = [ep for group in GROUPS for ep in entry_points(group)
                if getattr(ep, "dist", None) is not None and _normalized(ep.dist.name) == _normalized(name)]
    if not declared:
        installed = sorted({ep.dist.name for group in GROUPS for ep in entry_points(group)
                            if getattr(ep, "dist", None) is not None})
        raise PluginError(f"{where}no installed plugin {name!r} (installed plugins: {', '.join(installed) or 'none'}; "
                          f"a local module is a path ending in .py)")
    for ep in declared:
        _load_entry(ep, where)
    return [ep.name for ep in declared]


def _load_entry(ep: metadata.EntryPoint, where: str) -> None:
    if ep.group == PASSES:
        _load_pass_entry(ep, where)
    elif ep.group == WEIGHT_FORMATS_GROUP:
        _load_registering(ep, lambda: ep.name in WEIGHT_FORMATS, "weight format", where)
    else:
        load_kernel(ep.name, where)


@dataclass(frozen=True)
class Installed:
    """One entry point an installed plugin declares, after trying to load it (`error`: why it failed)."""

    group: str
    name: str
    origin: Origin
    error: str = ""


def load_installed() -> list[Installed]:
    """Try to load every installed plugin's entry points (for `specpilot passes`): a broken one is
    reported with its error, and the others still load."""
    out = []
    for group in GROUPS:
        for ep in sorted(entry_points(group), key=lambda e: e.name):
            try:
                _load_entry(ep, "")
                error = ""
            except PluginError as e:
                error = str(e)
            out.append(Installed(group, ep.name, Origin("plugin", _distribution(ep)), error))
    return out


def unload(origin: Origin) -> None:
    """Forget the passes a plugin or local module registered (their module stays imported; a local
    module file is imported afresh when named again): for a long-running process whose user edited
    a plugin, and for tests."""
    for cls in [c for c, o in _ORIGINS.items() if o == origin]:
        if REGISTRY.get(cls.name) is cls:
            del REGISTRY[cls.name]
        del _ORIGINS[cls]
    for path in [p for p in _MODULES if origin == Origin("module", str(p))]:
        del _MODULES[path]
    for key in [k for k, o in _LOADED_ENTRIES.items() if o == origin]:
        del _LOADED_ENTRIES[key]

"""The rooms of the house: import-linter's contracts (pyproject.toml) hold, and no module imports
another module's private (underscore) names."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CHECKED = ("specpilot", "tests", "bench")  # the package, and the code that imports it


def test_import_contracts_hold():
    run = subprocess.run([sys.executable, "-c", "import sys; from importlinter.cli import lint_imports; "
                          "sys.exit(lint_imports(no_cache=True, no_logo=True))"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _resolve(module: str, node: ast.ImportFrom, is_package: bool) -> str:
    """The absolute module a `from ... import` names, from the importing `module`."""
    if not node.level:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def private_imports(path: Path) -> list[str]:
    """`from other import _name` lines of `path` where `other` is another specpilot module."""
    module = _module_name(path)
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.ImportFrom):
            continue
        source = _resolve(module, node, path.name == "__init__.py")
        if not source.startswith("specpilot") or source == module:
            continue
        for alias in node.names:
            if alias.name.startswith("_") and not alias.name.startswith("__"):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {alias.name} from {source}")
    return found


def test_no_module_imports_another_modules_private_names():
    found = [line for d in CHECKED for path in sorted((ROOT / d).rglob("*.py")) for line in private_imports(path)]
    assert not found, "\n".join(found)


def test_the_private_import_check_sees_relative_and_absolute_imports(tmp_path, monkeypatch):
    """The check above must be able to fail: a planted module with both kinds of private import."""
    pkg = tmp_path / "specpilot" / "kernels"
    pkg.mkdir(parents=True)
    planted = pkg / "planted.py"
    planted.write_text("from .rmsnorm import _normalize, rmsnorm\nfrom specpilot.runtime.model import _x\n"
                       "from . import _private_module\nfrom .planted import _self_is_fine\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert private_imports(planted) == [
        "specpilot/kernels/planted.py:1: _normalize from specpilot.kernels.rmsnorm",
        "specpilot/kernels/planted.py:2: _x from specpilot.runtime.model",
        "specpilot/kernels/planted.py:3: _private_module from specpilot.kernels",
    ]


@pytest.mark.parametrize("level, name, package, want", [
    (1, "rmsnorm", False, "specpilot.kernels.rmsnorm"),
    (2, "runtime", False, "specpilot.runtime"),
    (1, None, True, "specpilot.kernels"),
])
def test_relative_imports_resolve_from_the_importing_module(level, name, package, want):
    node = ast.ImportFrom(module=name, names=[], level=level)
    module = "specpilot.kernels" if package else "specpilot.kernels.fused_linear"
    assert _resolve(module, node, package) == want

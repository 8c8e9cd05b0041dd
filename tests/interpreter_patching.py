"""Triton's interpreter, without its repeated patching of triton.language (CPU runs only).

Each kernel launch patches triton.language's builtins to interpreted ones for the launch and
restores them after (`_patch_lang`, `GridExecutor.__call__`). Every call of a @triton.jit helper
inside the kernel patches them again (`InterpretedFunction.__call__`), walking every member of
triton.language each time: with the builtins already patched that walk changes nothing, yet it
is a large share of the interpreter's time in kernel-heavy tests (cProfile: about 30% of step_ab's
verify smoke).

`install()` skips a helper's patching where the launch around it has patched every
triton.language module the helper sees. A helper that sees one more (triton.language.standard's
sum, max, cdiv: triton.language.core besides triton.language) is patched by Triton's own code
once a launch, then counted as patched for the rest of it: Triton keeps a helper's patching (it
drops the helper's restore scope), so the calls after it would change nothing either. A launch,
or a Triton whose interpreter lacks these names, runs Triton's own code.

It also turns off the interpreter's integer-overflow sanitizing where its device asserts are off
(`InterpreterOptions.debug`, which the interpreter never sets): each integer add, sub and mul then
also computed in int64, compared against the type's range and handed to a device_assert that
returns without looking (semantic.py), about a third of the interpreter's time in a split-KV
launch (cProfile of bench.steps.batched_host --smoke in-suite: 12.8 s of 37 s).
"""

from __future__ import annotations

import dataclasses


def install() -> bool:
    """Patch Triton's interpreter as above; False (nothing changed) where its names differ."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return False
    names = ("_patch_lang", "_LangPatchScope", "GridExecutor", "tl")
    if not all(hasattr(interpreter, n) for n in names) or getattr(interpreter, "specpilot_patched", False):
        return False
    patch_lang, launch, tl = interpreter._patch_lang, interpreter.GridExecutor.__call__, interpreter.tl
    state: dict = {"first": False, "patched": None}  # the launch running now: its first patching to come, what it patched

    def languages(fn) -> set[int]:
        return {id(v) for v in fn.__globals__.values() if v is tl or v is tl.core}

    def patch_once(fn):
        if state["first"]:  # the launch's own patching, restored when it ends
            state["first"], state["patched"] = False, languages(fn)
            return patch_lang(fn)
        if state["patched"] is None:  # outside a launch
            return patch_lang(fn)
        seen = languages(fn)
        if not seen <= state["patched"]:  # a helper's, kept as Triton keeps it: patched for the launch's rest
            patch_lang(fn)
            state["patched"] = state["patched"] | seen
        return interpreter._LangPatchScope()  # nothing for the caller to restore

    def launch_patching_once(self, *args, **kwargs):
        saved = dict(state)
        state["first"], state["patched"] = True, None
        try:
            return launch(self, *args, **kwargs)
        finally:
            state.update(saved)

    interpreter._patch_lang = patch_once
    interpreter.GridExecutor.__call__ = launch_patching_once
    interpreter.specpilot_patched = True
    _skip_unasserted_overflow_checks(interpreter)
    return True


def _skip_unasserted_overflow_checks(interpreter) -> None:
    """sanitize_overflow off where the checks' device asserts are no-ops (options.debug off)."""
    builder = getattr(interpreter, "interpreter_builder", None)
    options = getattr(builder, "options", None)
    if dataclasses.is_dataclass(options) and getattr(options, "sanitize_overflow", False) \
            and getattr(options, "debug", True) is False:
        builder.options = dataclasses.replace(options, sanitize_overflow=False)

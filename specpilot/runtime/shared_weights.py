"""One copy of each model's weights while a search builds many engines of the same deployment.

    with sharing_weights():
        engine_a = build_engine(...)   # draws or reads the target's weights
        engine_b = build_engine(...)   # its modules get the same tensors: no second copy
        reference = ...                # token forcing's unmodified target: the same tensors again

While a scope is open, a model built again from the same source (a checkpoint directory, or a shape
with its seed), dtype and device gets the tensors of the first build, held by the scope, rather
than a copy. Each build still gets its own modules, so installing kernels or swapping a projection
for another format in one engine leaves the others as they were. This is lossless because nothing
writes into a weight in place: a pass that changes a weight (a format, a concatenation) makes a
new tensor and points its module at it. A build that did write into a shared weight would change
the token-forcing reference with it, so `written()` names every shared tensor whose version
counter moved since it was made, and token forcing refuses to run over them (compiler.validate_outputs);
a write through `.data` or by a kernel's raw pointer moves no counter (plugins are code, trusted
as such; proposals are data and cannot write weights). The fused stacks' concatenated projections of shared
weights are shared alike (`shared_concat`): every engine with a fused stack, the AR baseline's
included, reads one concatenated copy. Outside a scope every build is private, as before; the
scope ends, and with it what only it held.

A search (compiler.tune_pipeline) opens one around all its trials, so a deployment holds one
target weight set plus the weights its current candidate's passes changed; an 8B target on one
GPU does not fit five times.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import contextmanager
from typing import Hashable

import torch

_scope: dict | None = None  # source key -> {name: tensor}, and ("concat", ...) -> tensor, while a scope is open
_owned: set[tuple[int, int]] = set()  # (storage data_ptr, nbytes) of every tensor the scope holds
_made: list[tuple[Hashable, str, torch.Tensor, int | None]] = []  # (scope key, name, tensor, its version when made)


@contextmanager
def sharing_weights():
    """Share weights between the models built from one source until the outermost scope ends."""
    global _scope
    if _scope is not None:  # nested: the outer scope's tensors go on being shared
        yield
        return
    _scope = {}
    try:
        yield
    finally:
        _scope = None
        _owned.clear()
        _made.clear()


@contextmanager
def private_weights():
    """Builds inside get their own tensors, kept by nobody else (a reference in another dtype, used once)."""
    global _scope
    saved, _scope = _scope, None
    try:
        yield
    finally:
        _scope = saved


def active() -> bool:
    return _scope is not None


def _version(t: torch.Tensor) -> int | None:
    """The in-place writes `t` has seen (None for an inference tensor, which keeps no count)."""
    return None if t.is_inference() else t._version


def _key(t: torch.Tensor) -> tuple[int, int]:
    s = t.untyped_storage()
    return s.data_ptr(), s.nbytes()


def shared_tensors(key: Hashable, make: Callable[[], dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The tensors of the source `key`: `make()`'s, made once a scope (else every call)."""
    if _scope is None:
        return make()
    if key not in _scope:
        tensors = {name: t.detach() for name, t in make().items()}
        _scope[key] = tensors
        _owned.update(_key(t) for t in tensors.values())
        _made.extend((key, name, t, _version(t)) for name, t in tensors.items())
    return _scope[key]


def is_shared(t: torch.Tensor) -> bool:
    """Whether `t` lies in a tensor the open scope holds."""
    return _scope is not None and _key(t) in _owned


def shared_concat(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """torch.cat(tensors), made once a scope where every part is a shared weight: the same parts give
    the same concatenation, so the engines of a search read one. Parts not shared: a new tensor."""
    if _scope is None or not all(is_shared(t) for t in tensors):
        return torch.cat(list(tensors))
    key = ("concat", tuple((_key(t), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype) for t in tensors))
    if key not in _scope:
        _scope[key] = torch.cat(list(tensors))
        _owned.add(_key(_scope[key]))
        _made.append((key, f"a concatenation of {len(tensors)}", _scope[key], _version(_scope[key])))
    return _scope[key]


def written() -> list[str]:
    """The shared tensors written in place since they were made (their version counters moved),
    by name; after this call the scope forgets their sources, so the next build makes them afresh."""
    global _made
    if _scope is None:
        return []
    bad = [(key, name) for key, name, t, version in _made if _version(t) != version]
    keys = {key for key, _ in bad}
    for key in keys:
        del _scope[key]
    _made = [m for m in _made if m[0] not in keys]
    _owned.clear()
    _owned.update(_key(t) for _, _, t, _ in _made)
    return [name for _, name in bad]

"""A CPU stand-in for CUDA's sync debug mode: inside `no_host_traffic()`, any torch call that
would copy host data to the device (a tensor made from Python lists or scalars, indexing by a
Python list) or read a device value on the host (item, tolist, bool, int, float, nonzero, ...)
raises. What a CUDA graph capture refuses, caught on a CPU with the same message for every kind."""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch.overrides import TorchFunctionMode

# made from host data: on a GPU, a host-to-device copy
_FROM_HOST = {torch.tensor, torch.as_tensor, torch.from_numpy, torch.Tensor.new_tensor, torch.scalar_tensor}
# read on the host: a device-to-host copy and a sync
_TO_HOST = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__bool__, torch.Tensor.__int__,
            torch.Tensor.__float__, torch.Tensor.__index__, torch.Tensor.numpy, torch.Tensor.cpu,
            torch.nonzero, torch.Tensor.nonzero, torch.unique, torch.Tensor.unique, torch.masked_select,
            torch.Tensor.masked_select}


class HostTraffic(RuntimeError):
    """A torch call inside `no_host_traffic()` that moves data between host and device."""


def _host_index(index) -> bool:
    parts = index if isinstance(index, tuple) else (index,)
    return any(isinstance(p, (list, range)) for p in parts)


_ALLOWED = [0]  # depth of `host_traffic_allowed()` blocks


class _Guard(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _ALLOWED[0]:
            return func(*args, **kwargs)
        name = getattr(func, "__qualname__", getattr(func, "__name__", str(func)))
        if func in _FROM_HOST:
            data = args[1] if func is torch.Tensor.new_tensor else (args[0] if args else kwargs.get("data"))
            if not isinstance(data, torch.Tensor):
                raise HostTraffic(f"{name}({type(data).__name__}) makes a tensor from host data inside the step")
        if func in _TO_HOST:
            raise HostTraffic(f"{name} reads a device value on the host inside the step")
        if func in (torch.Tensor.__getitem__, torch.Tensor.__setitem__) and _host_index(args[1]):
            raise HostTraffic(f"{name} indexes by a Python list inside the step")
        if func in (torch.repeat_interleave, torch.Tensor.repeat_interleave) and isinstance(
                args[1] if len(args) > 1 else kwargs.get("repeats"), torch.Tensor):
            raise HostTraffic(f"{name} by a tensor of repeats sizes its output on the host")
        return func(*args, **kwargs)


@contextmanager
def no_host_traffic():
    """Raise HostTraffic on any host<->device data movement by torch calls inside."""
    with _Guard() as guard:
        yield guard


@contextmanager
def host_traffic_allowed():
    """Inside `no_host_traffic()`: a part that runs on the host by design (a CPU-only fallback)."""
    _ALLOWED[0] += 1
    try:
        yield
    finally:
        _ALLOWED[0] -= 1

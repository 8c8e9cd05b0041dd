"""Triton kernels, one per file, each registered with its torch reference."""

from . import u12_linear
from .registry import KERNELS, KernelSpec, register

__all__ = ["KERNELS", "KernelSpec", "register", "u12_linear"]

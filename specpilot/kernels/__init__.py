"""Triton kernels, one per file (the u12 family a package), each registered with its torch reference."""

from . import attention_split_kv, best_first_tree, fused_linear, gdn_tree, rmsnorm, rope_attention, rope_kv, silu_mul  # noqa: F401
from . import u12  # noqa: F401  (registers its kernels)
from .registry import KERNELS, KernelSpec, register

__all__ = ["KERNELS", "KernelSpec", "attention_split_kv", "best_first_tree", "gdn_tree", "register", "u12"]

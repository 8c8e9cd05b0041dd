"""Triton kernels, one per file, each registered with its torch reference."""

from . import attention_split_kv, best_first_tree, u12_linear
from . import fused_linear, rmsnorm, rope_attention, rope_kv, silu_mul, u12_fused_linear, u12_hmma, u12_mma  # noqa: F401  (registers them)
from .registry import KERNELS, KernelSpec, register

__all__ = ["KERNELS", "KernelSpec", "attention_split_kv", "best_first_tree", "register", "u12_linear"]

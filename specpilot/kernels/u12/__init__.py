"""The u12 kernels: y = x · Wᵀ with W in the lossless 12-bit format (specpilot/formats/u12.py), decoded in registers.

One family, one module a piece:

- ``dispatch``: ``u12_linear`` and ``default_config`` (which kernel and tile a call takes; the
  TUNED tables), and the torch reference ``u12_linear_reference``;
- the kernels: ``tile`` (any M, K and base), ``gemv2`` (M <= 4, the AR step's), ``mma`` (tl.dot,
  16 rows a program), ``hmma`` (mma.sync from registers, 1..64 rows), and ``fused``
  (``u12_fused_linear``: the GEMV or tensor-core kernel with an RMSNorm prologue, SiLU·mul or
  residual-add epilogues and the norm handoff);
- their shared pieces: ``config`` (``U12Config``), ``decode`` (bytes and codes to weights),
  ``planes`` (addresses in either layout, x's loads), ``escapes`` (the weights outside the window,
  added exactly), ``epilogue`` (split-K, the escapes, the store);
- ``cases``: the registry's inputs and planted errors (tests/test_kernels.py walks them).
"""

from . import cases  # noqa: F401  (registers the family's kernels)
from .config import U12Config
from .dispatch import (TENSOR_CORE_ROWS, TILES_MAX_ROWS, TUNED, TUNED_TILES, default_config, gemv_config, u12_linear,
                       u12_linear_reference)
from .fused import (TUNED_FUSED, NormHandoff, fused_applies, fused_config, tensor_core_config, u12_fused_linear,
                    u12_fused_linear_reference)

__all__ = ["TENSOR_CORE_ROWS", "TILES_MAX_ROWS", "TUNED", "TUNED_FUSED", "TUNED_TILES", "NormHandoff", "U12Config",
           "default_config", "fused_applies", "fused_config", "gemv_config", "tensor_core_config", "u12_fused_linear",
           "u12_fused_linear_reference", "u12_linear", "u12_linear_reference"]

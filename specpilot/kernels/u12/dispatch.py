"""u12_linear: y = x · Wᵀ with W in the u12 format, and the choice of kernel and config for a call.

``u12_linear(x, t)`` takes the config of ``default_config`` (or the caller's) and runs its kernel
where it applies, else the tile kernel: gemv2 (gemv2.py) for one or two rows, the tensor-core
kernels (mma.py, hmma.py) from TENSOR_CORE_ROWS rows on at the shapes TUNED holds them for, and
on tiled weights TUNED_TILES' hmma configs up to TILES_MAX_ROWS rows; the tile kernel (tile.py)
where the scaled word path does not apply (K % 4 != 0, a base outside 1..240). TUNED and
TUNED_TILES hold the best configs the sweeps (bench/kernels/u12_linear.py) found for
Llama-3.1-8B's linears; another model's shapes take the nearest measured one (kernels/tuning.py).
The sweeps' figures: docs/experiments/u12-gemv2.md, u12-mma.md, u12-hmma.md.
"""

from __future__ import annotations

import torch

from specpilot.formats.u12 import U12Tensor, unpack_u12

from ..overlap import Launch
from ..target import native as on_native
from ..tuning import KernelTuning, nearest_tuned
from .config import U12Config
from .epilogue import block_m
from .gemv2 import gemv2_applies, launch_gemv2
from .hmma import hmma_applies, launch_hmma
from .mma import launch_mma, mma_applies
from .tile import launch_tile, tile_config

# Keyed (BLOCK_M, N, K). M = 1, 4: gemv2 (u12_linear_h200_gemv2-graph.json, u12_linear_h200_gemv2.json;
# qkv and o at 4 words a thread from the AR step, step_ab_h200_u12-tuned.json); M = 16: the mma
# sweep (u12_linear_h200_mma.json), o and down hmma (u12_linear_h200_hmma.json); M = 32, 64: the mma
# kernel (u12_linear_h200_mma-m32-64-graph.json). All H200.
TUNED: dict[tuple[int, int, int], U12Config] = {
    (1, 6144, 4096): U12Config(4, 128, num_warps=4, num_stages=1, kernel="gemv2"),  # qkv
    (4, 6144, 4096): U12Config(4, 256, num_warps=2, num_stages=1, kernel="gemv2"),  # qkv
    (16, 6144, 4096): U12Config(64, 64, split_k=4, num_warps=4, num_stages=2, kernel="mma"),  # qkv
    (32, 6144, 4096): U12Config(64, 32, split_k=4, num_warps=4, num_stages=3, kernel="mma"),  # qkv
    (64, 6144, 4096): U12Config(64, 32, split_k=1, num_warps=4, num_stages=4, kernel="mma"),  # qkv
    (1, 4096, 4096): U12Config(8, 256, num_warps=4, num_stages=1, kernel="gemv2"),  # o
    (4, 4096, 4096): U12Config(4, 256, num_warps=2, num_stages=1, kernel="gemv2"),  # o
    (16, 4096, 4096): U12Config(64, 32, split_k=8, num_warps=4, num_stages=1, kernel="hmma", maxnreg=128),  # o
    (32, 4096, 4096): U12Config(64, 32, split_k=4, num_warps=4, num_stages=3, kernel="mma"),  # o
    (64, 4096, 4096): U12Config(64, 32, split_k=4, num_warps=4, num_stages=2, kernel="mma"),  # o
    (1, 28672, 4096): U12Config(16, 64, num_warps=2, num_stages=1, kernel="gemv2"),  # gate_up
    (4, 28672, 4096): U12Config(4, 256, num_warps=2, num_stages=1, kernel="gemv2"),  # gate_up
    (16, 28672, 4096): U12Config(64, 32, num_warps=4, num_stages=3, kernel="mma"),  # gate_up
    (32, 28672, 4096): U12Config(64, 64, split_k=1, num_warps=4, num_stages=3, kernel="mma"),  # gate_up
    (64, 28672, 4096): U12Config(64, 32, split_k=1, num_warps=4, num_stages=3, kernel="mma"),  # gate_up
    (1, 4096, 14336): U12Config(4, 256, num_warps=4, num_stages=1, kernel="gemv2"),  # down
    (4, 4096, 14336): U12Config(4, 256, num_warps=2, num_stages=1, kernel="gemv2"),  # down
    (16, 4096, 14336): U12Config(64, 32, split_k=8, num_warps=4, num_stages=1, kernel="hmma", maxnreg=128),  # down
    (32, 4096, 14336): U12Config(64, 64, split_k=4, num_warps=4, num_stages=3, kernel="mma"),  # down
    (64, 4096, 14336): U12Config(64, 32, split_k=4, num_warps=4, num_stages=2, kernel="mma"),  # down
    (1, 128256, 4096): U12Config(2, 256, num_warps=1, num_stages=1, kernel="gemv2"),  # lm_head
    (4, 128256, 4096): U12Config(4, 256, num_warps=2, num_stages=1, kernel="gemv2"),  # lm_head
    (16, 128256, 4096): U12Config(64, 64, num_warps=4, num_stages=3, kernel="mma"),  # lm_head
    (32, 128256, 4096): U12Config(64, 64, split_k=1, num_warps=4, num_stages=3, kernel="mma"),  # lm_head
    (64, 128256, 4096): U12Config(64, 32, split_k=1, num_warps=4, num_stages=4, kernel="mma"),  # lm_head
}

# Tiled weights at TENSOR_CORE_ROWS..16 rows, keyed (16, N, K): the hmma kernel won every shape on
# tiles (H200, u12_linear_h200_tiles.json), in 32-row programs of 2 warps (hmma_knobs_h200_w2.json;
# verify(16) 4.238 ms against 4.306 with 64 rows and 4 warps, step_ab_h200_verify16.json).
TUNED_TILES: dict[tuple[int, int, int], U12Config] = {
    (16, 6144, 4096): U12Config(32, 64, split_k=4, num_warps=2, num_stages=1, kernel="hmma", maxnreg=128),  # qkv
    (16, 4096, 4096): U12Config(32, 32, split_k=8, num_warps=2, num_stages=1, kernel="hmma", maxnreg=128),  # o
    (16, 28672, 4096): U12Config(32, 32, num_warps=2, num_stages=1, kernel="hmma", maxnreg=128),  # gate_up
    (16, 4096, 14336): U12Config(32, 32, split_k=8, num_warps=2, num_stages=1, kernel="hmma", maxnreg=128),  # down
    (16, 128256, 4096): U12Config(128, 32, num_warps=4, num_stages=1, kernel="hmma", maxnreg=128),  # lm_head
}

# From this many rows gemv2 yields to TUNED's tensor-core configs where the shape has them: gemv2's
# per-row FMAs grow with M (H200 verify(4) 4.877 ms against 6.009 with gemv2 at 3..4 rows:
# step_ab_h200_verify4.json).
TENSOR_CORE_ROWS = 3
# Up to this many rows a tiled weight takes TUNED_TILES' hmma config (32-row programs past 16), past it
# TUNED's mma configs (H100 verify(32) 6.333 ms against 7.021 with mma past 16 rows:
# step_ab_h100_verify32-wide.json; hmma to 64 rows no faster: step_ab_h100_verify64.json).
TILES_MAX_ROWS = 32


def gemv_config(m: int, n: int, k: int, tuning: KernelTuning | None = None) -> U12Config:
    """gemv2's config at M <= 4 rows: TUNED's at the rows' bucket where measured, or at the nearest
    measured shape (kernels/tuning.py), else the tiles that won most of the H200 sweep (u12_linear
    falls back to the tile kernel where gemv2 does not apply). `tuning`: an engine's own tables."""
    tuned = nearest_tuned(tables(tuning)[0], (block_m(m), n, k))
    if tuned is not None and tuned.kernel == "gemv2":
        return tuned
    return U12Config(8, 128, num_warps=2, num_stages=1, kernel="gemv2") if m == 1 else \
        U12Config(4, 256, num_warps=2, num_stages=1, kernel="gemv2")


def tables(tuning: KernelTuning | None) -> tuple[dict, dict]:
    """(TUNED, TUNED_TILES), or `tuning`'s "u12" and "u12_tiles" tables (an engine's own)."""
    if tuning is None:
        return TUNED, TUNED_TILES
    return tuning.table("u12", TUNED), tuning.table("u12_tiles", TUNED_TILES)


def default_config(m: int, n: int, k: int, on_gpu: bool = True, layout: str = "rows",
                   tuning: KernelTuning | None = None) -> U12Config:
    """On a GPU: below TENSOR_CORE_ROWS rows gemv2 (``gemv_config``); from there to 4 rows TUNED's
    tensor-core config at the rows' bucket or else at 16 rows where the shape has one, else gemv2;
    above, TUNED at the rows' bucket where measured or at the nearest measured shape, else the tile
    kernel's heuristic (tile.py's ``tile_config``). A tiled weight (`layout` "tiles") takes
    TUNED_TILES' entry first from TENSOR_CORE_ROWS rows up to TILES_MAX_ROWS (past 16 rows its
    32-row entry where it has one, else the 16-row one). Under the interpreter the tile kernel's
    small tiles. `tuning`: an engine's own tables in place of TUNED and TUNED_TILES."""
    if not on_gpu:
        return tile_config(m, n, k, on_gpu)
    tuned_rows, tuned_tiles = tables(tuning)
    if layout == "tiles" and TENSOR_CORE_ROWS <= m <= TILES_MAX_ROWS:
        for bucket in (32, 16) if m > 16 else (16,):  # past 16 rows a 32-row entry where measured
            tuned = nearest_tuned(tuned_tiles, (bucket, n, k))
            if tuned is not None:
                return tuned
    if m <= 4:
        for bucket in (block_m(m), 16) if m >= TENSOR_CORE_ROWS else ():  # a few-row entry first
            tuned = nearest_tuned(tuned_rows, (bucket, n, k))
            if tuned is not None and tuned.kernel in ("mma", "hmma"):
                return tuned
        return gemv_config(m, n, k, tuning)
    tuned = nearest_tuned(tuned_rows, (block_m(m), n, k))
    return tuned if tuned is not None else tile_config(m, n, k, on_gpu)


def u12_linear(x: torch.Tensor, t: U12Tensor, config: U12Config | None = None, *,
               launch: Launch | None = None, tuning: KernelTuning | None = None) -> torch.Tensor:
    """x [M, K] (bf16 or fp32) times the u12 weight [N, K] transposed: [M, N] in x.dtype, fp32
    accumulation. `config`: the kernel and its tile (else ``default_config``); `launch`: PDL
    (kernels/overlap.py)."""
    n, k = t.shape
    if x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"u12_linear: x must be [M, {k}], got {list(x.shape)}")
    if x.dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"u12_linear: x must be bfloat16 or float32, got {x.dtype}")
    if x.device != t.device:
        raise ValueError(f"u12_linear: x on {x.device}, weight on {t.device}")
    m = x.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return y
    native = on_native(x)
    cfg = config or default_config(m, n, k, native, t.layout, tuning)
    if config is None and m <= 4 and cfg.kernel in ("mma", "hmma") and x.dtype != torch.bfloat16:
        cfg = gemv_config(m, n, k, tuning)  # the few-row tensor-core configs are bf16 x's (hmma takes no other)
    if cfg.kernel == "gemv2" and gemv2_applies(m, k, t.base):
        launch_gemv2(x, t, y, cfg, launch)
    elif cfg.kernel == "mma" and mma_applies(m, k, t.base):
        launch_mma(x, t, y, cfg, launch=launch)
    elif cfg.kernel == "hmma" and hmma_applies(x, k, t.base):
        launch_hmma(x, t, y, cfg, launch=launch)
    else:  # the tile kernel, at its default config where gemv2, mma or hmma do not apply
        launch_tile(x, t, y, cfg if cfg.kernel == "tile" else tile_config(m, n, k, native), launch)
    return y


def u12_linear_reference(x: torch.Tensor, t: U12Tensor, *, launch: Launch | None = None) -> torch.Tensor:
    """Unpack, multiply in fp32, cast to x.dtype (`launch` is the kernel's argument, unused here)."""
    return (x.to(torch.float32) @ unpack_u12(t).to(torch.float32).T).to(x.dtype)

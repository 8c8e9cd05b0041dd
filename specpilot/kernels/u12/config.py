"""A u12 kernel launch's configuration: which kernel, its tile, its split over K, its budget."""

from __future__ import annotations

from dataclasses import dataclass

KERNELS = ("tile", "gemv2", "mma", "hmma")


@dataclass(frozen=True)
class U12Config:
    """One launch configuration; block_w counts 32-bit words of the sign/mantissa plane (4 weights each).

    kernel "tile": kernels/u12/tile.py (any M, split-K, both decodes); "gemv2": gemv2.py (M <= 4,
    no split-K, ``decode`` unused); "mma": mma.py (any M, split-K, ``decode`` unused); "hmma":
    hmma.py (1 <= M <= 64 rows of bf16 x, split-K, block_n 16 or 32 rows a warp, block_w a multiple
    of 16). ``u12_linear`` runs gemv2, mma and hmma where they apply (K % 4 == 0, 1 <= base <= 240,
    and their M) and otherwise the tile kernel's default config.
    """

    block_n: int
    block_w: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 2
    decode: str = "pairs"  # or "single": one weight per 32-bit op (the tile kernel's scaled decode only)
    kernel: str = "tile"  # one of KERNELS
    maxnreg: int = 0  # registers a thread ptxas may use (PTX .maxnreg, on the GPU); 0: its choice

    def __post_init__(self) -> None:
        if self.decode not in ("pairs", "single"):
            raise ValueError(f"U12Config.decode: expected 'pairs' or 'single', got {self.decode!r}")
        if self.kernel not in KERNELS:
            raise ValueError(f"U12Config.kernel: expected 'tile', 'gemv2', 'mma' or 'hmma', got {self.kernel!r}")
        if self.kernel == "hmma" and (self.rows_a_warp() not in (16, 32) or self.block_w % 16 or self.block_w <= 0):
            raise ValueError(f"U12Config: the hmma kernel takes block_n 16 or 32 rows a warp "
                             f"({16 * self.num_warps} or {32 * self.num_warps} at {self.num_warps} warps) and "
                             f"block_w a multiple of 16, got block_n {self.block_n}, block_w {self.block_w}")
        if self.kernel == "gemv2" and self.split_k != 1:
            raise ValueError(f"U12Config.split_k: the gemv2 kernel has no split-K, got {self.split_k}")
        if self.maxnreg and not 24 <= self.maxnreg <= 255:
            raise ValueError(f"U12Config.maxnreg: expected 0 (the compiler's choice) or 24..255, got {self.maxnreg}")

    def rows_a_warp(self) -> float:
        """W rows each warp multiplies (hmma): its share of block_n."""
        return self.block_n / self.num_warps

    def launch_options(self, native: bool, fp_fusion: bool = True) -> dict:
        """num_warps, num_stages and (native) fp fusion and maxnreg where set, as Triton's launch
        options. Fusion is the default Triton 3.6-3.9 compiles with, asked for by name because 3.10
        turns the default off: the loops' multiply-adds stay FMAs. Off (fp_fusion False) for the
        fused epilogues, as fused_linear: Σ · (1/K) + eps and 1 + exp(-g) round as torch's do."""
        opts = dict(num_warps=self.num_warps, num_stages=self.num_stages)
        if native:
            opts["enable_fp_fusion"] = fp_fusion
        if native and self.maxnreg:
            opts["maxnreg"] = self.maxnreg
        return opts

    def __str__(self) -> str:
        regs = f"-r{self.maxnreg}" if self.maxnreg else ""
        if self.kernel == "gemv2":
            return f"gemv2-bn{self.block_n}-bw{self.block_w}-w{self.num_warps}-s{self.num_stages}{regs}"
        if self.kernel in ("mma", "hmma"):
            return (f"{self.kernel}-bn{self.block_n}-bw{self.block_w}-sk{self.split_k}-w{self.num_warps}"
                    f"-s{self.num_stages}{regs}")
        return f"bn{self.block_n}-bw{self.block_w}-sk{self.split_k}-w{self.num_warps}-s{self.num_stages}-{self.decode}"

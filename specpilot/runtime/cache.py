"""Static key/value cache: preallocated once, rolled back by moving a length pointer."""

from __future__ import annotations

import torch

from specpilot.runtime.config import ModelConfig


class KVCache:
    """Per layer k and v of shape [B, num_kv_heads, max_len, head_dim]; `length` tokens are valid.

    Slots at and beyond `length` hold stale values that are never read: the next write overwrites
    them. All rows of the batch share one length (no ragged batches yet).
    """

    def __init__(self, k: list[torch.Tensor], v: list[torch.Tensor], max_len: int) -> None:
        self.k = k
        self.v = v
        self.max_len = max_len
        self.length = 0

    @classmethod
    def for_model(
        cls, cfg: ModelConfig, batch: int, max_len: int, dtype: torch.dtype, device: torch.device | str
    ) -> KVCache:
        shape = (batch, cfg.num_kv_heads, max_len, cfg.head_dim)
        k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_layers)]
        v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_layers)]
        return cls(k, v, max_len)

    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v [B, Hkv, T, D] at slots [start, start+T) of `layer` (does not move `length`)."""
        end = start + k.shape[2]
        if end > self.max_len:
            raise ValueError(f"KV cache overflow: writing up to slot {end}, capacity is {self.max_len}")
        self.k[layer][:, :, start:end] = k
        self.v[layer][:, :, start:end] = v

    def view(self, layer: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v of slots [0, end) of `layer`."""
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end]

    def advance(self, n: int) -> None:
        if self.length + n > self.max_len:
            raise ValueError(f"KV cache overflow: length {self.length} + {n} > capacity {self.max_len}")
        self.length += n

    def rollback(self, n: int) -> None:
        """Keep the first `n` tokens (a pointer move, no copy)."""
        if not 0 <= n <= self.length:
            raise ValueError(f"cannot roll back a KV cache of length {self.length} to {n}")
        self.length = n

"""Static key/value caches: preallocated once, rolled back by moving a length pointer.

`KVCache` keeps the length on the host (a Python int): attention sees exactly the valid slots.
`DeviceKVCache` keeps it on the device (a 0-dim int64 tensor), so one captured CUDA graph serves
every step: writes land at device-computed slots, attention gets the whole capacity and a
visibility that hides slots at or beyond the length. Both answer the same calls, so the model's
forward is written once.
"""

from __future__ import annotations

import torch

from specpilot.hf.config import ModelConfig


class KVCache:
    """Per layer k and v of shape [B, num_kv_heads, max_len, head_dim]; `length` tokens are valid.

    Slots at and beyond `length` hold stale values that are never read: the next write overwrites
    them. All rows of the batch share one length (no ragged batches yet).
    """

    def __init__(self, k: list[torch.Tensor], v: list[torch.Tensor], max_len: int,
                 stacked: torch.Tensor | None = None) -> None:
        self.k = k
        self.v = v
        self.max_len = max_len
        self.length = 0
        self.stacked = stacked  # [2, layers, B, Hkv, max_len, D] that k and v view, when built so

    @classmethod
    def for_model(
        cls, cfg: ModelConfig, batch: int, max_len: int, dtype: torch.dtype, device: torch.device | str
    ) -> KVCache:
        """One buffer for every layer's k and v (each a view), so a move of slots in all layers
        (tree compaction) is one gather and one scatter."""
        stacked = torch.zeros((2, cfg.num_layers, batch, cfg.num_kv_heads, max_len, cfg.head_dim), dtype=dtype,
                              device=device)
        return cls(list(stacked[0]), list(stacked[1]), max_len, stacked)

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

    def reset(self) -> None:
        """Empty: length 0 (the slots keep stale values, never read)."""
        self.length = 0

    def key_slots(self, t: int) -> int:
        """How many key slots attention gets for `t` new tokens: exactly the valid ones."""
        return self.length + t


class DeviceKVCache(KVCache):
    """A KVCache whose `length` is a 0-dim int64 tensor on the cache's device.

    Nothing here reads the length on the host, so a forward over it can be captured in a CUDA
    graph and replayed at any length. The price: no overflow checks (callers size the capacity),
    and attention is handed all `max_len` slots with the stale ones masked (`key_slots`).
    """

    def __init__(self, k: list[torch.Tensor], v: list[torch.Tensor], max_len: int,
                 stacked: torch.Tensor | None = None) -> None:
        super().__init__(k, v, max_len, stacked)
        self.length = torch.zeros((), dtype=torch.long, device=k[0].device)

    def write(self, layer: int, start: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        slots = start + torch.arange(k.shape[2], device=k.device)
        self.k[layer].index_copy_(2, slots, k)
        self.v[layer].index_copy_(2, slots, v)

    def view(self, layer: int, end: object = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Every slot: which ones a query sees is the visibility's business."""
        return self.k[layer], self.v[layer]

    def advance(self, n: int | torch.Tensor) -> None:
        self.length += n

    def rollback(self, n: int | torch.Tensor) -> None:
        self.length.copy_(torch.as_tensor(n))

    def reset(self) -> None:
        self.length.zero_()

    def key_slots(self, t: int) -> int:
        return self.max_len

"""DFlash-style drafter: drafts a whole block in one non-causal pass, conditioned on target hidden states.

Layout follows HF transformers' DFlash assistants (muse_glimmer_assistant): weight names
`encoder.fc`, `encoder.output_norm_enc`, `layers.{i}.*`, `norm`; no embedding and no lm_head of
its own (the target's are shared).

Per layer, keys/values come from [projected context ; block hidden states] and queries from the
block only; the block sees itself and all context (no mask). The context K/V of a layer depend only
on the projected context features (not on the layer's input), so they are computed once per
context token and kept in the cache ("context-only drafter KV"); block K/V are scratch.

Not modelled: sliding-window attention (`layer_types` "sliding_attention" in muse assistant
configs). Outputs stay lossless through verification; acceptance may differ beyond the window.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from specpilot.runtime.cache import DeviceKVCache, KVCache
from specpilot.hf.config import DrafterConfig
from specpilot.runtime.model import DecoderLayer, RMSNorm, RopeTables, Visibility, slots_below


class ContextProjection(nn.Module):
    """Concatenated target hidden states [.., n_layers * H] -> drafter context features [.., H]."""

    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__()
        h = cfg.model.hidden_size
        self.fc = nn.Linear(len(cfg.target_layer_ids) * h, h, bias=False)
        self.output_norm_enc = RMSNorm(h, cfg.model.rms_norm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.output_norm_enc(self.fc(x))


class DFlashDrafter(nn.Module):
    def __init__(
        self,
        cfg: DrafterConfig,
        embed: Callable[[torch.Tensor], torch.Tensor],
        head: Callable[[torch.Tensor], torch.Tensor],
    ) -> None:
        """`embed` (ids -> [.., H]) and `head` (normalised [.., H] -> float32 logits) are the target's;
        they are kept as plain callables, so the target's weights are not part of this module."""
        super().__init__()
        if cfg.kind != "dflash":
            raise ValueError(f"DFlashDrafter needs a dflash config, got kind={cfg.kind!r}")
        self.cfg = cfg
        self.encoder = ContextProjection(cfg)
        self.layers = nn.ModuleList(DecoderLayer(cfg.model) for _ in range(cfg.model.num_layers))
        self.norm = RMSNorm(cfg.model.hidden_size, cfg.model.rms_norm_eps)
        self._shared = (embed, head)  # a plain tuple: never registered as submodules or parameters
        self._rope = RopeTables(cfg.model)
        self.fused = None  # a FusedDFlash serving add_context and forward (runtime/fused.py), when installed

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self._shared[0](ids)

    def head(self, h: torch.Tensor) -> torch.Tensor:
        return self._shared[1](h)

    def set_head(self, head: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Serve the logits with `head` instead of the target's (a reduced draft vocabulary)."""
        self._shared = (self._shared[0], head)

    @property
    def target_layer_ids(self) -> tuple[int, ...]:
        return self.cfg.target_layer_ids

    @property
    def block_size(self) -> int:
        return self.cfg.block_size

    @property
    def mask_token_id(self) -> int:
        return self.cfg.mask_token_id

    @property
    def dtype(self) -> torch.dtype:
        return self.norm.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.norm.weight.device

    def new_cache(self, batch: int, max_len: int, *, device_length: bool = False) -> KVCache:
        """`max_len` slots: the context plus one block of scratch must fit (see Transformer.new_cache)."""
        kind = DeviceKVCache if device_length else KVCache
        self._rope.cover(max_len, self.device, self.dtype)
        return kind.for_model(self.cfg.model, batch, max_len, self.dtype, self.device)

    def rope(self, positions: torch.Tensor, below: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [B, 1, T, D] for positions [B, T] (Transformer.rope: `below` lets the rows
        come from the table)."""
        return self._rope(positions, self.dtype, below)

    def _slots_rope(self, cache: KVCache, t: int, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE of t tokens at slots cache.length..: a token's position is its slot."""
        return self.rope((torch.arange(t, device=self.device) + cache.length).expand(batch, t), slots_below(cache, t))

    def add_context(self, new_context_hidden: torch.Tensor, cache: KVCache, count: torch.Tensor | None = None) -> None:
        """Append K/V of n_new context tokens [B, n_new, len(target_layer_ids) * H] at positions
        cache.length.. in every layer, permanently (cache.length grows by n_new).

        With `count` (a device tensor, for a DeviceKVCache under a CUDA graph) all n_new rows are
        written but only the first `count` are kept: the rest are scratch for the next write.
        """
        if self.fused is not None:  # the same wiring with fused kernels (runtime/fused.py)
            return self.fused.add_context(new_context_hidden, cache, count)
        b, n, _ = new_context_hidden.shape
        if n == 0:
            return
        ctx = self.encoder(new_context_hidden.to(self.dtype))
        cos, sin = self._slots_rope(cache, n, b)
        for i, layer in enumerate(self.layers):
            k, v = layer.self_attn.keys_values(ctx, cos, sin)
            cache.write(i, cache.length, k, v)
        cache.advance(n if count is None else count)

    def forward(
        self, block_ids: torch.Tensor, new_context_hidden: torch.Tensor, cache: KVCache, count: torch.Tensor | None = None
    ) -> torch.Tensor:
        """block_ids [B, block_size] = [anchor, mask x (block_size-1)] -> logits [B, block_size-1, V].

        The new context is kept (see add_context, and `count` there); the block sits at the
        positions right after the context, is not kept, and position j (1..block_size-1) predicts
        the token AT position j.
        """
        if self.fused is not None:
            return self.fused(block_ids, new_context_hidden, cache, count)
        self.add_context(new_context_hidden, cache, count)
        b, s = block_ids.shape
        ctx_len = cache.length
        cos, sin = self._slots_rope(cache, s, b)
        x = self.embed(block_ids).to(self.dtype)
        vis = Visibility("full", ctx_len, s, x.device, cache.key_slots(s))  # the block sees itself and all context
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            h = layer.input_layernorm(x)
            k, v = attn.keys_values(h, cos, sin)
            cache.write(i, ctx_len, k, v)  # scratch slots past `length`: overwritten by later context
            k_all, v_all = cache.view(i, ctx_len + s)
            x = x + attn.output(attn.attention(attn.queries(h, cos, sin), k_all, v_all, vis))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.head(self.norm(x[:, 1:]))

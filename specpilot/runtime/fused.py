"""The decoder stack with fused kernels: ten launches a layer instead of about forty.

At batch 1 a decoder step is latency-bound: each small torch op (RMSNorm's fp32 pieces, RoPE's
cat/mul/add, separate q/k/v and gate/up projections, SiLU·mul, cache writes) is a kernel launch
of a few microseconds, and at Llama-3.1-8B shapes those cost as much as reading the weights
(bench/results/step_times_h200.json: 7.16 ms against a 3.64 ms floor). Per layer here:

  rmsnorm (+ the previous residual add) -> q|k|v in one GEMM -> qk-norm + RoPE + KV-cache write
  -> attention -> o_proj -> rmsnorm + residual add -> gate|up in one GEMM -> SiLU·mul -> down_proj

q/k/v and gate/up are concatenated once at install; the original projections become views of the
concatenated weights, so no memory is doubled. Projections served by another module (a u12
kernel, say) are called one by one instead. The residual stream is carried beside the layer
output, so each residual add happens inside the next RMSNorm kernel, rounded where the reference
rounds it: in bf16 the result equals Transformer's own forward bit for bit wherever the kernels
do (see each kernel's docstring), and token forcing judges the rest.

`ops` picks the implementations: the Triton kernels on a GPU (or under TRITON_INTERPRET=1), their
torch references elsewhere, so the CPU tests run exactly this wiring.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from specpilot.runtime.cache import KVCache
from specpilot.runtime.model import Attention, DecoderLayer, Transformer, Visibility


@dataclass(frozen=True)
class FusedOps:
    rmsnorm: Callable
    rope_qkv: Callable
    silu_mul: Callable
    name: str


def fused_ops(kind: str) -> FusedOps:
    """"triton": the kernels; "torch": their references (same signatures)."""
    from specpilot.kernels import rmsnorm, rope_kv, silu_mul

    if kind == "triton":
        return FusedOps(rmsnorm.rmsnorm, rope_kv.rope_qkv, silu_mul.silu_mul, kind)
    if kind == "torch":
        return FusedOps(rmsnorm.rmsnorm_reference, rope_kv.rope_qkv_reference, silu_mul.silu_mul_reference, kind)
    raise ValueError(f"fused ops are 'triton' or 'torch', got {kind!r}")


def _concat(modules: list[nn.Module]) -> torch.Tensor | None:
    """Concatenate plain linears' weights (rows) and re-point each module at its slice; None if
    any module is not a plain nn.Linear (another format serves it)."""
    if not all(type(m) is nn.Linear for m in modules):
        return None
    fused = torch.cat([m.weight.detach() for m in modules])
    row = 0
    for m in modules:
        n = m.weight.shape[0]
        m.weight = nn.Parameter(fused[row : row + n], requires_grad=False)
        row += n
    return fused


class FusedLayer:
    def __init__(self, layer: DecoderLayer) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        self.layer = layer
        self.qkv = _concat([attn.q_proj, attn.k_proj, attn.v_proj])
        self.gate_up = _concat([mlp.gate_proj, mlp.up_proj])

    def project_qkv(self, h: torch.Tensor) -> torch.Tensor:
        if self.qkv is not None:
            return F.linear(h, self.qkv)
        a = self.layer.self_attn
        return torch.cat([a.q_proj(h), a.k_proj(h), a.v_proj(h)], dim=-1)

    def project_gate_up(self, h: torch.Tensor) -> torch.Tensor:
        if self.gate_up is not None:
            return F.linear(h, self.gate_up)
        m = self.layer.mlp
        return torch.cat([m.gate_proj(h), m.up_proj(h)], dim=-1)


class FusedDecoder:
    """Runs a Transformer's layers and final norm with `ops`; installed as `model.fused`."""

    def __init__(self, model: Transformer, ops: FusedOps) -> None:
        self.model = model
        self.ops = ops
        self.layers = [FusedLayer(layer) for layer in model.model.layers]
        cfg = model.cfg
        self.eps = cfg.rms_norm_eps
        self.heads, self.kv_heads = cfg.num_heads, cfg.num_kv_heads

    def __call__(
        self, x: torch.Tensor, positions: torch.Tensor, cache: KVCache, vis: Visibility, hidden_layers: tuple[int, ...]
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """x: embeddings [B, T, H]. Returns (final-normed hidden states, picked layer outputs).
        Writes the new tokens' K/V at slots cache.length.. (the caller advances the length)."""
        ops, (b, t) = self.ops, x.shape[:2]
        slots = (torch.arange(t, device=x.device) + cache.length).expand(b, t)
        cos, sin = self.model.rope(positions)  # once a forward, for every layer
        end = cache.length + t  # once a forward too: on a device-length cache each add is a launch
        picked: dict[int, torch.Tensor] = {}
        out, residual = x, None
        for i, fl in enumerate(self.layers):
            layer, attn = fl.layer, fl.layer.self_attn
            if residual is None:
                h, residual = ops.rmsnorm(out, layer.input_layernorm.weight, self.eps), out
            else:
                h, residual = ops.rmsnorm(out, layer.input_layernorm.weight, self.eps, residual=residual)
            q = ops.rope_qkv(
                fl.project_qkv(h), cos, sin, cache.k[i], cache.v[i], slots, num_heads=self.heads,
                num_kv_heads=self.kv_heads, q_norm_weight=_w(attn.q_norm), k_norm_weight=_w(attn.k_norm), eps=self.eps,
            )
            k_all, v_all = cache.view(i, end)
            o = attn.output(attn.attention(q, k_all, v_all, vis))
            h, residual = ops.rmsnorm(o, layer.post_attention_layernorm.weight, self.eps, residual=residual)
            out = layer.mlp.down_proj(ops.silu_mul(fl.project_gate_up(h)))
            if i in hidden_layers:
                picked[i] = residual + out
        normed, _ = ops.rmsnorm(out, self.model.model.norm.weight, self.eps, residual=residual)
        return normed, picked


def _w(norm: nn.Module | None) -> torch.Tensor | None:
    return None if norm is None else norm.weight


def install_fused(model: Transformer, kind: str | None = None) -> FusedDecoder:
    """Serve `model`'s forward with the fused decoder (kernels on CUDA or under the interpreter,
    references elsewhere, unless `kind` says)."""
    if kind is None:
        on_gpu = model.device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"
        kind = "triton" if on_gpu else "torch"
    model.fused = FusedDecoder(model, fused_ops(kind))
    return model.fused


def split_kv_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, vis: Visibility) -> torch.Tensor:
    """The split-KV Triton kernel under `vis` (an `Attention.attention` implementation)."""
    from specpilot.kernels.attention_split_kv import attention_split_kv

    return attention_split_kv(q, k, v, past=vis.past, mask=vis.new, scale=q.shape[-1] ** -0.5)


@contextmanager
def fused_path(model: Transformer, *others: nn.Module):
    """For the duration: `model` served by the fused decoder (installed once, kept) and split-KV
    attention, as the fused-decoder and attention-split-kv passes would build it; `others`
    (drafters) get split-KV attention too. Restored after, so benchmarks can compare paths on one
    set of weights. Graphed runners are keyed by this setup (graph_decode.runner_for)."""
    decoder = getattr(model, "_fused_kept", None) or install_fused(model)
    model._fused_kept = decoder
    attentions = [m for root in (model, *others) for m in root.modules() if isinstance(m, Attention)]
    before = [a.attention for a in attentions]
    model.fused = decoder
    for a in attentions:
        a.attention = split_kv_attention
    try:
        yield model
    finally:
        model.fused = None
        for a, fn in zip(attentions, before):
            a.attention = fn

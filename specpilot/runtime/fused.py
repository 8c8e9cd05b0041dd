"""The decoder stack with fused kernels: about ten launches a layer instead of about forty.

At batch 1 a decoder step is latency-bound: each small torch op (RMSNorm's fp32 pieces, RoPE's
cat/mul/add, separate q/k/v and gate/up projections, SiLU·mul, cache writes) is a launch of a few
microseconds, and at 8B shapes those cost as much as reading the weights. Per layer here:

  rmsnorm (+ the previous residual add) -> q|k|v in one GEMM -> qk-norm + RoPE + KV-cache write
  -> attention -> o_proj -> rmsnorm + residual add -> gate|up in one GEMM -> SiLU·mul -> down_proj

Where a layer's attention is the split-KV kernel, `rope_attention` does qk-norm, RoPE, the cache
write and attention in one launch. At the rows `FusedOps.linear_serves` takes, `linear`
(fused_linear) takes the norms into the q|k|v and gate|up GEMMs' prologues, SiLU·mul into gate|up's
epilogue and the residual adds into o's and down's (the residual stream updated in place): seven
launches a layer (`run_layers_linear`); o's and down's epilogues also leave the stream's sums of
squares for the next norm (RowSquares). u12 layers run `linear_u12` (u12_fused_linear) the same
way but with their norms apart: o's and down's residual epilogues hand the stream's norm to the GEMV
after them (NormHandoff), so only the first layer's input norm and the final norm stay rmsnorm
kernels.

q/k/v and gate/up are concatenated once at install; the original projections become views of the
concatenated weights (bf16 or u12), so no memory is doubled. The residual stream is carried beside
the layer output, so each residual add happens inside the next RMSNorm kernel, rounded where the
reference rounds it: in bf16 the result equals Transformer's own forward bit for bit wherever the
kernels do, and token forcing judges the rest.

The DFlash drafter's block layers run the same loop (`FusedStack.run_layers`) over [context ;
block] with full visibility; its context K/V come from one k|v GEMM a layer (the rows of the
concatenated q|k|v weight after q's) into rope_qkv with no q heads.

`FusedOps` is the hook point: the stack calls only what it holds. The runtime imports no kernel;
a backend (specpilot/backends/kernel_hooks.py) fills it with the Triton kernels on a GPU (or under
TRITON_INTERPRET=1) or with their torch references, so the CPU tests run exactly this wiring.
Measurements behind the policy defaults: docs/experiments/fused-stack.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from specpilot.runtime.cache import KVCache
from specpilot.hf.config import ModelConfig
from specpilot.runtime.dflash import DFlashDrafter
from specpilot.runtime.model import Attention, DecoderLayer, Transformer, Visibility, slots_below
from specpilot.runtime.shared_weights import shared_concat
from specpilot.formats.u12 import U12Tensor, concat_u12


# fused_linear's GEMV kernel serves up to this many rows, its tensor-core kernel more; so do
# u12_fused_linear's (its mma and hmma epilogues: FusedOps.u12_many_rows).
GEMV_ROWS = 4


@dataclass(frozen=True)
class FusedOps:
    """What the fused stacks call, and at which rows. The callables are a backend's (the kernels or
    their torch references, same signatures); the row limits are the serving policy, each default
    chosen by an interleaved step measurement (docs/experiments/fused-stack.md names the files)."""

    rmsnorm: Callable
    rope_qkv: Callable
    silu_mul: Callable
    name: str
    linear: Callable | None = None  # fused_linear: RMSNorm prologue, SiLU·mul / residual-add epilogues
    linear_max_m: int = 32  # rows (B·T) up to which `linear` (`linear_u12`) may serve the layers; 0: never
    linear_u12: Callable | None = None  # u12_fused_linear: the same over u12 weights
    u12_kernel: str = ""  # the u12 modules' kernel that `linear_u12` stands in for; "": u12 layers unfused
    rope_attention: Callable | None = None  # rope_qkv + split-KV attention in one launch, for layers whose
    split_kv: Callable | None = None  # attention is this split-KV kernel
    u12_norms_apart: bool = True  # u12 layers under `linear_u12`: their RMSNorms as rmsnorm kernels, no prologue
    u12_norm_handoff: bool = True  # and where o or down and the GEMV after them are u12 GEMVs: the norm between
    # them handed on (`norm_handoff`) instead of an rmsnorm kernel
    row_squares: bool = True  # `linear`'s residual epilogues hand the stream's Σ y² to the next norm
    linear_gemv_max_m: int = 1  # of linear_max_m, the GEMV kernels' rows (<= GEMV_ROWS) served: the rest of
    # 1..GEMV_ROWS stays unfused; above GEMV_ROWS only plain layers are served (`linear_serves`)
    linear_gap: tuple[int, int] = (17, 31)  # rows lo..hi (inclusive) that stay unfused; (0, 0): none
    u12_many_rows: int = 16  # u12 layers served above GEMV_ROWS up to this many rows too; 0: none
    new_row_squares: Callable[[], object] | None = None  # the kernels' RowSquares (None: a norm reads x)
    norm_handoff: Callable[[torch.Tensor, float], object] | None = None  # u12_fused_linear's NormHandoff
    u12_fuses: Callable[[int, int, int], bool] | None = None  # whether linear_u12 fuses (rows, K, base)
    u12_project: Callable | None = None  # u12_linear (x, U12Tensor, launch=): the u12 projections of
    # ops.u12_kernel that linear_u12 does not serve, so that they take the forward's launch too
    # How the kernels launch (the backend's kernels.overlap.Launch: PDL mode, L2 prefetch), passed to
    # every call as launch=; None for the references, which launch nothing.
    launch: Any = None
    u12_launch: Any = None  # the launch of a u12 stack's forwards of u12_launch_rows rows or fewer
    u12_launch_rows: int = 32

    def __post_init__(self) -> None:
        if isinstance(self.u12_many_rows, bool) or self.u12_many_rows < 0:
            raise ValueError(f"FusedOps.u12_many_rows: expected a row count (0: none), got {self.u12_many_rows!r}")

    def linear_serves(self, rows: int, u12: bool) -> bool:
        """Whether `linear` (`linear_u12` for u12 layers) serves a forward of `rows` rows (B·T). The
        gap is fused_linear's (its 32-row tiles against cuBLAS's); u12 layers above GEMV_ROWS run
        the same mma and hmma tiles fused or not, so up to u12_many_rows no gap applies to them."""
        if self.linear is None or rows > self.linear_max_m:
            return False
        if u12 and GEMV_ROWS < rows <= self.u12_many_rows:
            return True
        if self.linear_gap[0] <= rows <= self.linear_gap[1]:
            return False
        return rows <= self.linear_gemv_max_m or (rows > GEMV_ROWS and not u12)

    def launch_for(self, rows: int, serves_u12: bool) -> Any:
        """The launch of a forward of `rows` rows: u12_launch for a u12 stack's few rows, else launch."""
        if self.u12_launch is not None and serves_u12 and rows <= self.u12_launch_rows:
            return self.u12_launch
        return self.launch


Project = Callable[[torch.Tensor], torch.Tensor]
Project2 = Callable[[Callable, torch.Tensor], torch.Tensor]  # (projection, h) -> projection's output


def _apply(projection: Callable, h: torch.Tensor) -> torch.Tensor:
    return projection(h)


def _concat(modules: list[nn.Module]) -> tuple[Project, Callable[[int], Project]] | None:
    """One projection serving `modules` side by side, over concatenated weights that each module
    then views (no memory doubled), and a maker of projections over its rows from a given row on;
    None if the modules are neither all plain nn.Linear nor all u12 modules of one kernel (a
    `packed` U12Tensor, re-packed as one tensor: exact; its window is chosen for the whole).
    Plain weights shared by a search's engines (runtime/shared_weights.py) concatenate once for all."""
    if all(type(m) is nn.Linear for m in modules):
        fused = shared_concat([m.weight.detach() for m in modules])
        row = 0
        for m in modules:
            n = m.weight.shape[0]
            m.weight = nn.Parameter(fused[row : row + n], requires_grad=False)
            row += n
        return _Linear(fused), lambda start: _Linear(fused[start:])
    kinds = {(type(m), getattr(m, "kernel", None)) for m in modules}
    if len(kinds) == 1 and all(isinstance(getattr(m, "packed", None), U12Tensor) for m in modules):
        (module_type, kernel), = kinds
        fused = concat_u12([m.packed for m in modules])
        row = 0
        for m in modules:
            n = m.packed.shape[0]
            m.packed = fused.rows(row, row + n)
            row += n
        return module_type(fused, kernel), lambda start: module_type(fused.rows(start, fused.shape[0]), kernel)
    return None


class _Linear:
    """F.linear over a fixed weight (a concatenated one, or rows of it), which fused_linear can read."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class FusedLayer:
    """A decoder layer's projections for the fused stacks: q|k|v and gate|up each one projection
    over concatenated weights (bf16 or u12), else the projections one by one."""

    def __init__(self, layer: DecoderLayer) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        self.layer = layer
        q_rows = attn.num_heads * attn.head_dim
        qkv = _concat([attn.q_proj, attn.k_proj, attn.v_proj])
        self.qkv, self.kv = (qkv[0], qkv[1](q_rows)) if qkv else (None, None)  # kv: the rows after q's
        gate_up = _concat([mlp.gate_proj, mlp.up_proj])
        self.gate_up = gate_up[0] if gate_up else None

    def linear_weights(self, u12_kernel: str) -> tuple[torch.Tensor | U12Tensor, ...] | None:
        """(q|k|v, o, gate|up, down) weights where each is plain (the concatenated ones, nn.Linear
        o/down: fused_linear serves them) or u12 in a module of kernel `u12_kernel` (u12_fused_linear
        serves them); else None."""
        attn, mlp = self.layer.self_attn, self.layer.mlp
        weights = tuple(_weight(p, u12_kernel) for p in (self.qkv, attn.o_proj, self.gate_up, mlp.down_proj))
        return None if any(w is None for w in weights) else weights

    def project_qkv(self, h: torch.Tensor, run: Project2 = _apply) -> torch.Tensor:
        """q|k|v of h; `run(projection, h)` runs each projection (the stack's: with its launch)."""
        if self.qkv is not None:
            return run(self.qkv, h)
        a = self.layer.self_attn
        return torch.cat([run(a.q_proj, h), run(a.k_proj, h), run(a.v_proj, h)], dim=-1)

    def project_kv(self, h: torch.Tensor, run: Project2 = _apply) -> torch.Tensor:
        if self.kv is not None:
            return run(self.kv, h)
        a = self.layer.self_attn
        return torch.cat([run(a.k_proj, h), run(a.v_proj, h)], dim=-1)

    def project_gate_up(self, h: torch.Tensor, run: Project2 = _apply) -> torch.Tensor:
        if self.gate_up is not None:
            return run(self.gate_up, h)
        m = self.layer.mlp
        return torch.cat([run(m.gate_proj, h), run(m.up_proj, h)], dim=-1)


def write_slots(cache: KVCache, b: int, t: int, device: torch.device) -> tuple[torch.Tensor, int | torch.Tensor]:
    """Slots [B, T] of t new tokens at cache.length.., and the end slot for attention: once a
    forward (on a device-length cache each add is a launch). A host-length cache is checked for
    overflow here, as KVCache.write would (the kernels do not check their slots)."""
    end = cache.length + t
    if isinstance(end, int) and end > cache.max_len:
        raise ValueError(f"KV cache overflow: writing up to slot {end}, capacity is {cache.max_len}")
    return (torch.arange(t, device=device) + cache.length).expand(b, t), end


class FusedStack:
    """Decoder layers served by `ops`: the loop the target's and the DFlash drafter's stacks share."""

    def __init__(self, layers: nn.ModuleList, cfg: ModelConfig, ops: FusedOps) -> None:
        self.ops = ops
        self.layers = [FusedLayer(layer) for layer in layers]
        self.eps = cfg.rms_norm_eps
        self.heads, self.kv_heads = cfg.num_heads, cfg.num_kv_heads

    def run_layers(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache, vis: Visibility,
        slots: torch.Tensor, end: int | torch.Tensor, hidden_layers: tuple[int, ...] = (), launch: Any = None,
    ) -> tuple[torch.Tensor, torch.Tensor, dict[int, torch.Tensor]]:
        """x [B, T, H] through every layer, writing the tokens' K/V at `slots` and attending over
        slots [0, end) under `vis`. Returns (the last MLP's output, the residual stream it adds
        to, picked layer outputs): the caller's final rmsnorm does that last add (`final_norm`).
        At the rows that ops.linear_serves takes, layers of plain weights (and u12 ones of
        ops.u12_kernel), `run_layers_linear` serves them instead. `launch`: every kernel call's
        (FusedOps.launch_for)."""
        ops, rows = self.ops, x.shape[0] * x.shape[1]
        if ops.linear is not None and rows <= ops.linear_max_m:
            weights = [fl.linear_weights(ops.u12_kernel) for fl in self.layers]
            u12 = any(isinstance(w, U12Tensor) for ws in weights if ws is not None for w in ws)
            if all(w is not None for w in weights) and ops.linear_serves(rows, u12):
                return self.run_layers_linear(x, cos, sin, cache, vis, slots, end, weights, hidden_layers, launch)

        def run(projection, h):
            return self.project(projection, h, launch)

        picked: dict[int, torch.Tensor] = {}
        out, residual = x, None
        for i, fl in enumerate(self.layers):
            layer, attn = fl.layer, fl.layer.self_attn
            if residual is None:
                h, residual = ops.rmsnorm(out, layer.input_layernorm.weight, self.eps, launch=launch), out
            else:
                h, residual = ops.rmsnorm(out, layer.input_layernorm.weight, self.eps, residual=residual, launch=launch)
            o = self.attend(i, fl.project_qkv(h, run), cos, sin, cache, vis, slots, end, launch=launch)
            o = run(attn.o_proj, o.transpose(1, 2).reshape(o.shape[0], o.shape[2], -1))  # Attention.output
            h, residual = ops.rmsnorm(o, layer.post_attention_layernorm.weight, self.eps, residual=residual,
                                      launch=launch)
            out = run(layer.mlp.down_proj, ops.silu_mul(fl.project_gate_up(h, run), launch=launch))
            if i in hidden_layers:
                picked[i] = residual + out
        return out, residual, picked

    def project(self, projection: Callable, h: torch.Tensor, launch: Any = None) -> torch.Tensor:
        """projection(h); a u12 projection of ops.u12_kernel through ops.u12_project, with `launch`."""
        w = _weight(projection, self.ops.u12_kernel) if self.ops.u12_project is not None else None
        if isinstance(w, U12Tensor):
            return self.ops.u12_project(h.reshape(-1, h.shape[-1]), w, launch=launch).reshape(*h.shape[:-1], -1)
        return projection(h)

    def run_layers_linear(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache, vis: Visibility,
        slots: torch.Tensor, end: int | torch.Tensor, weights: list[tuple[torch.Tensor, ...]],
        hidden_layers: tuple[int, ...] = (), launch: Any = None,
    ) -> tuple[None, torch.Tensor, dict[int, torch.Tensor]]:
        """run_layers with ops.linear (ops.linear_u12 for u12 weights) doing the norms, SiLU·mul and
        residual adds around its GEMMs: five launches a layer fewer (with ops.u12_norms_apart, u12
        layers keep their norms as rmsnorm kernels: one fewer, SiLU·mul's). The residual stream (a copy of
        x) is updated in place by the o and down projections' epilogues, so it returns (None, the
        stream, picked layer outputs)."""
        ops, (b, t, hidden) = self.ops, x.shape
        stream = x.reshape(b * t, hidden).clone()
        picked: dict[int, torch.Tensor] = {}
        squares = ops.new_row_squares() if ops.row_squares and ops.new_row_squares else None  # the stream's Σ y²

        handoff: list = [None]  # the NormHandoff a residual u12 GEMV left for the next norm's GEMV

        def linear(h, w, norm_weight=None, hand_to=None, **kw):
            """hand_to (a residual GEMV): (the next norm's weight, the weight of the GEMV after it)."""
            if not isinstance(w, U12Tensor):
                return ops.linear(h, w, norm_weight=norm_weight, eps=self.eps, squares=squares, launch=launch, **kw)
            if norm_weight is not None and handoff[0] is not None:  # the norm handed on by the GEMV before
                hand, handoff[0] = handoff[0], None
                return ops.linear_u12(hand.xg, w, hand_in=hand, launch=launch, **kw)
            if norm_weight is not None and ops.u12_norms_apart:  # the stream holds every add already
                h, norm_weight = ops.rmsnorm(h, norm_weight, self.eps, launch=launch), None
            if hand_to is not None and self._hands_norm(h, w, hand_to[1]):
                handoff[0] = ops.norm_handoff(hand_to[0], self.eps)
                return ops.linear_u12(h, w, eps=self.eps, hand_out=handoff[0], launch=launch, **kw)
            return ops.linear_u12(h, w, norm_weight=norm_weight, eps=self.eps, launch=launch, **kw)

        for i, (fl, (w_qkv, w_o, w_gate_up, w_down)) in enumerate(zip(self.layers, weights)):
            layer = fl.layer
            qkv = linear(stream, w_qkv, norm_weight=layer.input_layernorm.weight)
            # with the L2 prefetch on, o's weight streams into L2 while RoPE and attention run
            o = self.attend(i, qkv.view(b, t, -1), cos, sin, cache, vis, slots, end, launch=launch,
                            prefetch=(w_o.sm, w_o.codes) if isinstance(w_o, U12Tensor) else w_o)  # [B, heads, T, D]
            linear(o.transpose(1, 2).reshape(b * t, -1), w_o, residual=stream,
                   hand_to=(layer.post_attention_layernorm.weight, w_gate_up))
            act = linear(stream, w_gate_up, norm_weight=layer.post_attention_layernorm.weight, gated=True)
            after = (self.layers[i + 1].layer.input_layernorm.weight, weights[i + 1][0]) if i + 1 < len(weights) else None
            linear(act, w_down, residual=stream, hand_to=after)
            if i in hidden_layers:
                picked[i] = stream.view(b, t, hidden).clone()
        return None, stream.view(b, t, hidden), picked

    def _hands_norm(self, h: torch.Tensor, w: U12Tensor, w_next) -> bool:
        """Whether the residual u12 GEMV of w over h hands the next norm on to the GEMV of w_next
        (ops.u12_norm_handoff, both u12 GEMVs that u12_fused_linear fuses at h's rows)."""
        ops, rows = self.ops, h.shape[0]
        return (ops.u12_norm_handoff and ops.u12_norms_apart and ops.norm_handoff is not None
                and ops.u12_fuses is not None and isinstance(w_next, U12Tensor)
                and ops.u12_fuses(rows, w.shape[1], w.base) and ops.u12_fuses(rows, w_next.shape[1], w_next.base))

    def attend(
        self, i: int, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache, vis: Visibility,
        slots: torch.Tensor, end: int | torch.Tensor, prefetch=None, launch: Any = None,
    ) -> torch.Tensor:
        """Layer i's attention output [B, heads, T, D] from its q|k|v projection [B, T, ·], the new
        K/V written at `slots` (past.. under `vis`, as write_slots gives them): one rope_attention
        launch where the layer runs the split-KV kernel (unless `launch` asks rope_qkv to prefetch
        `prefetch`, the next weight, into L2), else rope_qkv and the layer's attention."""
        ops, attn = self.ops, self.layers[i].layer.self_attn
        norms = dict(q_norm_weight=_w(attn.q_norm), k_norm_weight=_w(attn.k_norm), eps=self.eps)
        split_kv = ops.split_kv is not None and attn.attention is ops.split_kv
        if ops.rope_attention is not None and split_kv and not getattr(launch, "prefetch", False):
            return ops.rope_attention(qkv, cos, sin, cache.k[i], cache.v[i], past=vis.past, mask=vis.new,
                                      num_heads=self.heads, num_kv_heads=self.kv_heads,
                                      scale=attn.head_dim ** -0.5, launch=launch, **norms)
        q = ops.rope_qkv(qkv, cos, sin, cache.k[i], cache.v[i], slots, num_heads=self.heads,
                         num_kv_heads=self.kv_heads, prefetch=prefetch, launch=launch, **norms)
        k_all, v_all = cache.view(i, end)
        return ops.split_kv(q, k_all, v_all, vis, launch=launch) if split_kv else attn.attention(q, k_all, v_all, vis)

    def final_norm(self, out: torch.Tensor | None, residual: torch.Tensor, weight: torch.Tensor,
                   launch: Any = None) -> torch.Tensor:
        """The final RMSNorm of run_layers' result, with the last residual add where it is pending."""
        if out is None:
            return self.ops.rmsnorm(residual, weight, self.eps, launch=launch)
        return self.ops.rmsnorm(out, weight, self.eps, residual=residual, launch=launch)[0]


class FusedDecoder(FusedStack):
    """Runs a Transformer's layers and final norm with `ops`; installed as `model.fused`."""

    def __init__(self, model: Transformer, ops: FusedOps) -> None:
        super().__init__(model.model.layers, model.cfg, ops)
        self.model = model

    def __call__(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache, vis: Visibility,
        hidden_layers: tuple[int, ...],
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """x: embeddings [B, T, H]; cos, sin: the new tokens' RoPE tables (Transformer.rope, once a
        forward for every layer). Returns (final-normed hidden states, picked layer outputs).
        Writes the new tokens' K/V at slots cache.length.. (the caller advances the length)."""
        slots, end = write_slots(cache, *x.shape[:2], x.device)
        launch = self.ops.launch_for(x.shape[0] * x.shape[1], self.serves_u12())
        out, residual, picked = self.run_layers(x, cos, sin, cache, vis, slots, end, hidden_layers, launch)
        return self.final_norm(out, residual, self.model.model.norm.weight, launch), picked

    def serves_u12(self) -> bool:
        """Whether the layers' projections are u12 weights that ops.linear_u12 serves (the first layer's say)."""
        weights = self.layers[0].linear_weights(self.ops.u12_kernel) if self.layers else None
        return weights is not None and any(isinstance(w, U12Tensor) for w in weights)


class FusedDFlash(FusedStack):
    """DFlashDrafter.add_context and forward with `ops`; installed as `drafter.fused`.

    Per context token: the projection and its norm, then a layer's k|v in one GEMM and rope_qkv
    without q heads. The block: the shared layer loop with full visibility over [context ; block].
    """

    def __init__(self, drafter: DFlashDrafter, ops: FusedOps) -> None:
        super().__init__(drafter.layers, drafter.cfg.model, ops)
        self.drafter = drafter

    def add_context(self, new_context_hidden: torch.Tensor, cache: KVCache, count: torch.Tensor | None = None) -> None:
        """DFlashDrafter.add_context: K/V of the new context tokens kept at cache.length.. (with
        `count`, only the first `count` of them)."""
        d, (b, n, _) = self.drafter, new_context_hidden.shape
        if n == 0:
            return
        launch = self.ops.launch
        ctx = self.ops.rmsnorm(d.encoder.fc(new_context_hidden.to(d.dtype)), d.encoder.output_norm_enc.weight, self.eps,
                               launch=launch)
        slots, _ = write_slots(cache, b, n, ctx.device)
        cos, sin = d.rope(slots, slots_below(cache, n))  # a context token's position is its slot
        for i, fl in enumerate(self.layers):
            self.ops.rope_qkv(fl.project_kv(ctx, lambda p, h: self.project(p, h, launch)), cos, sin, cache.k[i],
                              cache.v[i], slots, num_heads=0, num_kv_heads=self.kv_heads,
                              k_norm_weight=_w(fl.layer.self_attn.k_norm), eps=self.eps, launch=launch)
        cache.advance(n if count is None else count)

    def __call__(
        self, block_ids: torch.Tensor, new_context_hidden: torch.Tensor, cache: KVCache, count: torch.Tensor | None = None
    ) -> torch.Tensor:
        """DFlashDrafter.forward: logits [B, block_size-1, V]. The block's K/V are scratch at the
        slots right after the context (not kept: the length stays)."""
        d = self.drafter
        self.add_context(new_context_hidden, cache, count)
        b, s = block_ids.shape
        x = d.embed(block_ids).to(d.dtype)
        vis = Visibility("full", cache.length, s, x.device, cache.key_slots(s))  # the block sees itself and all context
        slots, end = write_slots(cache, b, s, x.device)
        cos, sin = d.rope(slots, slots_below(cache, s))  # so is a block token's
        out, residual, _ = self.run_layers(x, cos, sin, cache, vis, slots, end, launch=self.ops.launch)
        return d.head(self.final_norm(out, residual, d.norm.weight, self.ops.launch)[:, 1:])


def _weight(projection, u12_kernel: str) -> torch.Tensor | U12Tensor | None:
    """The weight a fused linear can read from `projection`: a plain one (a concatenation's or an
    nn.Linear's), or a u12 module's planes when its kernel is `u12_kernel`; else None."""
    if isinstance(projection, _Linear) or type(projection) is nn.Linear:
        return projection.weight
    packed = getattr(projection, "packed", None)
    if isinstance(packed, U12Tensor) and u12_kernel and getattr(projection, "kernel", None) == u12_kernel:
        return packed
    return None


def _w(norm: nn.Module | None) -> torch.Tensor | None:
    return None if norm is None else norm.weight


def install_fused(model: Transformer | DFlashDrafter, ops: FusedOps) -> FusedDecoder | FusedDFlash:
    """Serve `model`'s forward (a DFlash drafter's add_context too) with the fused stack over `ops`."""
    stack = FusedDFlash if isinstance(model, DFlashDrafter) else FusedDecoder
    model.fused = stack(model, ops)
    return model.fused

"""Our own llama/qwen3 forward over a static KV cache (no HF modules at run time).

Parameters live under the HF weight names ("model.layers.0.self_attn.q_proj.weight", ...), so an
HF safetensors state dict loads directly. The numerics follow HF transformers op for op (RMSNorm in
float32, RoPE tables in float32 cast to the model dtype, SwiGLU), which the tests check against
LlamaForCausalLM / Qwen3ForCausalLM.

Split of the output path: `forward` = `head(final_norm(layers(embed(ids))))`; drafters that share
the target's vocabulary call `embed` and `head` and bring their own final norm.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from specpilot.runtime.cache import DeviceKVCache, KVCache
from specpilot.hf.config import ModelConfig

ATTENTION_PROJ = ("q_proj", "k_proj", "v_proj", "o_proj")
SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
MLP_PROJ = ("gate_proj", "up_proj", "down_proj")


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_inv_freq(cfg: ModelConfig, device: torch.device | str) -> torch.Tensor:
    """Inverse frequencies [head_dim/2] in float32 (default or llama3-scaled, as HF computes them)."""
    dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).to(device, torch.float) / dim))
    s = cfg.rope_scaling
    if s is None:
        return inv_freq
    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def rope_cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [B, 1, T, head_dim] for positions [B, T], computed in float32 then cast to `dtype`."""
    freqs = positions.float()[..., None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)[:, None]
    return emb.cos().to(dtype), emb.sin().to(dtype)


class RopeTables:
    """cos and sin of every position below the largest cache made, one table a (device, dtype).

    rope_cos_sin is elementwise in the position, so a row of the table holds exactly what a
    forward would compute for that position. A forward whose positions are cache slots (so below
    the cache's capacity) gathers its rows in one launch instead of rope_cos_sin's seven (the
    float cast, the multiply, the cat, cos, sin and two casts): in a CUDA-graph step at 8B shapes
    each is a launch of 1-2 µs. Tables are built by `cover`, called from new_cache, so never
    inside a graph capture."""

    def __init__(self, cfg: ModelConfig) -> None:
        self._cfg = cfg
        self._freqs: dict[torch.device, torch.Tensor] = {}  # rope_inv_freq by device
        self._tables: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}
        # Every table ever built stays alive: a CUDA graph captured over a gather reads the table
        # it was captured with at every replay, after a larger one has replaced it here.
        self._kept: list[torch.Tensor] = []

    def _inv_freq(self, device: torch.device) -> torch.Tensor:
        if device not in self._freqs:
            self._freqs[device] = rope_inv_freq(self._cfg, device)
        return self._freqs[device]

    def cover(self, rows: int, device: torch.device, dtype: torch.dtype) -> None:
        """Make the table of (device, dtype) hold positions 0..rows-1 (built anew, for the next
        power of two, when it is shorter)."""
        table = self._tables.get((device, dtype))
        if table is None or table.shape[0] < rows:
            rows = 1 << max(rows - 1, 0).bit_length()
            cos, sin = rope_cos_sin(self._inv_freq(device), torch.arange(rows, device=device)[None], dtype)
            self._tables[device, dtype] = torch.stack((cos[0, 0], sin[0, 0]), dim=1)  # [rows, 2, D]
            self._kept.append(self._tables[device, dtype])

    def __call__(self, positions: torch.Tensor, dtype: torch.dtype,
                 below: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [B, 1, T, D] for positions [B, T]: gathered when the caller vouches that every
        position is below `below` and the table covers that many, else computed."""
        table = self._tables.get((positions.device, dtype))
        if below is None or table is None or below > table.shape[0]:
            return rope_cos_sin(self._inv_freq(positions.device), positions, dtype)
        rows = table[positions]  # [B, T, 2, D]: views of one gather, equal strides (as the rope kernels need)
        return rows[:, None, :, 0], rows[:, None, :, 1]


def slots_below(cache: KVCache, t: int) -> int | None:
    """The bound RopeTables may gather below for t new tokens at cache.length..: the capacity when
    they fit (a device length is taken to, as the kernels writing those slots take it), else None,
    so that an overflowing forward computes its RoPE and reaches the cache's own overflow error."""
    if isinstance(cache.length, int) and cache.length + t > cache.max_len:
        return None
    return cache.max_len


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Attention: q [B, H, T, D] over k, v [B, Hkv, S, D] (grouped heads) -> [B, H, T, D].

    `mask` is boolean [B or 1, 1, T, S], True where the key is visible; None means all visible.
    The default of every `Attention.attention`, which is where another kernel slots in.
    """
    if q.is_cuda:  # not cuDNN: it builds an execution plan for every new shape, and eager loops change it each step
        with sdpa_kernel(SDPA_BACKENDS):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=q.shape[-1] ** -0.5, enable_gqa=True)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=q.shape[-1] ** -0.5, enable_gqa=True)


def build_mask(mask: str | torch.Tensor, past: int, t: int, device: torch.device) -> torch.Tensor | None:
    """Boolean [B or 1, 1, T, past+T] for T new tokens after `past` cached ones (all of which are visible).

    "causal": new token i sees new tokens <= i. "full": the new tokens see each other (block
    non-causal). A bool tensor [T, T] or [B, T, T] gives the visibility among the new tokens (a tree).
    """
    if isinstance(mask, str):
        if mask == "full":
            return None
        if mask != "causal":
            raise ValueError(f"mask must be 'causal', 'full' or a bool tensor, got {mask!r}")
        if t == 1:  # one new token sees everything: no mask lets SDPA pick its fastest kernel
            return None
        keys = torch.arange(past + t, device=device)
        queries = torch.arange(past, past + t, device=device)
        return (keys[None, :] <= queries[:, None])[None, None]
    new = mask.to(device=device, dtype=torch.bool)
    if new.dim() == 2:
        new = new[None]
    if new.shape[-2:] != (t, t):
        raise ValueError(f"mask tensor must be [T, T] or [B, T, T] with T={t}, got {tuple(mask.shape)}")
    seen = torch.ones(new.shape[0], t, past, dtype=torch.bool, device=device)
    return torch.cat((seen, new), dim=-1)[:, None]


def build_mask_device(mask: str | torch.Tensor, past: torch.Tensor, t: int, keys: int, device: torch.device) -> torch.Tensor:
    """build_mask with `past` a device tensor, over `keys` slots (a static cache's capacity).

    Slots < past are visible, slots past..past+T-1 follow `mask` as in build_mask, and slots at
    or beyond past+T (stale) are hidden. No host sync: fit for CUDA-graph capture.
    """
    rel = torch.arange(keys, device=device) - past  # [S]: key slot relative to the first new token
    in_new = (rel >= 0) & (rel < t)
    if isinstance(mask, str):
        if mask == "full":
            new = in_new[None]
        elif mask == "causal":
            new = in_new & (rel[None] <= torch.arange(t, device=device)[:, None])
        else:
            raise ValueError(f"mask must be 'causal', 'full' or a bool tensor, got {mask!r}")
    else:
        tree = mask.to(device=device, dtype=torch.bool)
        if tree.shape[-2:] != (t, t):
            raise ValueError(f"mask tensor must be [T, T] or [B, T, T] with T={t}, got {tuple(mask.shape)}")
        new = tree[..., rel.clamp(0, t - 1)] & in_new  # [T, S] or [B, T, S]
    visible = (rel < 0) | new
    if visible.dim() == 2:
        visible = visible[None]
    return visible.expand(visible.shape[0], t, keys)[:, None]


@dataclass(frozen=True, eq=False)
class Visibility:
    """What T new tokens at key slots past..past+T-1 see: every cached slot < past, and among
    themselves `new` ("causal", "full", or a bool tensor [T, T] / [B, T, T]: a tree). Kernels take
    this form; `dense` is the boolean mask `attend` takes, built on first use, once a forward.

    `past` is an int for a host-length cache, or a 0-dim device tensor for a DeviceKVCache; then
    attention is handed `keys` slots (the capacity) and slots at or beyond past+T are hidden.
    """

    new: str | torch.Tensor
    past: int | torch.Tensor
    t: int
    device: torch.device
    keys: int | None = None  # key slots handed to attention; None: past + t

    @cached_property
    def dense(self) -> torch.Tensor | None:
        if isinstance(self.past, torch.Tensor):
            return build_mask_device(self.new, self.past, self.t, self.keys, self.device)
        return build_mask(self.new, self.past, self.t, self.device)


AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, Visibility], torch.Tensor]


def attend_visible(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, vis: Visibility) -> torch.Tensor:
    """`attend` under `vis` as a dense mask: the default attention of every layer."""
    return attend(q, k, v, vis.dense)


class Attention(nn.Module):
    """Projections of one attention layer; the Transformer and the DFlash drafter wire them differently.

    `attention(q, k, v, vis)` is how its queries attend over the cache: `attend_visible` unless a
    backend installs another implementation on this module (a kernel that takes `Visibility`).
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.attention: AttentionFn = attend_visible
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        h, q_out, kv_out = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.q_proj = nn.Linear(h, q_out, bias=False)
        self.k_proj = nn.Linear(h, kv_out, bias=False)
        self.v_proj = nn.Linear(h, kv_out, bias=False)
        self.o_proj = nn.Linear(q_out, h, bias=False)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None

    def queries(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [B, T, hidden] -> roped q [B, H, T, D]."""
        q = self.q_proj(x).view(*x.shape[:2], self.num_heads, self.head_dim)
        if self.q_norm is not None:
            q = self.q_norm(q)
        return apply_rope(q.transpose(1, 2), cos, sin)

    def keys_values(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, T, hidden] -> roped k and v, each [B, Hkv, T, D]."""
        k = self.k_proj(x).view(*x.shape[:2], self.num_kv_heads, self.head_dim)
        if self.k_norm is not None:
            k = self.k_norm(k)
        v = self.v_proj(x).view(*x.shape[:2], self.num_kv_heads, self.head_dim)
        return apply_rope(k.transpose(1, 2), cos, sin), v.transpose(1, 2)

    def output(self, o: torch.Tensor) -> torch.Tensor:
        """o [B, H, T, D] -> [B, T, hidden]."""
        return self.o_proj(o.transpose(1, 2).reshape(o.shape[0], o.shape[2], -1))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache, index: int, vis: Visibility
    ) -> torch.Tensor:
        """Causal-LM layer: writes the new tokens' K/V at slots [cache.length, +T) (length moves later)."""
        attn = self.self_attn
        h = self.input_layernorm(x)
        k, v = attn.keys_values(h, cos, sin)
        start = cache.length
        cache.write(index, start, k, v)
        k_all, v_all = cache.view(index, start + x.shape[1])
        x = x + attn.output(attn.attention(attn.queries(h, cos, sin), k_all, v_all, vis))
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    """The `model.` prefix of HF weight names."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


@dataclass
class ModelOutput:
    logits: torch.Tensor  # [B, T, V] float32 (T = 1 with only_last)
    hidden: torch.Tensor | None  # [B, T, len(hidden_layers) * hidden], model dtype; None if none asked


class Transformer(nn.Module):
    """llama / qwen3 causal LM: RMSNorm, RoPE, GQA attention (+ qk-norm for qwen3), SwiGLU MLP."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.model = Backbone(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
            self.register_load_state_dict_pre_hook(fill_tied_head)
        self._rope = RopeTables(cfg)
        self.fused = None  # a FusedDecoder serving the layers (runtime/fused.py), when installed

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    def new_cache(self, batch: int, max_len: int, *, device_length: bool = False) -> KVCache:
        """A static cache; `device_length` keeps its length on the device (for CUDA graphs)."""
        kind = DeviceKVCache if device_length else KVCache
        self._rope.cover(max_len, self.device, self.dtype)
        return kind.for_model(self.cfg, batch, max_len, self.dtype, self.device)

    def rope(self, positions: torch.Tensor, below: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [B, 1, T, D] for positions [B, T]; `below`: every position is smaller (cache
        slots: the cache's capacity), so the rows may come from the table (RopeTables)."""
        return self._rope(positions, self.dtype, below)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows of the embedding by advanced indexing: the same copy as nn.Embedding, whose CUDA
        index_select for a few ids loops over them in each thread (16 ids: 11 µs of an 8B verify
        step on the H200, against 2 for one; docs/experiments/tried/step_times_h200_llama-25dece0.json)."""
        return self.model.embed_tokens.weight[ids]

    def final_norm(self, h: torch.Tensor) -> torch.Tensor:
        return self.model.norm(h)

    def head(self, h: torch.Tensor) -> torch.Tensor:
        """Already-normalised hidden states [..., hidden] -> float32 logits [..., V] (no final norm here)."""
        return self.lm_head(h).float()

    def forward(
        self,
        input_ids: torch.Tensor,
        cache: KVCache,
        *,
        mask: str | torch.Tensor = "causal",
        hidden_layers: tuple[int, ...] = (),
        positions: torch.Tensor | None = None,
        positions_in_cache: bool = False,
        only_last: bool = False,
    ) -> ModelOutput:
        """Run T new tokens [B, T] after the cache's `length` tokens, then advance the cache by T.

        positions default to cache.length + arange(T) (pass [B, T] ones for trees; with
        `positions_in_cache` the caller vouches that each is below the cache's capacity, as a
        tree's length + depth is, so their RoPE rows may be gathered: Transformer.rope).
        hidden_layers selects the outputs of those decoder layers (0-based, before the final
        norm), concatenated. only_last computes logits for the last position only (prefill).
        """
        b, t = input_ids.shape
        bad = [i for i in hidden_layers if not 0 <= i < len(self.model.layers)]
        if bad:
            raise ValueError(f"hidden_layers {bad} out of range for {len(self.model.layers)} layers")
        vouched = positions is None or positions_in_cache  # slots, or a tree's: below the capacity
        if positions is None:
            positions = (torch.arange(t, device=input_ids.device) + cache.length).expand(b, t)
        vis = Visibility(mask, cache.length, t, input_ids.device, cache.key_slots(t))
        x = self.embed(input_ids)
        cos, sin = self.rope(positions, slots_below(cache, t) if vouched else None)
        if self.fused is not None:  # the same stack with fused kernels (runtime/fused.py)
            x, picked = self.fused(x, cos, sin, cache, vis, hidden_layers)
        else:
            picked = {}
            for i, layer in enumerate(self.model.layers):
                x = layer(x, cos, sin, cache, i, vis)
                if i in hidden_layers:
                    picked[i] = x
            x = self.final_norm(x)
        cache.advance(t)
        hidden = torch.cat([picked[i] for i in hidden_layers], dim=-1) if hidden_layers else None
        if only_last:
            x = x[:, -1:]
        return ModelOutput(logits=self.head(x), hidden=hidden)

    def linear_modules(self) -> dict[str, nn.Module]:
        """Every projection by its weight name ("model.layers.0.mlp.down_proj.weight", "lm_head.weight")."""
        out: dict[str, nn.Module] = {}
        for i, layer in enumerate(self.model.layers):
            for name in ATTENTION_PROJ:
                out[f"model.layers.{i}.self_attn.{name}.weight"] = getattr(layer.self_attn, name)
            for name in MLP_PROJ:
                out[f"model.layers.{i}.mlp.{name}.weight"] = getattr(layer.mlp, name)
        out["lm_head.weight"] = self.lm_head
        return out

    def set_linear(self, weight_name: str, module: nn.Module) -> None:
        """Replace the projection owning `weight_name` by any module with forward(x) (same in/out features).

        Replacing lm_head of a tied model leaves the embedding as it is.
        """
        swap_projection(self, weight_name, module)


def swap_projection(model: nn.Module, weight_name: str, module: nn.Module) -> None:
    """`set_linear` of any model with `linear_modules()`: put `module` where `weight_name`'s linear is."""
    if weight_name not in model.linear_modules():
        raise KeyError(f"{weight_name!r} is not a projection weight of this model")
    parent_name, _, attr = weight_name.removesuffix(".weight").rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, attr, module)


def fill_tied_head(module: Transformer, state_dict: dict, prefix: str, *args) -> None:
    """HF files of tied models omit lm_head.weight: take the embedding's."""
    head, embed = prefix + "lm_head.weight", prefix + "model.embed_tokens.weight"
    if head not in state_dict and embed in state_dict:
        state_dict[head] = state_dict[embed]


@dataclass
class PardDrafter:
    """A causal LM used as a PARD drafter: one forward over [new tokens, mask x (k-1)] drafts k tokens."""

    model: Transformer
    mask_token_id: int
    k: int

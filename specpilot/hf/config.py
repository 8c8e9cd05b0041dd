"""Model and drafter shapes, read from (and written back to) Hugging Face config.json dicts.

`ModelConfig` describes one llama/qwen3 decoder stack; `DrafterConfig` wraps the drafter's own
`ModelConfig` with what the decode loop needs (kind, block size, mask token, target layers);
`HybridConfig` describes a Qwen3-Next stack (Gated DeltaNet and gated full-attention layers).
Every parse error is a `CheckpointError` naming the config.json path and the field.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Any

from specpilot.errors import CheckpointError

FAMILIES = ("llama", "qwen3")
# DFlash drafters saved by HF transformers carry their own model_type; their layers are qwen3-like.
DFLASH_MODEL_TYPES = ("muse_glimmer_assistant", "dflash")

# What a config.json of the wrong shape makes Python raise deep in a parser (a list where a number
# belongs, a string where a mapping does): caught at the parsers' door and named by the file.
_MALFORMED = (TypeError, ValueError, AttributeError, KeyError, IndexError, OverflowError, ZeroDivisionError)


def _parser(parse):
    """A config parser `parse(cls, cfg, source)` whose every failure is a CheckpointError naming the file."""
    @functools.wraps(parse)
    def checked(cls, cfg: Any, source: str):
        if not isinstance(cfg, dict):
            raise CheckpointError(f"{source}: expected a JSON object, got {type(cfg).__name__}")
        try:
            return parse(cls, cfg, source)
        except _MALFORMED as e:
            detail = (str(e).splitlines() or [type(e).__name__])[0][:100]
            raise CheckpointError(f"{source}: a field holds a value of the wrong kind or size ({detail})") from None
    return checked


@dataclass(frozen=True)
class RopeScaling:
    """Llama-3 style frequency scaling (rope_type "llama3"), as in Llama 3.1 / 3.2 checkpoints."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class ModelConfig:
    family: str  # "llama" | "qwen3"
    vocab_size: int  # 0 only for a DFlash drafter whose config does not state it (it shares the target's)
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    tie_word_embeddings: bool
    qk_norm: bool  # per-head RMSNorm on q and k (qwen3, DFlash drafters)
    max_position_embeddings: int
    bos_token_id: int | None
    eos_token_id: int | None
    rope_scaling: RopeScaling | None = None

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(f"family must be one of {FAMILIES}, got {self.family!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")

    @classmethod
    @_parser
    def from_hf(cls, cfg: dict[str, Any], source: str) -> ModelConfig:
        """Parse an HF config.json dict; `source` is its path, quoted in every error."""
        model_type = cfg.get("model_type")
        if model_type not in FAMILIES:
            raise CheckpointError(
                f"{source}: field 'model_type' is {model_type!r}; expected one of {list(FAMILIES)}"
            )
        return _parse_layers(cfg, source, family=model_type, qk_norm=model_type == "qwen3", vocab_required=True)

    def to_hf(self) -> dict[str, Any]:
        """The HF config.json dict for this model (inverse of `from_hf`)."""
        rope: dict[str, Any] = {"rope_type": "default", "rope_theta": self.rope_theta}
        if self.rope_scaling is not None:
            s = self.rope_scaling
            rope = {
                "rope_type": "llama3",
                "rope_theta": self.rope_theta,
                "factor": s.factor,
                "low_freq_factor": s.low_freq_factor,
                "high_freq_factor": s.high_freq_factor,
                "original_max_position_embeddings": s.original_max_position_embeddings,
            }
        arch = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}[self.family]
        return {
            "architectures": [arch],
            "model_type": self.family,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rope_parameters": rope,
            "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "attention_bias": False,
            "mlp_bias": False,
        }


@dataclass(frozen=True)
class DrafterConfig:
    kind: str  # "dflash" | "pard"
    block_size: int  # dflash: block incl. the anchor token; pard: k drafts per step
    mask_token_id: int
    model: ModelConfig  # the drafter's own layer shapes
    target_layer_ids: tuple[int, ...] = field(default=())  # dflash: outputs of these target layers (0-based)

    @classmethod
    @_parser
    def from_hf(cls, cfg: dict[str, Any], source: str) -> DrafterConfig:
        """A DFlash config has target_layer_ids/block_size/mask_token_id (top level, or nested under
        "dflash_config"); a PARD config is a llama/qwen3 causal LM config with `pard_token` (and `pard_k`)."""
        dflash = {**cfg, **cfg.get("dflash_config", {})}
        if "target_layer_ids" in dflash:
            return _parse_dflash(dflash, source)
        if "pard_token" in cfg:
            model = ModelConfig.from_hf(cfg, source)
            k = _get(cfg, "pard_k", source, int, default=8)
            mask = _get(cfg, "pard_token", source, int, minimum=0)
            if k < 1:
                raise CheckpointError(f"{source}: field 'pard_k' is {k}; expected an integer >= 1")
            return cls(kind="pard", block_size=k, mask_token_id=mask, model=model)
        raise CheckpointError(
            f"{source}: not a drafter config: expected 'target_layer_ids' (DFlash) or 'pard_token' (PARD)"
        )

    def to_hf(self) -> dict[str, Any]:
        out = self.model.to_hf()
        if self.kind == "pard":
            out.update(pard_token=self.mask_token_id, pard_k=self.block_size)
        else:
            out.update(
                architectures=["MuseGlimmerAssistantModel"],
                model_type="muse_glimmer_assistant",
                block_size=self.block_size,
                mask_token_id=self.mask_token_id,
                target_layer_ids=list(self.target_layer_ids),
                layer_types=["full_attention"] * self.model.num_layers,
            )
        return out


def _parse_dflash(cfg: dict[str, Any], source: str) -> DrafterConfig:
    model_type = cfg.get("model_type")
    if model_type not in FAMILIES + DFLASH_MODEL_TYPES:
        raise CheckpointError(
            f"{source}: field 'model_type' is {model_type!r}; expected one of {list(FAMILIES + DFLASH_MODEL_TYPES)}"
        )
    family = model_type if model_type in FAMILIES else "qwen3"
    # DFlash layers always normalise q and k per head, whatever family the config names.
    model = _parse_layers(cfg, source, family=family, qk_norm=True, vocab_required=False)
    ids = cfg["target_layer_ids"]
    if not isinstance(ids, (list, tuple)) or not ids or not all(isinstance(i, int) and i >= 0 for i in ids):
        raise CheckpointError(f"{source}: field 'target_layer_ids' is {ids!r}; expected a non-empty list of layer indices >= 0")
    block = _get(cfg, "block_size", source, int)
    if block < 2:
        raise CheckpointError(f"{source}: field 'block_size' is {block}; expected an integer >= 2 (anchor + drafts)")
    mask = _get(cfg, "mask_token_id", source, int, minimum=0)
    return DrafterConfig(kind="dflash", block_size=block, mask_token_id=mask, model=model, target_layer_ids=tuple(ids))


_MISSING = object()


def _get(cfg: dict[str, Any], key: str, source: str, kind: type, default: Any = _MISSING, minimum: int = 1) -> Any:
    """cfg[key] as `kind`; an int must be >= `minimum` (sizes and counts: 1), a float finite and > 0."""
    if key not in cfg or cfg[key] is None:
        if default is _MISSING:
            raise CheckpointError(f"{source}: missing field '{key}' ({kind.__name__})")
        return default
    value = cfg[key]
    accepted = (int, float) if kind is float else (kind,)
    if isinstance(value, bool) or not isinstance(value, accepted):
        raise CheckpointError(f"{source}: field '{key}' is {_short(value)}; expected {kind.__name__}")
    if kind is int and value < minimum:
        raise CheckpointError(f"{source}: field '{key}' is {value}; expected an integer >= {minimum}")
    if kind is float and not (math.isfinite(value) and value > 0):
        raise CheckpointError(f"{source}: field '{key}' is {value!r}; expected a number > 0")
    return kind(value)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _token_id(cfg: dict[str, Any], key: str, source: str) -> int | None:
    value = cfg.get(key)
    if isinstance(value, list):  # some configs list several EOS ids; the loops stop on the first
        value = value[0] if value else None
    if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
        raise CheckpointError(f"{source}: field '{key}' is {value!r}; expected an integer or null")
    return value


def _parse_rope(cfg: dict[str, Any], source: str) -> tuple[float, RopeScaling | None]:
    params = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or {}
    theta = cfg.get("rope_theta", params.get("rope_theta"))
    if theta is None:
        raise CheckpointError(f"{source}: missing field 'rope_theta' (or 'rope_parameters.rope_theta')")
    _get({"rope_theta": theta}, "rope_theta", source, float)  # a number > 0
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise CheckpointError(f"{source}: field 'partial_rotary_factor' is {params['partial_rotary_factor']}; expected 1.0")
    rope_type = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if rope_type == "default":
        return float(theta), None
    if rope_type == "llama3":
        p = {**scaling, **params}
        try:
            return float(theta), RopeScaling(
                factor=float(p["factor"]),
                low_freq_factor=float(p["low_freq_factor"]),
                high_freq_factor=float(p["high_freq_factor"]),
                original_max_position_embeddings=int(p["original_max_position_embeddings"]),
            )
        except KeyError as e:
            raise CheckpointError(f"{source}: rope_type 'llama3' needs field {e.args[0]!r}") from None
    raise CheckpointError(f"{source}: field 'rope_type' is {rope_type!r}; expected 'default' or 'llama3'")


def _attention_shape(cfg: dict[str, Any], source: str) -> tuple[int, int, int]:
    """(hidden_size, num_attention_heads, num_key_value_heads), the kv heads dividing the heads."""
    hidden = _get(cfg, "hidden_size", source, int)
    heads = _get(cfg, "num_attention_heads", source, int)
    kv_heads = _get(cfg, "num_key_value_heads", source, int, default=heads)
    if heads % kv_heads:
        raise CheckpointError(
            f"{source}: field 'num_key_value_heads' is {kv_heads}; expected a divisor of num_attention_heads={heads}"
        )
    return hidden, heads, kv_heads


def _parse_layers(cfg: dict[str, Any], source: str, *, family: str, qk_norm: bool, vocab_required: bool) -> ModelConfig:
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise CheckpointError(f"{source}: field 'hidden_act' is {act!r}; expected 'silu'")
    for key in ("attention_bias", "mlp_bias"):
        if cfg.get(key):
            raise CheckpointError(f"{source}: field '{key}' is true; biases are not supported")
    hidden, heads, kv_heads = _attention_shape(cfg, source)
    theta, scaling = _parse_rope(cfg, source)
    return ModelConfig(
        family=family,
        vocab_size=_get(cfg, "vocab_size", source, int) if vocab_required else _get(cfg, "vocab_size", source, int, default=0, minimum=0),
        hidden_size=hidden,
        intermediate_size=_get(cfg, "intermediate_size", source, int),
        num_layers=_get(cfg, "num_hidden_layers", source, int),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=_get(cfg, "head_dim", source, int, default=hidden // heads),
        rope_theta=theta,
        rms_norm_eps=_get(cfg, "rms_norm_eps", source, float, default=1e-6),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qk_norm=qk_norm,
        max_position_embeddings=_get(cfg, "max_position_embeddings", source, int, default=4096),
        bos_token_id=_token_id(cfg, "bos_token_id", source),
        eos_token_id=_token_id(cfg, "eos_token_id", source),
        rope_scaling=scaling,
    )


HYBRID_FAMILIES = ("qwen3_next",)
LAYER_TYPES = ("linear_attention", "full_attention")


@dataclass(frozen=True)
class HybridConfig:
    """A Qwen3-Next-family causal LM: `layer_types[i]` says whether layer i mixes tokens with a
    Gated DeltaNet ("linear_attention") or with gated full attention ("full_attention").

    `moe_layers` use the sparse mixture-of-experts block of released Qwen3-Next checkpoints (a
    softmax top-k router over `num_experts` SwiGLU experts plus a sigmoid-gated shared expert);
    the others a dense MLP of `intermediate_size`."""

    family: str  # "qwen3_next"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    layer_types: tuple[str, ...]
    num_heads: int  # full attention
    num_kv_heads: int
    head_dim: int
    rotary_dim: int  # the leading dims of each head that RoPE rotates (partial rotary)
    rope_theta: float
    linear_num_key_heads: int  # Gated DeltaNet
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    max_position_embeddings: int
    bos_token_id: int | None
    eos_token_id: int | None
    moe_layers: tuple[int, ...] = ()
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = True

    def __post_init__(self) -> None:
        if self.moe_layers and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"num_experts_per_tok={self.num_experts_per_tok} must be in 1..num_experts={self.num_experts}")
        if self.family not in HYBRID_FAMILIES:
            raise ValueError(f"family must be one of {HYBRID_FAMILIES}, got {self.family!r}")
        if len(self.layer_types) != self.num_layers or set(self.layer_types) - set(LAYER_TYPES):
            raise ValueError(f"layer_types must list {self.num_layers} of {LAYER_TYPES}, got {self.layer_types}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ValueError(f"linear_num_value_heads={self.linear_num_value_heads} is not a multiple of "
                             f"linear_num_key_heads={self.linear_num_key_heads}")

    @property
    def attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == "full_attention")

    @property
    def linear_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == "linear_attention")

    @classmethod
    @_parser
    def from_hf(cls, cfg: dict[str, Any], source: str) -> HybridConfig:
        """Parse an HF qwen3_next config.json dict; `source` is its path, quoted in every error."""
        model_type = cfg.get("model_type")
        if model_type not in HYBRID_FAMILIES:
            raise CheckpointError(f"{source}: field 'model_type' is {model_type!r}; expected one of {list(HYBRID_FAMILIES)}")
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise CheckpointError(f"{source}: field 'hidden_act' is {act!r}; expected 'silu'")
        if cfg.get("attention_bias"):
            raise CheckpointError(f"{source}: field 'attention_bias' is true; biases are not supported")
        layers = _get(cfg, "num_hidden_layers", source, int)
        types = cfg.get("layer_types")
        if types is None:  # HF's default: every `full_attention_interval`-th layer is full attention
            interval = _get(cfg, "full_attention_interval", source, int, default=4)
            types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(layers)]
        types = [{"attention": "full_attention", "mamba": "linear_attention"}.get(t, t) for t in types]
        if len(types) != layers or set(types) - set(LAYER_TYPES):
            raise CheckpointError(f"{source}: field 'layer_types' is {cfg.get('layer_types')!r}; expected "
                                  f"{layers} entries, each one of {list(LAYER_TYPES)}")
        mlp_only = cfg.get("mlp_only_layers") or []
        experts = _get(cfg, "num_experts", source, int, default=0, minimum=0)
        step = _get(cfg, "decoder_sparse_step", source, int, default=1)
        moe = [i for i in range(layers) if i not in mlp_only and experts > 0 and (i + 1) % step == 0]
        moe_fields = {}
        if moe:  # HF's rule: every decoder_sparse_step-th layer not in mlp_only_layers
            per_token = _get(cfg, "num_experts_per_tok", source, int)
            if not 0 < per_token <= experts:
                raise CheckpointError(f"{source}: field 'num_experts_per_tok' is {per_token}; expected 1..num_experts={experts}")
            moe_fields = dict(moe_layers=tuple(moe), num_experts=experts, num_experts_per_tok=per_token,
                              moe_intermediate_size=_get(cfg, "moe_intermediate_size", source, int),
                              shared_expert_intermediate_size=_get(cfg, "shared_expert_intermediate_size", source, int),
                              norm_topk_prob=bool(cfg.get("norm_topk_prob", True)))
        hidden, heads, kv_heads = _attention_shape(cfg, source)
        k_heads = _get(cfg, "linear_num_key_heads", source, int)
        v_heads = _get(cfg, "linear_num_value_heads", source, int)
        if v_heads % k_heads:
            raise CheckpointError(f"{source}: field 'linear_num_value_heads' is {v_heads}; expected a multiple of "
                                  f"linear_num_key_heads={k_heads}")
        head_dim = _get(cfg, "head_dim", source, int, default=hidden // heads)
        params = cfg.get("rope_parameters") or {}
        rope_type = params.get("rope_type") or (cfg.get("rope_scaling") or {}).get("rope_type") or "default"
        if rope_type != "default":
            raise CheckpointError(f"{source}: field 'rope_type' is {rope_type!r}; expected 'default'")
        theta = cfg.get("rope_theta", params.get("rope_theta"))
        if theta is None:
            raise CheckpointError(f"{source}: missing field 'rope_theta' (or 'rope_parameters.rope_theta')")
        # HF reads the factor from rope_parameters; older files state it at the top level (default 0.25).
        factor = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.25))
        rotary = int(head_dim * factor)
        if not 0 < rotary <= head_dim or rotary % 2:
            raise CheckpointError(f"{source}: field 'partial_rotary_factor' is {factor}; expected a fraction of "
                                  f"head_dim={head_dim} giving an even number of rotary dims")
        return cls(
            family=model_type,
            vocab_size=_get(cfg, "vocab_size", source, int),
            hidden_size=hidden,
            intermediate_size=_get(cfg, "intermediate_size", source, int),
            num_layers=layers,
            layer_types=tuple(types),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rotary_dim=rotary,
            rope_theta=float(theta),
            linear_num_key_heads=k_heads,
            linear_num_value_heads=v_heads,
            linear_key_head_dim=_get(cfg, "linear_key_head_dim", source, int),
            linear_value_head_dim=_get(cfg, "linear_value_head_dim", source, int),
            linear_conv_kernel_dim=_get(cfg, "linear_conv_kernel_dim", source, int, default=4),
            rms_norm_eps=_get(cfg, "rms_norm_eps", source, float, default=1e-6),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            max_position_embeddings=_get(cfg, "max_position_embeddings", source, int, default=4096),
            bos_token_id=_token_id(cfg, "bos_token_id", source),
            eos_token_id=_token_id(cfg, "eos_token_id", source),
            **moe_fields,
        )

    def to_hf(self) -> dict[str, Any]:
        """The HF config.json dict for this model (inverse of `from_hf`)."""
        return {
            "architectures": ["Qwen3NextForCausalLM"],
            "model_type": self.family,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "layer_types": list(self.layer_types),
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta,
                                "partial_rotary_factor": self.rotary_dim / self.head_dim},
            "linear_num_key_heads": self.linear_num_key_heads,
            "linear_num_value_heads": self.linear_num_value_heads,
            "linear_key_head_dim": self.linear_key_head_dim,
            "linear_value_head_dim": self.linear_value_head_dim,
            "linear_conv_kernel_dim": self.linear_conv_kernel_dim,
            "num_experts": self.num_experts,
            "num_experts_per_tok": self.num_experts_per_tok,
            "moe_intermediate_size": self.moe_intermediate_size,
            "shared_expert_intermediate_size": self.shared_expert_intermediate_size,
            "norm_topk_prob": self.norm_topk_prob,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [i for i in range(self.num_layers) if i not in self.moe_layers],
            "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "attention_bias": False,
        }


def check_drafter_fits(dcfg: DrafterConfig, target_cfg: ModelConfig | HybridConfig, source: str) -> None:
    """A CheckpointError (quoting `source`, the drafter's config.json) where the drafter cannot serve the target."""
    vocab = target_cfg.vocab_size
    if dcfg.kind == "pard" and dcfg.model.vocab_size != vocab:
        raise CheckpointError(
            f"{source}: field 'vocab_size' is {dcfg.model.vocab_size}; expected the target's vocabulary size {vocab}"
        )
    if dcfg.kind == "dflash" and dcfg.model.vocab_size not in (0, vocab):
        raise CheckpointError(
            f"{source}: field 'vocab_size' is {dcfg.model.vocab_size}; expected the target's vocabulary size {vocab}"
        )
    mask_field = "pard_token" if dcfg.kind == "pard" else "mask_token_id"
    if not 0 <= dcfg.mask_token_id < vocab:
        raise CheckpointError(
            f"{source}: field '{mask_field}' is {dcfg.mask_token_id}; expected a token id below the target's vocabulary size {vocab}"
        )
    if dcfg.kind == "dflash":
        if dcfg.model.hidden_size != target_cfg.hidden_size:
            raise CheckpointError(
                f"{source}: field 'hidden_size' is {dcfg.model.hidden_size}; a DFlash drafter shares the target's "
                f"embedding, expected {target_cfg.hidden_size}"
            )
        bad = [i for i in dcfg.target_layer_ids if i >= target_cfg.num_layers]
        if bad:
            raise CheckpointError(
                f"{source}: field 'target_layer_ids' has {bad}; the target has layers 0..{target_cfg.num_layers - 1}"
            )

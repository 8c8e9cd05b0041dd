"""The TensorRT-LLM backend: the engine as TensorRT-LLM artifacts (`backend: trtllm` in pipeline.yaml).

What it writes, into the engine directory's `trtllm/`:

    target/config.json, target/rank0.safetensors    the target as a TensorRT-LLM checkpoint
    drafter/config.json, drafter/rank0.safetensors  the PARD drafter (a causal LM) likewise
    extra-llm-api-options.yaml                      the speculative config (PARD decoding, k drafts)
    README.md                                       trtllm-build and trtllm-serve commands

Checkpoint layout: one rank (tp = pp = 1), tensors named as TensorRT-LLM's converters name them
(tensorrt_llm/models/llama/convert.py, models/qwen/convert.py; docs/TRTLLM.md cites what was
checked): q|k|v concatenated into `attention.qkv`, o_proj -> `attention.dense`, gate_proj ->
`mlp.fc`, up_proj -> `mlp.gate`, down_proj -> `mlp.proj`, post_attention_layernorm ->
`post_layernorm`, Qwen3's q_norm/k_norm -> `attention.q_layernorm`/`k_layernorm`, the embedding
`transformer.vocab_embedding`, the final norm `transformer.ln_f`, and `lm_head` (written out for
tied models too, as the converters do). Weights keep the dtype of the HF checkpoint: TensorRT-LLM
has no 12-bit format, so a `weights-u12` engine ships its exact bf16 weights here.

TensorRT-LLM cannot be installed here, so nothing of it runs: `read_checkpoint` maps the names back
and `check_checkpoint` token-forces the read-back target (and the drafter's proposals through our
PARD loop) against the reference. Drafters: PARD only (TensorRT-LLM's `PARD` decoding config);
DFlash has no TensorRT-LLM counterpart and is refused.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import yaml
from safetensors.torch import load_file, save_file

from ..errors import CheckpointError
from ..hf.checkpoint import read_config
from ..hf.config import DrafterConfig, ModelConfig
from ..runtime.decode import generate_ar, generate_pard
from ..runtime.load import load_target
from ..runtime.model import PardDrafter, Transformer
from ..validate.forcing import TokenForcingReport, force_tokens

TRTLLM_DIR = "trtllm"
RANK0 = "rank0.safetensors"
OPTIONS = "extra-llm-api-options.yaml"
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}
DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
# HF name inside a layer -> TensorRT-LLM name (the linears q|k|v are fused separately)
LAYER_NAMES = {
    "self_attn.o_proj.weight": "attention.dense.weight",
    "mlp.gate_proj.weight": "mlp.fc.weight",
    "mlp.up_proj.weight": "mlp.gate.weight",
    "mlp.down_proj.weight": "mlp.proj.weight",
    "input_layernorm.weight": "input_layernorm.weight",
    "post_attention_layernorm.weight": "post_layernorm.weight",
    "self_attn.q_norm.weight": "attention.q_layernorm.weight",
    "self_attn.k_norm.weight": "attention.k_layernorm.weight",
}
TOP_NAMES = {"model.embed_tokens.weight": "transformer.vocab_embedding.weight",
             "model.norm.weight": "transformer.ln_f.weight", "lm_head.weight": "lm_head.weight"}


def trtllm_config(cfg: ModelConfig, dtype: str) -> dict:
    """The checkpoint's config.json: PretrainedConfig's fields (models/modeling_utils.py) and those
    LLaMAConfig / QWenConfig add, as their from_hugging_face fills them."""
    out = {
        "architecture": ARCHITECTURES[cfg.family],
        "dtype": dtype,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_size": cfg.head_dim,
        "intermediate_size": cfg.intermediate_size,
        "hidden_act": "silu",
        "norm_epsilon": cfg.rms_norm_eps,
        "position_embedding_type": "rope_gpt_neox",
        "max_position_embeddings": cfg.max_position_embeddings,
        "rotary_base": cfg.rope_theta,
        "rotary_scaling": None,
        "logits_dtype": "float32",
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "use_parallel_embedding": False,
        "embedding_sharding_dim": 0,
        "qk_layernorm": cfg.qk_norm,
        "mlp_bias": False,
        "attn_bias": False,
        "mapping": {"world_size": 1, "tp_size": 1, "pp_size": 1},
        "quantization": {"quant_algo": None, "kv_cache_quant_algo": None},
    }
    if cfg.rope_scaling is not None:
        s = cfg.rope_scaling
        out["rotary_scaling"] = {"rope_type": "llama3", "factor": s.factor, "low_freq_factor": s.low_freq_factor,
                                 "high_freq_factor": s.high_freq_factor,
                                 "original_max_position_embeddings": s.original_max_position_embeddings}
    if cfg.family == "qwen3":
        out["qwen_type"] = "qwen3"
    return out


def model_config(config: dict, source: str) -> ModelConfig:
    """Our ModelConfig from a checkpoint config.json written by `trtllm_config`."""
    family = {v: k for k, v in ARCHITECTURES.items()}.get(config.get("architecture"))
    if family is None:
        raise CheckpointError(f"{source}: field 'architecture' is {config.get('architecture')!r}; expected one of "
                              f"{sorted(ARCHITECTURES.values())}")
    mapping = config.get("mapping", {})
    if mapping.get("world_size", 1) != 1:
        raise CheckpointError(f"{source}: field 'mapping.world_size' is {mapping.get('world_size')}; expected 1")
    hf = {"model_type": family, "vocab_size": config["vocab_size"], "hidden_size": config["hidden_size"],
          "intermediate_size": config["intermediate_size"], "num_hidden_layers": config["num_hidden_layers"],
          "num_attention_heads": config["num_attention_heads"], "num_key_value_heads": config["num_key_value_heads"],
          "head_dim": config["head_size"], "rms_norm_eps": config["norm_epsilon"],
          "max_position_embeddings": config["max_position_embeddings"],
          "tie_word_embeddings": config["tie_word_embeddings"], "rope_theta": config["rotary_base"]}
    if config.get("rotary_scaling"):
        hf["rope_scaling"] = config["rotary_scaling"]
    return ModelConfig.from_hf(hf, source)


def to_trtllm(state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """HF weight names -> TensorRT-LLM's (module docstring); q|k|v rows concatenated in that order."""
    out: dict[str, torch.Tensor] = {}
    for hf, name in TOP_NAMES.items():
        if hf == "lm_head.weight" and hf not in state:  # tied: its own copy, as qwen/convert.py's v.clone()
            out[name] = state["model.embed_tokens.weight"].clone()
        else:
            out[name] = state[hf].contiguous()
    for i in range(cfg.num_layers):
        hf, tl = f"model.layers.{i}.", f"transformer.layers.{i}."
        out[tl + "attention.qkv.weight"] = torch.cat([state[hf + f"self_attn.{p}_proj.weight"] for p in "qkv"])
        for src, dst in LAYER_NAMES.items():
            if hf + src in state:
                out[tl + dst] = state[hf + src].contiguous()
    return out


def from_trtllm(tensors: dict[str, torch.Tensor], cfg: ModelConfig, source: str) -> dict[str, torch.Tensor]:
    """TensorRT-LLM names -> HF names (the inverse of `to_trtllm`); CheckpointError naming `source`
    for a missing tensor or a qkv of the wrong height."""
    def take(name: str) -> torch.Tensor:
        if name not in tensors:
            raise CheckpointError(f"{source}: tensor {name!r} is missing")
        return tensors[name]

    state = {hf: take(name) for hf, name in TOP_NAMES.items()}
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    for i in range(cfg.num_layers):
        hf, tl = f"model.layers.{i}.", f"transformer.layers.{i}."
        qkv = take(tl + "attention.qkv.weight")
        if qkv.shape[0] != q + 2 * kv:
            raise CheckpointError(f"{source}: tensor {tl}attention.qkv.weight has {qkv.shape[0]} rows; expected "
                                  f"{q + 2 * kv} (q {q} + k {kv} + v {kv})")
        for p, part in zip("qkv", qkv.split([q, kv, kv])):
            state[hf + f"self_attn.{p}_proj.weight"] = part
        for src, dst in LAYER_NAMES.items():
            if "_norm" in src and "self_attn" in src and not cfg.qk_norm:
                continue
            state[hf + src] = take(tl + dst)
    return state


def write_checkpoint(out: Path, cfg: ModelConfig, state: dict[str, torch.Tensor]) -> None:
    """config.json and rank0.safetensors of one model."""
    dtype = DTYPES[state["model.embed_tokens.weight"].dtype]
    out.mkdir(parents=True)
    (out / "config.json").write_text(json.dumps(trtllm_config(cfg, dtype), indent=2) + "\n")
    save_file({k: v.detach().to("cpu").contiguous() for k, v in to_trtllm(state, cfg).items()}, str(out / RANK0))


def read_checkpoint(root: Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """A checkpoint written by `write_checkpoint`, as our config and HF-named tensors."""
    root = Path(root)
    config_path, weights = root / "config.json", root / RANK0
    for path in (config_path, weights):
        if not path.is_file():
            raise CheckpointError(f"{path}: missing (a TensorRT-LLM checkpoint holds config.json and {RANK0})")
    cfg = model_config(json.loads(config_path.read_text()), str(config_path))
    return cfg, from_trtllm(load_file(str(weights)), cfg, str(weights))


def load_checkpoint_model(root: Path, *, dtype: torch.dtype, device: torch.device | str) -> Transformer:
    """The checkpoint as our runtime's Transformer (what the token forcing runs)."""
    cfg, state = read_checkpoint(root)
    with torch.device("meta"):
        model = Transformer(cfg)
    model.load_state_dict({k: v.to(device=device, dtype=dtype) for k, v in state.items()}, strict=True, assign=True)
    return model.eval().requires_grad_(False)


def _hf_state(root: Path) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}
    for f in sorted(Path(root).glob("*.safetensors")):
        state.update(load_file(str(f)))
    return state


def write_artifacts(out: Path, target_dir: Path, drafter_dir: Path, *, block_size: int) -> dict:
    """trtllm/ for a PARD deployment (module docstring); returns what it wrote, for the report."""
    target_raw, target_src = read_config(target_dir)
    drafter_raw, drafter_src = read_config(drafter_dir)
    target_cfg = ModelConfig.from_hf(target_raw, target_src)
    drafter = DrafterConfig.from_hf(drafter_raw, drafter_src)
    write_checkpoint(out / "target", target_cfg, _hf_state(target_dir))
    write_checkpoint(out / "drafter", drafter.model, _hf_state(drafter_dir))
    options = {"speculative_config": {"decoding_type": "PARD", "max_draft_len": block_size,
                                      "speculative_model": "../drafter", "mask_token_id": drafter.mask_token_id}}
    (out / OPTIONS).write_text(yaml.safe_dump(options, sort_keys=False))
    (out / "README.md").write_text(readme(block_size, drafter.mask_token_id))
    return {"dir": TRTLLM_DIR, "checkpoints": ["target", "drafter"], "speculative_config": options["speculative_config"],
            "tensorrt_llm_run": False}


def readme(k: int, mask: int) -> str:
    return f"""# TensorRT-LLM artifacts

Written by specpilot (`backend: trtllm`). Nothing here was built or run with TensorRT-LLM: it
cannot be installed where specpilot compiled this engine. What was checked: both checkpoints were
read back into specpilot's runtime and token-forced against the reference target (report.json,
`trtllm`); names and config keys follow TensorRT-LLM's converters (specpilot docs/TRTLLM.md).

- `target/`, `drafter/`: TensorRT-LLM checkpoints (config.json, {RANK0}; tp = pp = 1).
- `{OPTIONS}`: PARD speculative decoding, {k} drafts a step, mask token {mask}.

Serve with the PyTorch backend (reads the Hugging Face checkpoints beside this folder; PARD is a
PyTorch-backend decoding mode). `speculative_model` in the options file is relative to this
folder: run from here, or make it absolute.

    cd trtllm
    trtllm-serve ../target --backend pytorch --extra_llm_api_options {OPTIONS}

Build TensorRT engines from the checkpoints (the TensorRT backend has no PARD mode; the target
engine is built to take {k} externally drafted tokens, the drafter as a plain engine):

    trtllm-build --checkpoint_dir target --output_dir engines/target --gemm_plugin auto \\
        --speculative_decoding_mode draft_tokens_external --max_draft_len {k}
    trtllm-build --checkpoint_dir drafter --output_dir engines/drafter --gemm_plugin auto
    trtllm-serve engines/target --tokenizer ../target    # the target engine alone, no speculation
"""


def check_checkpoint(out: Path, reference: Transformer, prompts: list[list[int]], *, max_new_tokens: int,
                     eos_token_id: int | None, k: int, mask_token_id: int, dtype: str) -> TokenForcingReport:
    """Read trtllm/ back into our runtime and token-force what it generates against `reference`:
    the read-back target's greedy AR and its PARD loop with the read-back drafter, every token."""
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    device = reference.device
    target = load_checkpoint_model(out / "target", dtype=torch_dtype, device=device)
    drafter = PardDrafter(load_checkpoint_model(out / "drafter", dtype=torch_dtype, device=device),
                          mask_token_id=mask_token_id, k=k)
    outputs, all_prompts = [], []
    for p in prompts:
        ar = generate_ar(target, p, max_new_tokens=max_new_tokens, eos_token_id=eos_token_id).tokens
        spec = generate_pard(target, drafter, p, k=k, mask_token_id=mask_token_id, max_new_tokens=max_new_tokens,
                             eos_token_id=eos_token_id).tokens
        outputs += [ar, spec]
        all_prompts += [p, p]
    return force_tokens(reference, None, all_prompts, outputs, dtype)


def reference_target(target_dir: Path, *, dtype: torch.dtype, device: torch.device | str) -> Transformer:
    """The unmodified target from its HF directory (what the checkpoint is judged against)."""
    return load_target(target_dir, dtype=dtype, device=device)[0]

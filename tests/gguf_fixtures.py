"""A tiny llama-architecture GGUF file written the way llama.cpp's converter writes one (q/k rows
permuted, Q4_1 matmuls, a Q8_0 embedding, F32 norms, a byte-level BPE vocabulary with merges and
control tokens, a chat template): what tests of specpilot/hf/gguf.py read, and transformers too."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from specpilot.runtime.tokenizer import byte_alphabet

CHAT_TEMPLATE = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
                 "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<empty_output>"]
MERGES = ["Ġ t", "h e", "Ġt he", "d e", "Ġ de", "f (", "Ġ Ġ"]
HIDDEN, LAYERS, HEADS, KV_HEADS, FFN, VOCAB = 64, 2, 4, 2, 96, 320


def llamacpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf `LlamaModel.permute` of q/k rows."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def tokens() -> list[str]:
    merged = [m.replace(" ", "") for m in MERGES]
    base = [*SPECIALS, *byte_alphabet(), *merged]
    return base + [f"<unused{i}>" for i in range(VOCAB - len(base))]


def write_tiny_gguf(path: Path, seed: int = 0, tied: bool = True) -> dict[str, torch.Tensor]:
    """Write the file; return the (pre-quantization) HF-layout float32 weights it was made from."""
    import gguf

    g = torch.Generator().manual_seed(seed)
    head_dim = HIDDEN // HEADS

    def rand(*shape, scale=0.08):
        return (torch.randn(*shape, generator=g) * scale).numpy().astype(np.float32)

    hf = {"model.embed_tokens.weight": rand(VOCAB, HIDDEN, scale=0.5), "model.norm.weight": 1 + rand(HIDDEN)}
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(LAYERS)
    w.add_context_length(256)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(head_dim)
    w.add_vocab_size(VOCAB)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_1)
    toks = tokens()
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(toks)
    w.add_token_types([3 if t in SPECIALS else 1 for t in toks])
    w.add_token_merges(MERGES)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)

    def put(name: str, arr: np.ndarray, qtype) -> None:
        if qtype == gguf.GGMLQuantizationType.F32:
            w.add_tensor(name, arr)
        else:
            w.add_tensor(name, gguf.quants.quantize(arr, qtype), raw_dtype=qtype)

    Q41, Q80, F32 = gguf.GGMLQuantizationType.Q4_1, gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.F32
    put("token_embd.weight", hf["model.embed_tokens.weight"], Q80)
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        layer = {
            "attn_q": (p + "self_attn.q_proj.weight", rand(HEADS * head_dim, HIDDEN)),
            "attn_k": (p + "self_attn.k_proj.weight", rand(KV_HEADS * head_dim, HIDDEN)),
            "attn_v": (p + "self_attn.v_proj.weight", rand(KV_HEADS * head_dim, HIDDEN)),
            "attn_output": (p + "self_attn.o_proj.weight", rand(HIDDEN, HEADS * head_dim)),
            "ffn_gate": (p + "mlp.gate_proj.weight", rand(FFN, HIDDEN)),
            "ffn_up": (p + "mlp.up_proj.weight", rand(FFN, HIDDEN)),
            "ffn_down": (p + "mlp.down_proj.weight", rand(HIDDEN, FFN)),
        }
        for short, (name, arr) in layer.items():
            hf[name] = arr
            stored = llamacpp_permute(arr, HEADS if short == "attn_q" else KV_HEADS) if short in ("attn_q", "attn_k") else arr
            put(f"blk.{i}.{short}.weight", stored, Q41)
        for short, name in (("attn_norm", "input_layernorm"), ("ffn_norm", "post_attention_layernorm")):
            hf[p + name + ".weight"] = 1 + rand(HIDDEN)
            put(f"blk.{i}.{short}.weight", hf[p + name + ".weight"], F32)
    put("output_norm.weight", hf["model.norm.weight"], F32)
    if not tied:
        hf["lm_head.weight"] = rand(VOCAB, HIDDEN)
        put("output.weight", hf["lm_head.weight"], Q80)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return {k: torch.from_numpy(v) for k, v in hf.items()}

"""Lowering: HF config dicts of a target and a parallel drafter -> a verified `Program`.

Supported: Llama and Qwen3 targets (Qwen3 adds per-head q/k RMSNorm), Qwen3-Next hybrid targets
(Gated DeltaNet `gated_deltanet` mixers between gated full-attention layers; dense MLPs); DFlash-style drafters
(config keys `target_layer_ids`, `block_size`, `mask_token_id`; embedding and lm_head shared
with the target) and PARD-style drafters (a causal LM whose config names its `pard_token`).
Weight names are the checkpoint's own, so a backend can find every tensor a node reads.
Weights the drafter borrows from the target are named `target/<name>`.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import CheckpointError, SpecError
from ..hf.config import HYBRID_FAMILIES, DrafterConfig, HybridConfig, ModelConfig, check_drafter_fits
from .graph import Graph, Program
from .node import SHARED, Node
from .verify import expected_verify_length, verify_program


@dataclass(frozen=True)
class Shapes:
    """The few numbers of a parsed HF config (specpilot.hf.config) that fix a decoder's graph."""

    family: str
    vocab: int
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    eps: float
    theta: float
    tied: bool
    qk_norm: bool

    @staticmethod
    def of(c: ModelConfig, vocab: int | None = None) -> "Shapes":
        """`vocab` stands in for a DFlash drafter's, which shares the target's."""
        return Shapes(family=c.family, vocab=vocab or c.vocab_size, hidden=c.hidden_size,
                      intermediate=c.intermediate_size, layers=c.num_layers, heads=c.num_heads,
                      kv_heads=c.num_kv_heads, head_dim=c.head_dim, eps=c.rms_norm_eps, theta=c.rope_theta,
                      tied=c.tie_word_embeddings, qk_norm=c.qk_norm)


def _matmul(op: str, inp: int, out: int, weight: str, dtype: str, **extra) -> Node:
    return Node.make(op, in_features=inp, out_features=out, weight=weight, dtype=dtype,
                     format=dtype, kernel="torch", **extra)


def _decoder_layers(g: Graph, s: Shapes, x: str, prefix: str, dtype: str, *, mask: str,
                    context: str | None = None) -> str:
    """Append s.layers pre-norm attention+MLP blocks after node x; return the last node's name."""
    q_out, kv_out = s.heads * s.head_dim, s.kv_heads * s.head_dim
    for i in range(s.layers):
        p, w = f"layers.{i}", f"{prefix}layers.{i}"
        norm = g.add(f"{p}.input_norm", Node.make("rmsnorm", dim=s.hidden, eps=s.eps, weight=f"{w}.input_layernorm.weight"), [x])
        kv_in = [norm] if context is None else [context, norm]
        q = g.add(f"{p}.q_proj", _matmul("linear", s.hidden, q_out, f"{w}.self_attn.q_proj.weight", dtype), [norm])
        k = g.add(f"{p}.k_proj", _matmul("linear", s.hidden, kv_out, f"{w}.self_attn.k_proj.weight", dtype), kv_in)
        v = g.add(f"{p}.v_proj", _matmul("linear", s.hidden, kv_out, f"{w}.self_attn.v_proj.weight", dtype), kv_in)
        rope = g.add(f"{p}.rope", Node.make("rope", head_dim=s.head_dim, theta=s.theta), [q, k])
        attn = g.add(
            f"{p}.attention",
            Node.make("attention", heads=s.heads, kv_heads=s.kv_heads, head_dim=s.head_dim, mask=mask,
                      kernel="sdpa", qk_norm=s.qk_norm,
                      context="self" if context is None else "target-hidden"),
            [rope, v],
        )
        o = g.add(f"{p}.o_proj", _matmul("linear", q_out, s.hidden, f"{w}.self_attn.o_proj.weight", dtype), [attn])
        x = _mlp_block(g, s, x, o, p, w, dtype)
    return x


def _mlp_block(g: Graph, s: Shapes, x: str, mixed: str, p: str, w: str, dtype: str, **norm_attrs) -> str:
    """The residual add after a token mixer's output `mixed`, then the pre-norm SwiGLU MLP block."""
    res = g.add(f"{p}.attn_residual", Node.make("add"), [x, mixed])
    norm2 = g.add(f"{p}.post_norm", Node.make("rmsnorm", dim=s.hidden, eps=s.eps, weight=f"{w}.post_attention_layernorm.weight",
                                              **norm_attrs), [res])
    gate = g.add(f"{p}.gate_proj", _matmul("linear", s.hidden, s.intermediate, f"{w}.mlp.gate_proj.weight", dtype), [norm2])
    up = g.add(f"{p}.up_proj", _matmul("linear", s.hidden, s.intermediate, f"{w}.mlp.up_proj.weight", dtype), [norm2])
    act = g.add(f"{p}.mlp", Node.make("mlp", act="silu", dim=s.intermediate), [gate, up])
    down = g.add(f"{p}.down_proj", _matmul("linear", s.intermediate, s.hidden, f"{w}.mlp.down_proj.weight", dtype), [act])
    return g.add(f"{p}.mlp_residual", Node.make("add"), [res, down])


def _head(g: Graph, s: Shapes, x: str, norm_weight: str, head_weight: str, tied: bool, dtype: str,
          **norm_attrs) -> None:
    norm = g.add("norm", Node.make("rmsnorm", dim=s.hidden, eps=s.eps, weight=norm_weight, **norm_attrs), [x])
    head = g.add("lm_head", _matmul("lm_head", s.hidden, s.vocab, head_weight, dtype, tied=tied), [norm])
    g.add("argmax", Node.make("argmax", vocab=s.vocab), [head])


def lower_causal_lm(name: str, s: Shapes, dtype: str) -> Graph:
    """A Llama/Qwen3 causal LM (the target, or a PARD drafter) as a model graph."""
    g = Graph(name)
    tokens = g.add("tokens", Node.make("input", what="tokens"))
    emb = g.add("embed", Node.make("embed", vocab=s.vocab, dim=s.hidden, dtype=dtype, weight="model.embed_tokens.weight"), [tokens])
    x = _decoder_layers(g, s, emb, "model.", dtype, mask="causal")
    head_weight = "model.embed_tokens.weight" if s.tied else "lm_head.weight"
    _head(g, s, x, "model.norm.weight", head_weight, s.tied, dtype)
    return g


def hybrid_shapes(h: HybridConfig) -> Shapes:
    """The attention/MLP numbers of a hybrid config (its full-attention layers' heads)."""
    return Shapes(family=h.family, vocab=h.vocab_size, hidden=h.hidden_size, intermediate=h.intermediate_size,
                  layers=h.num_layers, heads=h.num_heads, kv_heads=h.num_kv_heads, head_dim=h.head_dim,
                  eps=h.rms_norm_eps, theta=h.rope_theta, tied=h.tie_word_embeddings, qk_norm=True)


def lower_hybrid_lm(name: str, h: HybridConfig, dtype: str) -> Graph:
    """A Qwen3-Next hybrid causal LM: per `layer_types`, a Gated DeltaNet (its projections as
    ordinary `linear` nodes) or gated full attention, each followed by the dense MLP block."""
    s = hybrid_shapes(h)
    centred = {"weight_offset": 1.0}  # every Qwen3-Next RMSNorm is y = x̂ · (1 + w)
    g = Graph(name)
    tokens = g.add("tokens", Node.make("input", what="tokens"))
    x = g.add("embed", Node.make("embed", vocab=s.vocab, dim=s.hidden, dtype=dtype, weight="model.embed_tokens.weight"), [tokens])
    q_out, kv_out = s.heads * s.head_dim, s.kv_heads * s.head_dim
    key_dim, value_dim = h.linear_num_key_heads * h.linear_key_head_dim, h.linear_num_value_heads * h.linear_value_head_dim
    for i, kind in enumerate(h.layer_types):
        p, w = f"layers.{i}", f"model.layers.{i}"
        norm = g.add(f"{p}.input_norm", Node.make("rmsnorm", dim=s.hidden, eps=s.eps, weight=f"{w}.input_layernorm.weight",
                                                  **centred), [x])
        if kind == "linear_attention":
            a = f"{w}.linear_attn"
            qkvz = g.add(f"{p}.in_proj_qkvz", _matmul("linear", s.hidden, 2 * key_dim + 2 * value_dim, f"{a}.in_proj_qkvz.weight", dtype), [norm])
            ba = g.add(f"{p}.in_proj_ba", _matmul("linear", s.hidden, 2 * h.linear_num_value_heads, f"{a}.in_proj_ba.weight", dtype), [norm])
            mix = g.add(f"{p}.deltanet", Node.make("gated_deltanet", k_heads=h.linear_num_key_heads, v_heads=h.linear_num_value_heads,
                                                   k_head_dim=h.linear_key_head_dim, v_head_dim=h.linear_value_head_dim,
                                                   conv_kernel=h.linear_conv_kernel_dim), [qkvz, ba])
            out = g.add(f"{p}.out_proj", _matmul("linear", value_dim, s.hidden, f"{a}.out_proj.weight", dtype), [mix])
        else:
            a = f"{w}.self_attn"
            q = g.add(f"{p}.q_proj", _matmul("linear", s.hidden, 2 * q_out, f"{a}.q_proj.weight", dtype), [norm])  # query + gate
            k = g.add(f"{p}.k_proj", _matmul("linear", s.hidden, kv_out, f"{a}.k_proj.weight", dtype), [norm])
            v = g.add(f"{p}.v_proj", _matmul("linear", s.hidden, kv_out, f"{a}.v_proj.weight", dtype), [norm])
            rope = g.add(f"{p}.rope", Node.make("rope", head_dim=h.rotary_dim, theta=s.theta), [q, k])
            attn = g.add(f"{p}.attention", Node.make("attention", heads=s.heads, kv_heads=s.kv_heads, head_dim=s.head_dim,
                                                     mask="causal", kernel="sdpa", qk_norm=True, context="self",
                                                     output_gate=True), [rope, v])
            out = g.add(f"{p}.o_proj", _matmul("linear", q_out, s.hidden, f"{a}.o_proj.weight", dtype), [attn])
        if i in h.moe_layers:
            x = _moe_block(g, h, x, out, p, w, dtype, **centred)
        else:
            x = _mlp_block(g, s, x, out, p, w, dtype, **centred)
    head_weight = "model.embed_tokens.weight" if s.tied else "lm_head.weight"
    _head(g, s, x, "model.norm.weight", head_weight, s.tied, dtype, **centred)
    return g


def _moe_block(g: Graph, h: HybridConfig, x: str, mixed: str, p: str, w: str, dtype: str, **norm_attrs) -> str:
    """The residual add, then Qwen3-Next's sparse MoE block: the router and the shared expert as
    ordinary linears (weight passes see them), the routed experts as one `moe` node."""
    hidden, shared = h.hidden_size, h.shared_expert_intermediate_size
    res = g.add(f"{p}.attn_residual", Node.make("add"), [x, mixed])
    norm = g.add(f"{p}.post_norm", Node.make("rmsnorm", dim=hidden, eps=h.rms_norm_eps,
                                             weight=f"{w}.post_attention_layernorm.weight", **norm_attrs), [res])
    router = g.add(f"{p}.router", _matmul("linear", hidden, h.num_experts, f"{w}.mlp.gate.weight", dtype), [norm])
    se = f"{w}.mlp.shared_expert"
    gate = g.add(f"{p}.shared_gate_proj", _matmul("linear", hidden, shared, f"{se}.gate_proj.weight", dtype), [norm])
    up = g.add(f"{p}.shared_up_proj", _matmul("linear", hidden, shared, f"{se}.up_proj.weight", dtype), [norm])
    act = g.add(f"{p}.shared_mlp", Node.make("mlp", act="silu", dim=shared), [gate, up])
    down = g.add(f"{p}.shared_down_proj", _matmul("linear", shared, hidden, f"{se}.down_proj.weight", dtype), [act])
    shared_gate = g.add(f"{p}.shared_expert_gate", _matmul("linear", hidden, 1, f"{w}.mlp.shared_expert_gate.weight", dtype), [norm])
    moe = g.add(f"{p}.moe", Node.make("moe", experts=h.num_experts, topk=h.num_experts_per_tok,
                                      dim=h.moe_intermediate_size, hidden=hidden, dtype=dtype,
                                      weight=f"{w}.mlp.experts"), [norm, router, down, shared_gate])
    return g.add(f"{p}.mlp_residual", Node.make("add"), [res, moe])


def lower_dflash(s: Shapes, target: Shapes, layer_ids: tuple[int, ...], dtype: str) -> Graph:
    """A DFlash-style drafter: target hidden states -> context projection -> non-causal block layers."""
    g = Graph("drafter")
    tokens = g.add("tokens", Node.make("input", what="tokens"))
    feat_dim = len(layer_ids) * target.hidden
    hidden = g.add("target_hidden", Node.make("input", what="target_hidden", layers=layer_ids, dim=feat_dim))
    fc = g.add("context_fc", _matmul("linear", feat_dim, s.hidden, "encoder.fc.weight", dtype), [hidden])
    ctx = g.add("context_norm", Node.make("rmsnorm", dim=s.hidden, eps=s.eps, weight="encoder.output_norm_enc.weight"), [fc])
    emb = g.add("embed", Node.make("embed", vocab=target.vocab, dim=target.hidden, dtype=dtype, weight=SHARED + "model.embed_tokens.weight"), [tokens])
    x = _decoder_layers(g, s, emb, "", dtype, mask="block-noncausal", context=ctx)
    head_weight = SHARED + ("model.embed_tokens.weight" if target.tied else "lm_head.weight")
    _head(g, target, x, "norm.weight", head_weight, target.tied, dtype)
    return g


def _step_graph(kind: str, block_size: int, drafter: str, batch: int = 1) -> Graph:
    g = Graph("step")
    draft_node = Node.make("draft", kind=kind, block_size=block_size, drafter=drafter)
    budget = block_size - 1 if kind == "dflash" else block_size
    propose_node = Node.make("propose", shape="chain", budget=budget)
    d = g.add("draft", draft_node)
    p = g.add("propose", propose_node, [d])
    v = g.add("verify", Node.make("verify", mode="chain", q=expected_verify_length(draft_node, propose_node)), [p])
    a = g.add("accept", Node.make("accept", rule="greedy-prefix", on="host"), [v])
    c = g.add("commit", Node.make("commit", kv="rollback"), [a])
    # one request at a time runs the batch-1 loops; more, the continuous-batching engine
    g.add("schedule", Node.make("schedule", policy="static" if batch == 1 else "continuous", batch=batch), [c])
    return g


def lower(target_cfg: dict, drafter_cfg: dict, *, dtype: str = "float32", block_size: int | None = None,
          target_source: str = "target/config.json", drafter_source: str = "drafter/config.json",
          block_source: str = "block_size", batch: int = 1) -> Program:
    """Lower a target and a drafter (HF config dicts, parsed by specpilot.hf.config as the runtime
    parses them) to a verified Program. `block_size` overrides the drafter config's own (DFlash:
    block incl. the anchor; PARD: k); `block_source` names where it came from in an error. `batch`:
    the most requests served at once (serving.batch_sizes' largest), the schedule node's."""
    if batch < 1:
        raise SpecError(f"serving.batch_sizes: a batch of {batch}: expected integers >= 1")
    tcfg: ModelConfig | HybridConfig
    if target_cfg.get("model_type") in HYBRID_FAMILIES:
        tcfg = HybridConfig.from_hf(target_cfg, target_source)
        t, target = hybrid_shapes(tcfg), lower_hybrid_lm("target", tcfg, dtype)
    else:
        tcfg = ModelConfig.from_hf(target_cfg, target_source)
        t = Shapes.of(tcfg)
        target = lower_causal_lm("target", t, dtype)
    dcfg = DrafterConfig.from_hf(drafter_cfg, drafter_source)
    check_drafter_fits(dcfg, tcfg, drafter_source)
    if dcfg.kind == "dflash":
        drafter = lower_dflash(Shapes.of(dcfg.model, vocab=t.vocab), t, dcfg.target_layer_ids, dtype)
    else:
        drafter = lower_causal_lm("drafter", Shapes.of(dcfg.model), dtype)
    block = int(block_size or dcfg.block_size)
    positions = min(tcfg.max_position_embeddings, dcfg.model.max_position_embeddings)
    holds = block + (1 if dcfg.kind == "pard" else 0)  # tokens a verify of the block holds
    if holds > positions - 1:
        where = block_source if block_size else f"{drafter_source}: field '{'pard_k' if dcfg.kind == 'pard' else 'block_size'}'"
        raise (SpecError if block_size else CheckpointError)(
            f"{where}: a block of {block} does not fit the {positions} positions the models hold "
            f"(max_position_embeddings): expected at most {positions - 1 - (holds - block)}")
    program = Program(
        step=_step_graph(dcfg.kind, block, dcfg.kind, batch),
        target=target,
        drafter=drafter,
        attrs=(("dtype", dtype), ("family", t.family), ("max_positions", positions)),
    )
    return verify_program(program, after="lowering")

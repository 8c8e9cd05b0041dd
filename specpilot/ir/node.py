"""IR node payloads: one small frozen node type, and the op schemas that give it meaning.

A node is an op name plus sorted attributes. Attribute values are plain literals (int, float, str,
bool, or a tuple of them) so that a node prints, parses and hashes the same everywhere. What each
op requires lives in `OPS`, as data; the verifier checks graphs against it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator

Literal = int | float | str | bool | tuple


def _check_literal(key: str, value: Any) -> Literal:
    if isinstance(value, list):
        value = tuple(value)
    if isinstance(value, tuple):
        for item in value:
            _check_literal(key, item)
        return value
    if isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"attribute {key!r}: {type(value).__name__} is not an IR literal (int, float, str, bool, tuple)")


@dataclass(frozen=True)
class Node:
    """One IR operation: `op` and its attributes, sorted by name."""

    op: str
    attrs: tuple[tuple[str, Literal], ...] = ()

    @staticmethod
    def make(op: str, **attrs: Any) -> "Node":
        return Node(op, tuple(sorted((k, _check_literal(k, v)) for k, v in attrs.items())))

    def get(self, key: str, default: Any = None) -> Any:
        for k, v in self.attrs:
            if k == key:
                return v
        return default

    def __getitem__(self, key: str) -> Literal:
        for k, v in self.attrs:
            if k == key:
                return v
        raise KeyError(f"{self.op} has no attribute {key!r}")

    def __contains__(self, key: str) -> bool:
        return any(k == key for k, _ in self.attrs)

    def items(self) -> Iterator[tuple[str, Literal]]:
        return iter(self.attrs)

    def replace(self, **changes: Any) -> "Node":
        merged = dict(self.attrs)
        merged.update(changes)
        return Node.make(self.op, **merged)


@dataclass(frozen=True)
class OpSchema:
    """What an op needs: `required` attribute names with their allowed values (a type or a set).

    `choices` are the attributes passes may set (how the deployment runs: formats, kernels, block
    and tree sizes, where acceptance runs); every other attribute, and the graphs' nodes and edges,
    describe the checkpoint and are fixed by lowering (verify.fact_problems)."""

    level: str  # "step" or "model"
    required: dict
    optional: dict = None
    choices: frozenset = frozenset()

    def allowed(self, key: str):
        if key in self.required:
            return self.required[key]
        return (self.optional or {}).get(key)


WEIGHT_FORMATS = {"float32", "bfloat16", "float16", "u12"}
DTYPES = {"float32", "bfloat16", "float16"}
MATMUL_OPS = {"linear", "lm_head"}  # ops that read a weight matrix: what weight passes rewrite
FUSED_OPS = ("rmsnorm", "rope", "mlp")  # the nodes a fused decoder stack serves (kernel "triton-fused")
SHARED = "target/"  # prefix of a drafter weight borrowed from the target: it runs the target's module


FORMAT_BITS: dict[str, float] = {}  # bits per weight of the formats registered below (what the cost model reads)


def register_weight_format(name: str, bits: float | None = None) -> None:
    """Admit a new weight format in the IR (a backend must also say how to run it). `bits`: its
    storage per weight, which the cost model prices; without it a program holding the format can
    be measured but not predicted."""
    WEIGHT_FORMATS.add(name)
    if bits is not None:
        FORMAT_BITS[name] = float(bits)

_matmul = {
    "in_features": int,
    "out_features": int,
    "dtype": DTYPES,
    "format": WEIGHT_FORMATS,
    "kernel": {"torch", "triton-u12"},  # how a matmul runs; "torch" also serves u12 by unpacking
    "weight": str,
}

_MATMUL_CHOICES = frozenset({"format", "kernel", "layout"})
_KERNEL_CHOICE = frozenset({"kernel"})

OPS: dict[str, OpSchema] = {
    # step graph: one decode step of the deployment
    "draft": OpSchema("step", {"kind": {"dflash", "pard"}, "block_size": int, "drafter": str},
                      choices=frozenset({"block_size"})),
    "propose": OpSchema("step", {"shape": {"chain", "tree"}, "budget": int}, {"topk": int},
                        choices=frozenset({"shape", "budget", "topk"})),
    # two-level: a first level (`first`; early-exit reads the target's first `exit_layer` layers) keeps
    # q - 1 of the proposal's nodes, the target verifies those (passes/two_level_verify.py)
    "verify": OpSchema("step", {"mode": {"chain", "tree", "two-level"}, "q": int},
                       {"first": {"drafter", "early-exit", "early-exit-drafter", "early-exit-split"}, "exit_layer": int},
                       choices=frozenset({"mode", "q", "first", "exit_layer"})),
    "accept": OpSchema("step", {"rule": {"greedy-prefix", "tree-path"}, "on": {"host", "device"}},
                       choices=frozenset({"rule", "on"})),
    "commit": OpSchema("step", {"kv": {"rollback", "compact"}}, choices=frozenset({"kv"})),
    # graphs: every step one CUDA graph replay (needs accept on the device; chain or tree verification)
    # policy "continuous": the batched engine (runtime/batch.py), up to `batch` requests joining and
    # leaving at every step; verify_budget, ragged, spec_control: its three mechanisms (passes/)
    "schedule": OpSchema("step", {"policy": {"static", "continuous"}, "batch": int},
                         {"graphs": bool, "verify_budget": bool, "ragged": bool, "spec_control": bool,
                          "spec_off_below": float},
                         choices=frozenset({"policy", "batch", "graphs", "verify_budget", "ragged", "spec_control",
                                            "spec_off_below"})),
    # model graphs: target and drafter as ops with shapes and dtypes
    "input": OpSchema("model", {"what": {"tokens", "target_hidden"}}, {"layers": tuple, "dim": int}),
    "embed": OpSchema("model", {"vocab": int, "dim": int, "dtype": DTYPES, "weight": str}),
    # weight_offset 1.0: y = x̂ · (1 + w), the zero-centred norm of Qwen3-Next
    # kernel "triton-fused": the decoder stack's fused kernels serve it (runtime/fused.py)
    "rmsnorm": OpSchema("model", {"dim": int, "eps": float, "weight": str},
                        {"weight_offset": float, "kernel": {"torch", "triton-fused"}}, _KERNEL_CHOICE),
    "linear": OpSchema("model", _matmul, {"layout": {"rows", "tiles"}}, _MATMUL_CHOICES),  # layout: a u12 weight's planes
    "rope": OpSchema("model", {"head_dim": int, "theta": float}, {"kernel": {"torch", "triton-fused"}}, _KERNEL_CHOICE),
    "attention": OpSchema(
        "model",
        {
            "heads": int,
            "kv_heads": int,
            "head_dim": int,
            "mask": {"causal", "block-noncausal", "tree"},
            "kernel": {"sdpa", "triton-split-kv"},
        },
        # output_gate: q_proj also yields a gate; the output is multiplied by sigmoid(gate) (Qwen3-Next)
        {"qk_norm": bool, "context": {"self", "target-hidden"}, "output_gate": bool},
        _KERNEL_CHOICE,
    ),
    # Gated DeltaNet token mixer (Qwen3-Next linear attention): inputs in_proj_qkvz and in_proj_ba,
    # a causal depthwise conv of `conv_kernel` taps, the gated delta rule over a float32 state
    # [v_heads, k_head_dim, v_head_dim] per request, a gated RMSNorm; output v_heads * v_head_dim.
    "gated_deltanet": OpSchema(
        "model", {"k_heads": int, "v_heads": int, "k_head_dim": int, "v_head_dim": int, "conv_kernel": int}
    ),
    "mlp": OpSchema("model", {"act": {"silu"}, "dim": int}, {"kernel": {"torch", "triton-fused"}}, _KERNEL_CHOICE),
    # Sparse mixture of experts (Qwen3-Next): inputs [normed x, router logits, shared expert output,
    # shared expert gate]; `topk` of `experts` SwiGLU experts of width `dim` per token, weights
    # `{weight}.{e}.{gate,up,down}_proj.weight`; output width `hidden`.
    "moe": OpSchema("model", {"experts": int, "topk": int, "dim": int, "hidden": int, "dtype": DTYPES, "weight": str}),
    "add": OpSchema("model", {}),
    # vocab_subset N > 0: the head scores only N token ids (passes/draft_vocab.py), chosen from
    # vocab_corpus; its logits stay V wide, -inf at the other ids
    "lm_head": OpSchema("model", {**_matmul, "tied": bool}, {"vocab_subset": int, "vocab_corpus": str,
                                                              "layout": {"rows", "tiles"}},
                        _MATMUL_CHOICES | {"vocab_subset", "vocab_corpus"}),
    "argmax": OpSchema("model", {"vocab": int}),
}

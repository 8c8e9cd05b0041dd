"""The torch backend: an optimized Program plus checkpoints -> a runnable `Engine` (CPU or GPU).

It loads the target and drafter with the runtime, then makes every matmul node of the IR real:
each `linear`/`lm_head` node names its weight, and its `format` and `kernel` attributes choose
the module that serves it (`WEIGHT_FORMATS`). The step graph chooses the decode loop.
This is the reference backend: plain PyTorch everywhere, the yardstick for faster backends.

A target given by shape (`ShapeModels`) has no checkpoint: its modules are built on the device with
seeded N(0, 0.02) weights, and its drafter is a replay drafter (runtime/replay.py) of the stated
network shape whose accept lengths follow an acceptance profile (specpilot/profiles).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from ..errors import EngineError
from ..ir import MATMUL_OPS, Graph, Node, Program
from ..ir import node as ir_node
from ..ir.lower import SHARED
from ..kernels.tuning import KernelTuning
from . import kernel_hooks
from ..runtime import decode, graph_decode
from ..runtime.dflash import DFlashDrafter
from ..hf.config import DrafterConfig, ModelConfig
from ..profiles import AcceptDistribution, load_profile
from ..runtime.cpu_linear import pack_linears
from ..runtime.draft_vocab import STDLIB, VOCAB_FILE, DraftVocab, SubsetHead, build_vocab, head_weight, load_vocab
from ..runtime.hybrid import GatedAttention, HybridTransformer
from ..runtime.load import load_drafter, load_target
from ..runtime.model import PardDrafter, Transformer
from ..runtime.replay import Replay, ReplayCausalLM, ReplayDFlash, ReplayPlan
from ..runtime.sampling import GREEDY, SamplingParams
from ..runtime.shared_weights import shared_tensors
from ..runtime.tiny import SPECIAL_TOKENS
from ..runtime.tokenizer import build_byte_tokenizer, load_tokenizer
from ..formats.u12 import U12Tensor, load_u12, pack_u12, unpack_u12

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class CastLinear(nn.Module):
    """y = x·Wᵀ with W stored in another float format (upcast to the activations' dtype)."""

    def __init__(self, weight: torch.Tensor, storage: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(weight.to(storage), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight.to(x.dtype).T


def _cast(node: Node, weight: torch.Tensor, compute: torch.dtype) -> nn.Module:
    storage = TORCH_DTYPES[node["format"]]
    if storage == compute:
        linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device=weight.device, dtype=compute)
        linear.weight.data.copy_(weight)
        return linear
    return CastLinear(weight, storage)


# format -> builder(node, current weight, compute dtype) -> module serving y = x·Wᵀ.
# Passes choose formats in the IR; this table is where a format becomes code.
class U12Linear(nn.Module):
    """y = x·Wᵀ with W in the lossless 12-bit format; `kernel` picks fused Triton or unpack+matmul;
    `tuning` the tuned tables the Triton kernel's configs come from (build_engine sets the engine's)."""

    def __init__(self, packed: U12Tensor, kernel: str, tuning: KernelTuning | None = None):
        super().__init__()
        self.packed, self.kernel, self.tuning = packed, kernel, tuning
        if kernel == "triton-u12" and not kernel_hooks.triton_runs(packed.device):
            raise EngineError("kernel 'triton-u12' needs a CUDA GPU (or TRITON_INTERPRET=1); "
                              "use weights-u12{kernel=torch} on CPU")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from ..kernels.u12 import u12_linear, u12_linear_reference

        flat = x.reshape(-1, x.shape[-1])
        if self.kernel == "triton-u12":
            return u12_linear(flat, self.packed, tuning=self.tuning).reshape(*x.shape[:-1], -1)
        return u12_linear_reference(flat, self.packed).reshape(*x.shape[:-1], -1)


def _u12(node: Node, weight: torch.Tensor, compute: torch.dtype) -> nn.Module:
    if weight.dtype != torch.bfloat16:
        raise EngineError(f"u12 encodes bf16 weights; {node['weight']} is {weight.dtype}")
    return U12Linear(pack_u12(weight, layout=node.get("layout", "rows")), node["kernel"])


WEIGHT_FORMATS: dict[str, Callable[[Node, torch.Tensor, torch.dtype], nn.Module]] = {
    "float32": _cast,
    "bfloat16": _cast,
    "float16": _cast,
    "u12": _u12,
}
U12_FILE = "u12.safetensors"


def register_weight_format(name: str, builder: Callable[[Node, torch.Tensor, torch.dtype], nn.Module],
                           bits: float | None = None) -> None:
    """Plug in a weight format: the IR admits it, and this backend runs it with `builder`. `bits`
    (storage bits per weight) lets the cost model price it; without it the format is measured only."""
    ir_node.register_weight_format(name, bits)
    WEIGHT_FORMATS[name] = builder


def _module_path(weight_name: str) -> str:
    return weight_name.removesuffix(".weight")


def materialize_weights(graph_nodes, root: nn.Module, compute: torch.dtype,
                        stored_u12: dict[str, U12Tensor] | None = None) -> int:
    """Swap in the module each matmul node's format asks for; return how many were swapped.

    `stored_u12` holds planes packed at compile time (checksums verified on load): they are
    used as they are rather than packed again."""
    swapped = 0
    for _, node in graph_nodes:
        if node.op not in MATMUL_OPS or node["weight"].startswith(SHARED):
            continue
        if node["format"] == node["dtype"] and node["kernel"] == "torch":
            continue
        if node["format"] not in WEIGHT_FORMATS:
            raise EngineError(f"the torch backend has no weight format {node['format']!r} (node weight {node['weight']})")
        path = "lm_head" if node.op == "lm_head" else _module_path(node["weight"])
        try:
            old = root.get_submodule(path)
        except AttributeError:
            raise EngineError(f"no module {path!r} serves weight {node['weight']!r}") from None
        if node["format"] == "u12" and stored_u12 and node["weight"] in stored_u12:
            new = U12Linear(stored_u12[node["weight"]], node["kernel"])
        else:
            new = WEIGHT_FORMATS[node["format"]](node, old.weight.detach(), compute)
        root.set_submodule(path, new)
        swapped += 1
    return swapped


def packed_weights(root: nn.Module, graph_nodes) -> dict[str, U12Tensor]:
    """The u12 planes serving this graph's matmuls, by weight name (what an engine stores)."""
    out = {}
    for _, node in graph_nodes:
        if node.op in MATMUL_OPS and node["format"] == "u12" and not node["weight"].startswith(SHARED):
            path = "lm_head" if node.op == "lm_head" else _module_path(node["weight"])
            out[node["weight"]] = root.get_submodule(path).packed
    return out


def _stored_u12(model_dir: Path, device: torch.device) -> dict[str, U12Tensor] | None:
    path = Path(model_dir) / U12_FILE
    if not path.is_file():
        return None
    try:
        return load_u12(path, device=device)
    except ValueError as e:
        raise EngineError(str(e)) from None


def unpacked(planes: dict[str, U12Tensor] | None) -> dict:
    """The bf16 weights of stored u12 planes, each unpacked bit for bit when the loader asks (an
    engine's checkpoint leaves them out: runtime/load.py's `stored`)."""
    return {name: (lambda t=t: unpack_u12(t)) for name, t in (planes or {}).items()}


def stored_weights(model_dir: Path | None, device: torch.device) -> dict:
    """`unpacked` of the u12 planes stored in `model_dir`, if any (what reading an engine's checkpoint needs)."""
    return unpacked(_stored_u12(model_dir, device)) if model_dir is not None else {}


SHORT_QUERIES = 128  # longer query blocks (prefill) stay with SDPA; a tree verify of budget <= 127 fits


def install_attention_kernels(graph: Graph, root: nn.Module, device: torch.device) -> int:
    """Serve each attention node with kernel="triton-split-kv" by the split-KV Triton kernel, on the
    layer whose o_proj the node feeds; return how many layers got it."""
    chosen = graph.find("attention", lambda node: node["kernel"] == "triton-split-kv")
    if not chosen:
        return 0
    if not kernel_hooks.triton_runs(device):
        raise EngineError("attention kernel 'triton-split-kv' needs a CUDA GPU (or TRITON_INTERPRET=1); "
                          "leave out the attention-split-kv pass on CPU")
    from ..runtime.model import Attention, attend_visible

    def split_kv(q, k, v, vis):
        return attend_visible(q, k, v, vis) if q.shape[2] > SHORT_QUERIES else kernel_hooks.split_kv_attention(q, k, v, vis)

    for name in chosen:
        o_proj = [graph.node(u)["weight"] for u in graph.users(name) if graph.node(u).op == "linear"]
        if len(o_proj) != 1:
            raise EngineError(f"{graph.name}/{name}: expected one o_proj after an attention node, found {len(o_proj)}")
        path = _module_path(o_proj[0]).rpartition(".")[0]  # "model.layers.3.self_attn"
        try:
            module = root.get_submodule(path)
        except AttributeError:
            module = None
        if not isinstance(module, (Attention, GatedAttention)):
            raise EngineError(f"no attention module {path!r} serves {graph.name}/{name}")
        module.attention = split_kv
    return len(chosen)


def install_draft_vocab(program: Program, drafter, target: nn.Module, target_dir: Path | None,
                        drafter_dir: Path | None, eos_token_id: int | None, tokenizer=None) -> DraftVocab | None:
    """Serve the drafter's logits from a token subset where its lm_head node asks for one
    (passes/draft_vocab.py): the subset stored beside the drafter (an engine's), else counted from
    the node's corpus with the target's tokenizer (`tokenizer` where the target has no directory)."""
    heads = program.drafter.find("lm_head", lambda node: node.get("vocab_subset", 0) > 0)
    if not heads:
        return None
    node = program.drafter.node(heads[0])
    size, corpus, vocab_size = node["vocab_subset"], node.get("vocab_corpus", STDLIB), node["out_features"]
    stored = Path(drafter_dir) / VOCAB_FILE if drafter_dir is not None else None
    if stored is not None and stored.is_file():
        vocab = DraftVocab(load_vocab(stored, size, vocab_size, corpus), corpus)
    else:
        vocab = build_vocab(tokenizer or load_tokenizer(target_dir), corpus, size, vocab_size, eos_token_id)
    if isinstance(drafter, DFlashDrafter):  # the target's head, borrowed
        head = SubsetHead(head_weight(target.lm_head), vocab.ids, vocab_size)
        drafter.set_head(head)
    else:
        root = drafter_root(drafter)
        head = root.lm_head = SubsetHead(head_weight(root.lm_head), vocab.ids, vocab_size)
    if head.weight.device.type == "cpu":
        pack_linears(head)  # as build_engine packs the models' own linears (a DFlash drafter's head is not a submodule)
    return vocab


def drafter_root(drafter) -> nn.Module:
    """The module whose submodule paths match the drafter graph's weight names."""
    return getattr(drafter, "model", drafter)


@dataclass
class Engine:
    """A compiled deployment, ready to generate."""

    program: Program
    target: nn.Module
    target_cfg: object
    drafter: object
    device: torch.device
    dtype: str
    eos_token_id: int | None
    draft_vocab: DraftVocab | None = None  # the drafter head's token subset (draft-vocab pass)
    replay: Replay | None = None  # a replay drafter's plans and accept-length draws (runtime/replay.py)
    replay_setup: "ReplaySetup | None" = None
    tuning: KernelTuning | None = None  # the kernels' tuned tables: an engine directory's own (engine_tuning.json)

    def with_program(self, program: Program) -> "Engine":
        """This engine's modules run by another step graph (block size, chain or tree, graphs): what
        a benchmark sweeps without rebuilding the models. A replay engine draws for the new program."""
        replay = self.replay.reconfigured(replay_distribution(program, self.replay_setup)) if self.replay else None
        return dataclasses.replace(self, program=program, replay=replay)

    @property
    def kind(self) -> str:
        return self.program.step.one("draft")[1]["kind"]

    @property
    def block_size(self) -> int:
        return self.program.step.one("draft")[1]["block_size"]

    def generate(self, prompt_ids: list[int], max_new_tokens: int,
                 sampling: SamplingParams = GREEDY) -> decode.Generation:
        """Speculative decoding as the step graph says (a replay drafter's run follows its plan);
        greedy, or sampled losslessly by `sampling` (runtime/sampling.py)."""
        if self.replay is not None:
            if not sampling.greedy:
                raise EngineError("a replay drafter follows a greedy plan: sampling (temperature > 0) needs an engine "
                                  "with a real drafter")
            return self.replay.generate(prompt_ids, max_new_tokens, lambda: self.run_loop(prompt_ids, max_new_tokens))
        return self.run_loop(prompt_ids, max_new_tokens, sampling)

    def run_loop(self, prompt_ids: list[int], max_new_tokens: int,
                 sampling: SamplingParams = GREEDY) -> decode.Generation:
        """One run of the decode loop the step graph names."""
        from ..runtime import tree_decode

        verify = self.program.step.one("verify")[1]
        if verify["mode"] not in ("chain", "tree", "two-level"):
            raise EngineError(f"the torch backend cannot run verify mode {verify['mode']!r} yet")
        common = dict(max_new_tokens=max_new_tokens, eos_token_id=self.eos_token_id,
                      mask_token_id=self.drafter.mask_token_id, sampling=sampling)
        if verify["mode"] == "two-level":  # the tree loops, each drafted tree pruned by the first level
            from ..runtime.two_level import first_level

            propose = self.program.step.one("propose")[1]
            prune = first_level(verify["first"], verify["q"] - 1, self.target, verify.get("exit_layer", 0))
            common.update(budget=propose["budget"], topk=propose.get("topk", 4), prune=prune)
            if self.kind == "pard":
                return tree_decode.generate_pard_tree(self.target, self.drafter, prompt_ids, k=self.block_size, **common)
            return tree_decode.generate_dflash_tree(self.target, self.drafter, prompt_ids, block_size=self.block_size,
                                                    **common)
        if verify["mode"] == "tree":
            propose = self.program.step.one("propose")[1]
            common.update(budget=propose["budget"], topk=propose.get("topk", 4))
            if self.graphed:
                common.update(build=kernel_hooks.tree_builder(self.device))
            if self.kind == "pard":
                loop = graph_decode.generate_pard_tree_graphed if self.graphed else tree_decode.generate_pard_tree
                return loop(self.target, self.drafter, prompt_ids, k=self.block_size, **common)
            loop = graph_decode.generate_dflash_tree_graphed if self.graphed else tree_decode.generate_dflash_tree
            return loop(self.target, self.drafter, prompt_ids, block_size=self.block_size, **common)
        if self.kind == "pard":
            loop = graph_decode.generate_pard_graphed if self.graphed else decode.generate_pard
            return loop(self.target, self.drafter, prompt_ids, k=self.block_size, **common)
        loop = graph_decode.generate_dflash_graphed if self.graphed else decode.generate_dflash
        return loop(self.target, self.drafter, prompt_ids, block_size=self.block_size, **common)

    def batched(self, *, max_batch: int | None = None, capacity: int = 1024, cost=None, attention=None,
                draft_hook=None, graphs: bool = False):
        """The batched engine (runtime/batch.py) over this engine's modules, as the schedule node says:
        up to its `batch` requests (or `max_batch`), its mechanisms (verify_budget, ragged, spec_control)
        in the policy. `cost` (a StepCost) prices them; None: profiled here on the engine's own forwards.
        A replay engine's drafts follow per-request plans only through `draft_hook`. `graphs`: verify and
        drafter forwards as CUDA-graph replays by shape (runtime/batch.GraphedVerify, GraphedDraft; a tree
        program's greedy step one replay with its trees built on the device, GraphedVerify.tree; a
        two-level program's engine runs eagerly); a profiled `cost` is measured on those replays.
        A tree-verify program verifies each request's best-first tree; a two-level one the batch's best
        nodes of all requests' trees by its first level (BatchEngine.keep_batch_wide; an early exit's
        second level continues from its layer), as many as verify-budget pays for when it is set.
        A hybrid target (Gated DeltaNet layers) runs eagerly: `graphs` is refused for it, as is an
        early-exit first level (runtime/batch_hybrid.py)."""
        from ..runtime.batch import BatchConfig, BatchEngine, graph_buckets, profile_step_cost
        from ..runtime.batch_control import BatchPolicy

        schedule = self.program.step.one("schedule")[1]
        if graphs and isinstance(self.target, HybridTransformer):
            raise EngineError("batched(graphs=True): the batched engine's CUDA graphs serve attention targets; this "
                              "one is a Gated DeltaNet hybrid, which the batched engine runs eagerly (graphs=False)")
        propose, verify = self.program.step.one("propose")[1], self.program.step.one("verify")[1]
        tree = (propose["budget"], propose.get("topk", 4)) if propose["shape"] == "tree" else None
        keep = verify["q"] - 1 if verify["mode"] == "two-level" else None  # the first level's budget, batch-wide
        drafts = self.block_size - 1 if self.kind == "dflash" else self.block_size
        batch = max_batch or schedule["batch"]
        graphs = graphs and keep is None  # two-level verification runs eagerly
        rows = batch * (drafts + 1 if tree is None else tree[0] + 1)
        config = BatchConfig(max_batch=batch, capacity=capacity, graphs=graphs,
                             buckets=graph_buckets(rows) if graphs else ())
        attention = attention or kernel_hooks.ragged_attention(self.device)
        engine = BatchEngine(self.target, self.drafter, eos_token_id=self.eos_token_id, config=config,
                             block_size=self.block_size, attention=attention, draft_hook=draft_hook, tree=tree,
                             keep=keep, first=verify.get("first", "drafter"), exit_layer=verify.get("exit_layer", 0),
                             tree_builder=kernel_hooks.tree_builder(self.device) if tree is not None else None)
        wants_cost = bool(schedule.get("verify_budget") or schedule.get("spec_control"))
        if wants_cost and cost is None:
            rows = sorted({config.max_batch * m for m in (1, 2, 4, 8, drafts + 1)})
            cost = profile_step_cost(engine, tokens=rows, requests=sorted({1, config.max_batch}))
        engine.policy = BatchPolicy(max_drafts=drafts, verify_budget=bool(schedule.get("verify_budget")),
                                    ragged=bool(schedule.get("ragged")), spec_control=bool(schedule.get("spec_control")),
                                    off_below=float(schedule.get("spec_off_below", 0.1)), cost=cost,
                                    survival="acceptance" if self.replay is not None else "confidence")
        engine.control.policy = engine.policy
        return engine

    def batched_ar(self, *, max_batch: int, capacity: int = 1024, attention=None, graphs: bool = False):
        """Batched AR, the baseline at batch: the same runtime with no drafter (graphed alike)."""
        from ..runtime.batch import BatchConfig, BatchEngine, graph_buckets

        return BatchEngine(self.target, None, eos_token_id=self.eos_token_id,
                           config=BatchConfig(max_batch=max_batch, capacity=capacity, graphs=graphs,
                                              buckets=graph_buckets(max_batch, 1) if graphs else ()),
                           attention=attention or kernel_hooks.ragged_attention(self.device))

    @property
    def graphed(self) -> bool:
        """The step graph asks for CUDA-graphed steps (the cuda-graphs pass)."""
        schedule = self.program.step.find("schedule")
        return bool(schedule) and bool(self.program.step.node(schedule[0]).get("graphs"))

    def generate_ar(self, prompt_ids: list[int], max_new_tokens: int) -> decode.Generation:
        """Greedy AR, the baseline: on a GPU always the strongest loop we have, the graphed one over
        the fused decoder stack with split-KV attention (kernel_hooks.fused_path; for the duration of
        the call, so the engine's own modules run as its program says); a hybrid target's graphed loop
        over its own modules (sparse MoE hybrids: eager)."""
        if self.device.type != "cuda" or (isinstance(self.target, HybridTransformer) and self.target.cfg.moe_layers):
            return decode.generate_ar(self.target, prompt_ids, max_new_tokens=max_new_tokens,
                                      eos_token_id=self.eos_token_id)
        if isinstance(self.target, HybridTransformer):  # no fused stack for Gated DeltaNet layers: graphed AR alone
            return graph_decode.generate_ar_graphed(self.target, prompt_ids, max_new_tokens=max_new_tokens,
                                                    eos_token_id=self.eos_token_id)
        with kernel_hooks.fused_path(self.target, tuning=self.tuning):
            return graph_decode.generate_ar_graphed(self.target, prompt_ids, max_new_tokens=max_new_tokens,
                                                    eos_token_id=self.eos_token_id)


FUSED_KERNEL = "triton-fused"  # the rmsnorm/rope/mlp kernel attribute the fused-decoder pass sets


def fused_stack(graph: Graph) -> bool:
    """Whether the graph asks for the fused decoder stack (its norms' kernel attribute)."""
    return bool(graph.find("rmsnorm", lambda node: node.get("kernel") == FUSED_KERNEL))


def pick_device(device: str | None = None) -> torch.device:
    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def default_dtype(device: torch.device) -> str:
    """bf16 where the GPU runs it natively; fp32 on CPU (bf16 matmuls there are slow and rare)."""
    return "bfloat16" if device.type == "cuda" else "float32"


@dataclass(frozen=True)
class ReplaySetup:
    """A replay drafter's profile, the benchmark of it, and the seed of its draws."""

    profile: str
    benchmark: str
    seed: int = 0


@dataclass(frozen=True)
class ShapeModels:
    """A target built by shape with seeded random weights (N(0, std)), and its replay drafter: the
    network of `drafter_cfg` (random weights too) overwritten to follow `replay`'s profile. Prompts
    tokenize with the byte tokenizer of the tiny models (ids 0..257, inside every vocabulary here)."""

    target_cfg: dict  # an HF config.json dict (hf/known.py)
    drafter_cfg: dict  # the replay network's config: dflash_config or pard_config of the target
    replay: ReplaySetup
    seed: int = 0
    std: float = 0.02

    def tokenizer(self):
        return build_byte_tokenizer(SPECIAL_TOKENS)

    def target(self, dtype: torch.dtype, device: torch.device) -> tuple[Transformer, ModelConfig]:
        """The target alone (also the reference token forcing reads: the same seed, no passes)."""
        cfg = ModelConfig.from_hf(self.target_cfg, "target shape")
        with torch.device("meta"):
            model = Transformer(cfg)
        _random(model, dtype, device, self.seed, self.std, self.target_cfg)
        return model.eval().requires_grad_(False), cfg

    def build(self, program: Program, dtype: torch.dtype, device: torch.device):
        """(target, its config, the replay drafter, its Replay) for `program`."""
        target, cfg = self.target(dtype, device)
        plan = ReplayPlan(cfg.max_position_embeddings + 4 * max(64, program.step.one("verify")[1]["q"]), device)
        dcfg = DrafterConfig.from_hf(self.drafter_cfg, "replay drafter shape")
        if dcfg.kind == "dflash":
            with torch.device("meta"):
                drafter = ReplayDFlash(dcfg, embed=target.embed, head=target.head, plan=plan)
            _random(drafter, dtype, device, self.seed + 1, self.std, self.drafter_cfg)
            drafter = drafter.eval().requires_grad_(False)
        else:
            with torch.device("meta"):
                model = ReplayCausalLM(dcfg.model, plan)
            _random(model, dtype, device, self.seed + 1, self.std, self.drafter_cfg)
            drafter = PardDrafter(model=model.eval().requires_grad_(False), mask_token_id=dcfg.mask_token_id,
                                  k=dcfg.block_size)
        replay = Replay(plan, replay_distribution(program, self.replay), self.replay.seed,
                        f"{self.replay.profile}/{self.replay.benchmark}")
        return target, cfg, drafter, replay


def _random(module: nn.Module, dtype: torch.dtype, device: torch.device, seed: int, std: float, shape: dict) -> None:
    """Materialize `module` (built on the meta device from the config `shape`) on `device` in `dtype`,
    every parameter drawn from N(0, std) by a generator seeded with `seed`, in the module's parameter
    order. Inside a `sharing_weights` scope a module of the same class, shape, seed, dtype and device
    built before gives its tensors instead: nothing is drawn or allocated again."""
    def draw() -> dict[str, torch.Tensor]:
        module.to(dtype=dtype).to_empty(device=device)
        _tie(module)  # to_empty unties shared weights
        generator = torch.Generator(device=device).manual_seed(seed)
        with torch.no_grad():
            for p in module.parameters():
                p.normal_(0.0, std, generator=generator)
        return dict(module.named_parameters())

    key = ("random", type(module).__qualname__, json.dumps(shape, sort_keys=True, default=str), seed, std, str(dtype),
           str(device))
    tensors = shared_tensors(key, draw)
    if not any(p.is_meta for p in module.parameters()):
        return  # drawn into this module just now
    for name, tensor in tensors.items():
        owner, _, leaf = name.rpartition(".")
        module.get_submodule(owner)._parameters[leaf] = nn.Parameter(tensor, requires_grad=False)
    _tie(module)
    left = [name for name, p in module.named_parameters() if p.is_meta]
    if left:
        raise EngineError(f"shared weights of {type(module).__name__} lack {left[:3]}")


def _tie(module: nn.Module) -> None:
    if isinstance(module, Transformer) and module.cfg.tie_word_embeddings:
        module.lm_head.weight = module.model.embed_tokens.weight


def replay_distribution(program: Program, setup: ReplaySetup) -> AcceptDistribution:
    """The accept lengths `setup`'s profile gives the program's step: a chain of its drafts, or the
    best-first tree of its proposal's budget and top-k over them."""
    draft, propose = program.step.one("draft")[1], program.step.one("propose")[1]
    drafts = draft["block_size"] - 1 if draft["kind"] == "dflash" else draft["block_size"]
    profile = load_profile(setup.profile)
    if propose["shape"] == "tree":
        return profile.distribution(setup.benchmark, drafts=drafts, budget=propose["budget"],
                                    topk=propose.get("topk", 4))
    return profile.distribution(setup.benchmark, drafts=drafts)


def build_engine(program: Program, target_dir: Path | None, drafter_dir: Path | None, device: torch.device, *,
                 shape: ShapeModels | None = None, tuning: KernelTuning | None = None) -> Engine:
    """The engine of `program` over the checkpoints in `target_dir` / `drafter_dir`, or (`shape`) over
    a target built by shape with random weights and its replay drafter. Its kernels take their
    configs from `tuning` (an engine directory's tables; default this install's, builtin_tuning)."""
    tuning = tuning or kernel_hooks.builtin_tuning()
    dtype = program.attr("dtype")
    compute = TORCH_DTYPES[dtype]
    replay, tokenizer = None, None
    planes = {part: _stored_u12(d, device) if d is not None else None
              for part, d in (("target", target_dir), ("drafter", drafter_dir))}
    if shape is None:  # an engine's checkpoint leaves out the weights its u12 planes hold
        target, target_cfg = load_target(target_dir, dtype=compute, device=device, stored=unpacked(planes["target"]))
        drafter = load_drafter(drafter_dir, target, target_cfg, dtype=compute, device=device,
                               stored=unpacked(planes["drafter"]))
    else:
        target, target_cfg, drafter, replay = shape.build(program, compute, device)
        tokenizer = shape.tokenizer()
    materialize_weights(program.target.items(), target, compute, planes["target"])
    materialize_weights(program.drafter.items(), drafter_root(drafter), compute, planes["drafter"])
    install_attention_kernels(program.target, target, device)
    install_attention_kernels(program.drafter, drafter_root(drafter), device)
    draft_vocab = install_draft_vocab(program, drafter, target, target_dir, drafter_dir, target_cfg.eos_token_id,
                                      tokenizer)
    if isinstance(target, HybridTransformer) and device.type == "cuda":
        kernel_hooks.install_gdn_tree(target)  # tree verifies of Gated DeltaNet layers on the Triton kernel
    roots = [m for m in (target, drafter_root(drafter)) if isinstance(m, nn.Module)]
    for module in (m for root in roots for m in root.modules()):
        if isinstance(module, U12Linear):
            module.tuning = tuning
    if device.type == "cpu":  # fp32 linears by oneDNN on packed weights; the AR baseline runs these modules too
        for root in roots:
            pack_linears(root)
    if fused_stack(program.target):
        kernel_hooks.install(target, tuning=tuning)
    if fused_stack(program.drafter):
        kernel_hooks.install(drafter_root(drafter), tuning=tuning)
    return Engine(program, target, target_cfg, drafter, device, dtype, target_cfg.eos_token_id, draft_vocab,
                  replay, shape.replay if shape else None, tuning)

"""Shared fixtures: tiny random llama and qwen3 models (target, DFlash and PARD drafters), built once.

Hypothesis runs derandomized by default, so a CI run draws the examples every earlier run drew
(a float tolerance met by chance cannot turn a later run red); HYPOTHESIS_PROFILE=explore draws
fresh ones when hunting for bugs.
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

# The device of the whole run, chosen once: the GPU where there is one. Without one Triton runs in
# its interpreter; Triton reads this when a kernel module is first imported, so it is set here,
# before any test module (or what it imports) can import one.
ON_GPU = torch.cuda.is_available()
DEVICE = torch.device("cuda" if ON_GPU else "cpu")
if not ON_GPU:
    os.environ["TRITON_INTERPRET"] = "1"
    import interpreter_patching

    interpreter_patching.install()  # a third less interpreter time (its docstring)

# Under pytest-xdist each core runs its own worker process; one intra-op thread per worker keeps
# the workers from spinning against each other (the suite is interpreter- and tiny-model-bound).
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)


def free_port() -> int:
    """A TCP port free on localhost now (for a server process a test starts)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_env(**extra: str) -> dict[str, str]:
    """The environment of a process a test starts as users would start it: this checkout first on
    PYTHONPATH (the rest kept), and no Triton interpreter (set above for the kernels only, it would put
    a CPU server's batched attention through the interpreter)."""
    path = os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH")]))
    return {**{k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}, "PYTHONPATH": path, **extra}


import pytest  # noqa: E402
from hypothesis import settings  # noqa: E402

settings.register_profile("ci", derandomize=True)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

from specpilot.hf.config import ModelConfig  # noqa: E402
from specpilot.runtime.dflash import DFlashDrafter  # noqa: E402
from specpilot.runtime.load import load_drafter, load_target  # noqa: E402
from specpilot.runtime.model import PardDrafter, Transformer  # noqa: E402
from specpilot.runtime.tiny import build_tiny_models  # noqa: E402
from specpilot.runtime.tree import Tree  # noqa: E402

FAMILIES = ("llama", "qwen3")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked gpu need a CUDA GPU: skipped, with the reason, where there is none."""
    if ON_GPU:
        return
    no_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(no_gpu)


@pytest.fixture(scope="session")
def device() -> torch.device:
    """The run's device (conftest.DEVICE): kernels run natively there, or under the interpreter."""
    return DEVICE


def random_tree(seed: int, n: int, vocab: int, pad: int = 0) -> Tree:
    """n nodes, each parent an earlier node (so parents precede), tokens drawn below `vocab`; `pad`
    padding nodes after them."""
    g = torch.Generator().manual_seed(seed)
    parent, depth = [-1], [0]
    for i in range(1, n):
        p = int(torch.randint(0, i, (1,), generator=g))
        parent.append(p)
        depth.append(depth[p] + 1)
    return Tree.from_lists(parent, depth, torch.randint(0, vocab, (n,), generator=g).tolist()).padded(n + pad)


def tiny_spec(kind: str, family: str = "qwen3", extra: str = "") -> str:
    """A pipeline.yaml over a tiny zoo pair (`kind` drafter of block 4), two smoke prompts; `extra`
    is appended (more top-level fields)."""
    return (f"name: t\ntarget: tiny-{family}\ndrafter:\n  kind: {kind}\n  block_size: 4\ngpu: h200\n"
            f"serving:\n  max_new_tokens: 12\nbenchmark:\n  prompts: code-smoke\n  num_prompts: 2\n{extra}")


@dataclass
class TinyModels:
    dirs: dict[str, Path]  # "target", "dflash", "pard" -> model directory
    target: Transformer
    cfg: ModelConfig
    dflash: DFlashDrafter
    pard: PardDrafter


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Path]]:
    """family -> {"target"|"dflash"|"pard": HF model dir}; treat the files as read-only."""
    root = tmp_path_factory.mktemp("tiny")
    return {family: build_tiny_models(root / family, family=family) for family in FAMILIES}


@pytest.fixture(scope="session")
def tiny_models(tiny_model_dirs: dict[str, dict[str, Path]]) -> dict[str, TinyModels]:
    """family -> the tiny models loaded in float32 on the CPU."""
    out = {}
    for family, dirs in tiny_model_dirs.items():
        target, cfg = load_target(dirs["target"], dtype=torch.float32, device="cpu")
        dflash = load_drafter(dirs["dflash"], target, cfg, dtype=torch.float32, device="cpu")
        pard = load_drafter(dirs["pard"], target, cfg, dtype=torch.float32, device="cpu")
        out[family] = TinyModels(dirs=dirs, target=target, cfg=cfg, dflash=dflash, pard=pard)
    return out


@pytest.fixture(scope="module")
def torch_single_thread():
    """One intra-op thread: the tiny models gain nothing from more, and on a shared 2-core machine
    two threads spinning against other processes made a decode loop up to 50x slower (measured)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@contextlib.contextmanager
def registries_restored() -> Iterator[None]:
    """The pass registry and the weight-format tables as they were on entry, whatever a planted pass
    or format added inside."""
    from specpilot.backends import torch_backend
    from specpilot.ir import node as ir_node
    from specpilot.passes import REGISTRY

    saved = (dict(REGISTRY), set(ir_node.WEIGHT_FORMATS), dict(ir_node.FORMAT_BITS), dict(torch_backend.WEIGHT_FORMATS))
    try:
        yield
    finally:
        for live, kept in zip((REGISTRY, ir_node.WEIGHT_FORMATS, ir_node.FORMAT_BITS, torch_backend.WEIGHT_FORMATS),
                              saved):
            live.clear()
            live.update(kept)

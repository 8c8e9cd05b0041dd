"""Deployable engine directories: each weight stored once in its final format with its kernels' tuned
tables, served from a copy by a fresh install in a fresh process with no pass run again, and bad engines (a tampered file, a missing shard, another
specpilot version or GPU kind) refused with an error naming the file."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx
import openai
import pytest
import torch
from click.testing import CliRunner
from safetensors import safe_open
from safetensors.torch import save_file

from specpilot.backends import kernel_hooks
from specpilot.backends.engine_dir import TUNING_FILE, copy_checkpoint, write_manifest
from specpilot.backends.kernel_hooks import builtin_tuning
from specpilot.cli import main
from specpilot.compiler import compile_pipeline, load_engine
from specpilot.formats.digest import file_sha256
from specpilot.formats.u12 import load_u12
from specpilot.kernels import fused_linear, u12
from specpilot.kernels.fused_linear import FusedLinearConfig
from specpilot.runtime.builtin import resolve_builtin
from specpilot.runtime.load import load_target
from specpilot.runtime.sampling import SamplingParams
from specpilot.spec import load_spec

from conftest import free_port

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "def add(a, b):"


def compile_zoo(root: Path, name: str, extra: str = "") -> Path:
    spec = root / f"{name}.yaml"
    spec.write_text(f"name: {name}\ntarget: code-qwen3\ndrafter:\n  kind: pard\ngpu: h200\nserving:\n"
                    f"  max_new_tokens: 8\nbenchmark:\n  prompts: code-smoke\n  num_prompts: 1\n{extra}")
    compile_pipeline(load_spec(spec), out_dir=root / name, device="cpu")
    return root / name


@pytest.fixture(scope="module")
def engine(tmp_path_factory) -> Path:
    return compile_zoo(tmp_path_factory.mktemp("engines"), "zoo-pard")


def copy_of(engine: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "copied" / "engine"
    shutil.copytree(engine, dst)
    return dst


def refused(engine: Path, *fragments: str) -> None:
    r = CliRunner().invoke(main, ["serve", str(engine), "--device", "cpu", "--port", "1"])
    assert r.exit_code == 2, r.output
    assert "Traceback" not in r.output
    for f in fragments:
        assert f in r.output, r.output


def test_copy_checkpoint_leaves_out_what_is_stored_in_another_format(tmp_path):
    src, dst = tmp_path / "src", tmp_path / "dst"
    src.mkdir()
    (src / "config.json").write_text("{}")
    save_file({"a": torch.ones(2), "b": torch.zeros(3)}, str(src / "model-00001-of-00002.safetensors"),
              metadata={"format": "pt"})
    save_file({"c": torch.ones(4)}, str(src / "model-00002-of-00002.safetensors"))
    (src / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "a": "model-00001-of-00002.safetensors", "b": "model-00001-of-00002.safetensors",
        "c": "model-00002-of-00002.safetensors"}}))
    copy_checkpoint(src, dst, frozenset({"b", "c"}))
    with safe_open(str(dst / "model-00001-of-00002.safetensors"), "pt") as f:
        assert list(f.keys()) == ["a"] and f.metadata() == {"format": "pt"}
    assert not (dst / "model-00002-of-00002.safetensors").exists()  # left empty: dropped
    assert json.loads((dst / "model.safetensors.index.json").read_text())["weight_map"] == {
        "a": "model-00001-of-00002.safetensors"}
    assert (dst / "config.json").is_file()


@pytest.mark.slow
def test_u12_engine_stores_each_weight_once_and_loads_bit_exact(tmp_path):
    """weights-u12 on the tied head/embedding: the checkpoint keeps no bf16 copy of it; the engine
    (and the reference token forcing reads) rebuild it bit for bit from the planes."""
    engine = compile_zoo(tmp_path, "zoo-u12", 'dtype: bfloat16\npasses: "weights-u12{kernel=torch,min-numel=1000000}"\n')
    planes = load_u12(engine / "target" / "u12.safetensors")
    with safe_open(str(engine / "target" / "model.safetensors"), "pt") as f:
        kept = set(f.keys())
    assert planes and not kept & set(planes)  # no weight both in the checkpoint and as planes
    source, _ = load_target(resolve_builtin("code-qwen3"), dtype=torch.bfloat16, device="cpu")
    loaded = load_engine(copy_of(engine, tmp_path), device="cpu")
    assert torch.equal(loaded.engine.target.model.embed_tokens.weight, source.model.embed_tokens.weight)
    r = CliRunner().invoke(main, ["verify", str(engine), "--device", "cpu"])
    assert r.exit_code == 0 and "PASS" in r.output, r.output


GUARD = """
import sys
import specpilot
import specpilot.backends.torch_backend as backend
import specpilot.compiler as compiler

def recompiled(*args, **kwargs):
    raise SystemExit("recompiled: " + repr(args)[:80])

compiler.run_passes = compiler.compile_pipeline = compiler.lower_spec = backend.pack_u12 = recompiled
print("guard: specpilot from", specpilot.__file__, file=sys.stderr, flush=True)
"""


def build_wheel(root: Path) -> subprocess.Popen:
    """Start building specpilot's wheel from a copy of this checkout's sources into root/wheels."""
    src = root / "src"
    shutil.copytree(ROOT / "specpilot", src / "specpilot", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", src)
    return subprocess.Popen([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                             str(root / "wheels"), str(src)], cwd=root, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def fresh_install(root: Path, wheel: subprocess.Popen) -> Path:
    """The wheel (build_wheel) installed into a new venv that sees none of the checkout: no PYTHONPATH,
    and the dependencies (torch, ...) through a .pth naming this interpreter's site-packages, whose
    own .pth files (the editable install of the main checkout among them) are not processed. A
    second .pth imports GUARD: the compile entry points raise, and the process says where it
    imported specpilot from. Returns the venv's bin folder."""
    import sysconfig

    run = lambda *args: subprocess.run(args, check=True, capture_output=True, text=True, cwd=root)  # noqa: E731
    venv = root / "venv"
    run(sys.executable, "-m", "venv", "--without-pip", str(venv))
    python = venv / "bin" / "python"
    site = Path(run(str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])").stdout.strip())
    deps = dict.fromkeys(sysconfig.get_paths()[k] for k in ("purelib", "platlib"))
    (site / "specpilot-test-deps.pth").write_text("".join(f"{d}\n" for d in deps))
    out, _ = wheel.communicate(timeout=300)
    assert wheel.returncode == 0, out.decode()
    shutil.rmtree(root / "src")
    run(sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps", "--no-index",
        *map(str, (root / "wheels").glob("specpilot-*.whl")))
    (site / "specpilot_test_guard.py").write_text(textwrap.dedent(GUARD))
    (site / "specpilot-test-guard.pth").write_text("import specpilot_test_guard\n")
    return venv / "bin"


def snapshot(folder: Path) -> dict[str, tuple[str, float]]:
    return {str(p.relative_to(folder)): (file_sha256(p), p.stat().st_mtime) for p in sorted(folder.rglob("*"))
            if p.is_file()}


@pytest.mark.slow
def test_a_copied_engine_is_served_by_a_fresh_install_without_recompiling(engine, tmp_path):
    """The engine copied elsewhere, `specpilot serve DIR` from a fresh install (a wheel of these
    sources in a new venv, run from a folder outside the checkout): it answers greedy and sampled
    requests as the engine does here, imports specpilot from the install, runs no compile, and leaves
    the engine's files (and the empty cache) as they were."""
    (tmp_path / "install").mkdir()
    wheel = build_wheel(tmp_path / "install")
    copied = copy_of(engine, tmp_path)
    before = snapshot(copied.parent)
    expected = load_engine(engine, device="cpu")
    ids = expected.tokenizer.encode(PROMPT).ids
    want = expected.tokenizer.decode(expected.engine.generate(ids, 12).tokens)
    want_sampled = expected.tokenizer.decode(expected.engine.generate(ids, 12, SamplingParams(0.9, 0.95, 5)).tokens)
    bin_dir = fresh_install(tmp_path / "install", wheel)
    port = free_port()
    cache = tmp_path / "empty-cache"
    cache.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "TRITON_INTERPRET")}
    env["SPECPILOT_CACHE"] = str(cache)
    log = tmp_path / "server.log"
    workdir = tmp_path / "elsewhere"
    workdir.mkdir()
    proc = subprocess.Popen([str(bin_dir / "specpilot"), "serve", str(copied), "--port", str(port), "--device", "cpu",
                             "--threads", "1"], cwd=workdir, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(600):
            assert proc.poll() is None, log.read_text()
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        r = client.completions.create(model="zoo-pard", prompt=PROMPT, max_tokens=12, temperature=0)
        assert r.choices[0].text == want
        r = client.completions.create(model="zoo-pard", prompt=PROMPT, max_tokens=12, temperature=0.9, top_p=0.95,
                                      seed=5)
        assert r.choices[0].text == want_sampled
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    text = log.read_text()
    assert f"guard: specpilot from {tmp_path / 'install' / 'venv'}" in text, text
    assert "recompiled" not in text and str(ROOT) not in text, text
    assert snapshot(copied.parent) == before  # nothing rewritten, nothing added beside the engine
    assert not any(cache.iterdir())


def test_a_tampered_file_is_refused_naming_it(engine, tmp_path):
    copied = copy_of(engine, tmp_path)
    weights = copied / "drafter" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    refused(copied, "drafter/model.safetensors does not match its checksum")


def test_a_missing_shard_is_refused_naming_it(engine, tmp_path):
    copied = copy_of(engine, tmp_path)
    (copied / "target" / "model.safetensors").unlink()
    refused(copied, "target/model.safetensors listed in engine.json is missing")


@pytest.mark.parametrize("field, value, fragments", [
    ("built_on", {"device": "NVIDIA H100 80GB HBM3", "gpu": "h100"}, ("built_on.gpu", "'h100'", "no GPU")),
    ("specpilot", "0.0.1", ("built by specpilot 0.0.1", "recompile")),
    ("format", None, ("engine format (none", "recompile")),
])
def test_an_engine_for_another_gpu_or_version_is_refused(engine, tmp_path, field, value, fragments):
    copied = copy_of(engine, tmp_path)
    manifest = json.loads((copied / "engine.json").read_text())
    manifest[field] = value
    (copied / "engine.json").write_text(json.dumps(manifest))
    refused(copied, "engine.json", *fragments)


def retune(copied: Path, edit) -> None:
    """Rewrite the copy's kernel_tuning.json through `edit` (its JSON in, JSON out), digests renewed."""
    path = copied / TUNING_FILE
    path.write_text(json.dumps(edit(json.loads(path.read_text()))))
    manifest = json.loads((copied / "engine.json").read_text())
    write_manifest(copied, {k: v for k, v in manifest.items() if k != "files"})


def test_an_engine_holds_its_kernels_tuned_tables_and_runs_with_them(engine, tmp_path):
    """kernel_tuning.json: this install's tables at compile time, covered by the manifest's digests;
    a copied engine's kernels take their configs from its own file, not from the install's tables."""
    assert TUNING_FILE in json.loads((engine / "engine.json").read_text())["files"]
    assert json.loads((engine / TUNING_FILE).read_text()) == builtin_tuning().to_json()
    key_fl, key_u12, key_fused = (1, 4096, 4096, False), (16, 4096, 4096), (1, 4096, 4096, False)
    assert fused_linear.default_config(*key_fl, on_gpu=True) != FusedLinearConfig("gemv", 16, 64, num_warps=8)
    retuned = {"fused_linear": FusedLinearConfig("gemv", 16, 64, num_warps=8),
               "u12": u12.U12Config(64, 64, split_k=2, num_warps=8, num_stages=3, kernel="mma"),
               "u12_fused": u12.U12Config(8, 32, num_warps=8, num_stages=1, kernel="gemv2")}

    def edit(tables):
        tables["fused_linear"].append({"key": list(key_fl), "config": dataclasses.asdict(retuned["fused_linear"])})
        tables["u12"].append({"key": list(key_u12), "config": dataclasses.asdict(retuned["u12"])})
        tables["u12_fused"] = [{"key": list(key_fused), "config": dataclasses.asdict(retuned["u12_fused"])}]
        return tables

    copied = copy_of(engine, tmp_path)
    retune(copied, edit)
    tuning = load_engine(copied, device="cpu").engine.tuning
    assert fused_linear.default_config(*key_fl, on_gpu=True, tuning=tuning) == retuned["fused_linear"]
    assert u12.default_config(16, 4096, 4096, on_gpu=True, tuning=tuning) == retuned["u12"]
    assert u12.fused_config(*key_fused, on_gpu=True, tuning=tuning) == retuned["u12_fused"]
    assert u12.fused_config(1, 6144, 4096, False, on_gpu=True, tuning=tuning) != u12.TUNED_FUSED[1, 6144, 4096, False]
    ops = kernel_hooks.fused_ops("triton", tuning=tuning)  # what build_engine installs for a fused stack
    assert all(fn.keywords["tuning"] is tuning for fn in (ops.linear, ops.linear_u12, ops.u12_project))


@pytest.mark.parametrize("edit, fragments", [
    (lambda t: {**t, "fused_linear": [{"key": [1, 2, 3, False], "config": {"kernel": "gemv", "block_n": 3}}]},
     ("table 'fused_linear', entry 0", "FusedLinearConfig")),
    (lambda t: {**t, "attention": []}, ("table 'attention'", "expected one of")),
])
def test_a_bad_kernel_tuning_file_is_refused_naming_it(engine, tmp_path, edit, fragments):
    copied = copy_of(engine, tmp_path)
    retune(copied, edit)
    refused(copied, TUNING_FILE, *fragments)

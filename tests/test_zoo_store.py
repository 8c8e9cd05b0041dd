"""The zoo's stored form (specpilot/zoo: large files as .xz, a manifest of every file's sha256) and its
materialization into the cache: byte for byte the trained files, checked, keyed by what is stored,
safe under concurrent processes."""

from __future__ import annotations

import hashlib
import json
import lzma
import threading
from pathlib import Path

import pytest

from specpilot import zoo
from specpilot.errors import CheckpointError
from specpilot.runtime.builtin import resolve_builtin


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    """The worker's cache, shared with the other tests that set one (a pair materializes in ~1-5 s)."""
    return tmp_path_factory.getbasetemp() / "specpilot-cache"


@pytest.mark.parametrize("pair", zoo.PAIRS)
def test_committed_pairs_materialize_to_the_files_their_manifest_records(pair, cache):
    """Every file the manifest lists comes out with its recorded sha256 and size (the bf16 weights
    and tokenizer as trained: the manifest was written from them), and nothing else does."""
    manifest = json.loads((zoo.pair_source(pair) / zoo.MANIFEST).read_text())["files"]
    assert {"target/model.safetensors", "target/tokenizer.json", "target/config.json"} <= set(manifest)
    assert (zoo.pair_source(pair) / "target" / "model.safetensors.xz").is_file()
    assert not (zoo.pair_source(pair) / "target" / "model.safetensors").exists()
    out = zoo.pair_dir(pair, cache)
    made = {p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()} - {zoo.MANIFEST}
    assert made == set(manifest)
    for rel, entry in manifest.items():
        assert (out / rel).stat().st_size == entry["bytes"] and sha256(out / rel) == entry["sha256"], rel


def test_the_built_in_names_resolve_into_the_cache(cache, monkeypatch):
    monkeypatch.setenv("SPECPILOT_CACHE", str(cache))
    target = resolve_builtin("code-qwen3")
    assert target.parent.parent == cache / "zoo" and target.parent.name.startswith("code-qwen3-")
    assert resolve_builtin("code-qwen3/pard") == target.parent / "pard"
    stamp = (target / "model.safetensors").stat().st_mtime_ns
    assert resolve_builtin("code-qwen3") == target  # materialized once
    assert (target / "model.safetensors").stat().st_mtime_ns == stamp


@pytest.fixture
def small_pair(tmp_path) -> tuple[Path, Path]:
    """A plain pair folder of small files and its stored form."""
    plain = tmp_path / "plain" / "p"
    (plain / "target").mkdir(parents=True)
    (plain / "target" / "config.json").write_text('{"a": 1}\n')
    (plain / "target" / "model.safetensors").write_bytes(bytes(range(256)) * 64)
    (plain / "target" / "tokenizer.json").write_text('{"vocab": "' + "ab" * 500 + '"}')
    (plain / "train_log.json").write_text("{}\n")
    stored = tmp_path / "zoo" / "p"
    zoo.store_pair(plain, stored)
    return plain, stored


def test_store_then_materialize_is_the_identity_and_xz_d_reads_it(small_pair, tmp_path):
    plain, stored = small_pair
    assert sorted(p.relative_to(stored).as_posix() for p in stored.rglob("*") if p.is_file()) == [
        "manifest.json", "target/config.json", "target/model.safetensors.xz", "target/tokenizer.json.xz",
        "train_log.json"]
    assert lzma.decompress((stored / "target" / "model.safetensors.xz").read_bytes()) == \
        (plain / "target" / "model.safetensors").read_bytes()  # plain xz, no format of ours
    out = zoo.materialize(stored, tmp_path / "cache")
    for p in plain.rglob("*"):
        if p.is_file():
            assert (out / p.relative_to(plain)).read_bytes() == p.read_bytes()


def test_a_changed_stored_file_gets_a_new_directory_and_a_wrong_one_is_refused(small_pair, tmp_path):
    plain, stored = small_pair
    cache = tmp_path / "cache"
    first = zoo.materialize(stored, cache)
    weights = stored / "target" / "model.safetensors.xz"
    weights.write_bytes(lzma.compress(b"other weights"))  # the manifest still records the trained file
    with pytest.raises(CheckpointError, match=r"model\.safetensors\.xz: gives a file of sha256 .* records"):
        zoo.materialize(stored, cache)
    assert first.is_dir() and not any(p.name.startswith(".") for p in (cache / "zoo").iterdir())  # no debris
    weights.write_bytes(b"not xz at all")
    with pytest.raises(CheckpointError, match="not a valid xz file"):
        zoo.materialize(stored, cache)
    zoo.store_pair(plain, stored)
    (stored / "extra.txt").write_text("x")
    with pytest.raises(CheckpointError, match="no entry for extra.txt"):
        zoo.materialize(stored, cache)
    (stored / "extra.txt").unlink()
    (stored / "target" / "config.json").unlink()
    with pytest.raises(CheckpointError, match="missing target/config.json"):
        zoo.materialize(stored, cache)
    (stored / zoo.MANIFEST).unlink()
    with pytest.raises(CheckpointError, match="manifest.json: missing"):
        zoo.materialize(stored, cache)


def test_concurrent_materializations_agree(small_pair, tmp_path):
    """Workers racing on an empty cache (pytest-xdist) all get the one complete directory."""
    _, stored = small_pair
    cache, results, errors = tmp_path / "cache", [], []

    def work():
        try:
            results.append(zoo.materialize(stored, cache))
        except Exception as e:  # noqa: BLE001 - collected for the assertion
            errors.append(e)

    threads = [threading.Thread(target=work) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(set(results)) == 1
    assert [p.name for p in (cache / "zoo").iterdir()] == [results[0].name]
    assert (results[0] / "target" / "config.json").read_text() == '{"a": 1}\n'

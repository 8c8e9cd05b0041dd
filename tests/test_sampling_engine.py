"""Sampling through a compiled engine: `Engine.generate(..., sampling)` and `specpilot run
--temperature/--top-p/--seed` (the distribution itself is tests/test_sampling.py's business)."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from conftest import tiny_spec
from specpilot.cli import main
from specpilot.compiler import load_engine
from specpilot.runtime.sampling import SamplingParams

pytestmark = pytest.mark.usefixtures("torch_single_thread")


@pytest.fixture(scope="module")
def engine_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("sampling-engine")
    spec = root / "pipeline.yaml"
    spec.write_text(tiny_spec("pard"))
    r = CliRunner().invoke(main, ["compile", str(spec), "-o", str(root / "engine"), "--device", "cpu"])
    assert r.exit_code == 0, r.output
    return root / "engine"


def test_engine_samples_reproducibly_and_greedy_by_default(engine_dir):
    engine = load_engine(engine_dir, device="cpu").engine
    prompt = [72, 101, 108, 108, 111]
    greedy = engine.generate(prompt, 12).tokens
    assert engine.generate(prompt, 12, SamplingParams()).tokens == greedy
    runs = [engine.generate(prompt, 12, SamplingParams(temperature=1.0, seed=s)).tokens for s in range(4)]
    assert runs == [engine.generate(prompt, 12, SamplingParams(temperature=1.0, seed=s)).tokens for s in range(4)]
    assert len({tuple(r) for r in runs}) > 1 and all(1 <= len(r) <= 12 for r in runs)  # EOS may be drawn


def test_run_command_takes_sampling_options(engine_dir):
    run = lambda *extra: CliRunner().invoke(main, ["run", str(engine_dir), "--prompt", "def f(", "--device", "cpu",  # noqa: E731
                                                   "--max-new-tokens", "8", *extra])
    a, b = run("--temperature", "0.9", "--top-p", "0.95", "--seed", "5"), run("--temperature", "0.9", "--top-p",
                                                                                "0.95", "--seed", "5")
    assert a.exit_code == 0 and a.stdout == b.stdout, a.output
    for bad in (["--temperature", "-1"], ["--top-p", "0"], ["--seed", "-2"]):
        r = run(*bad)
        assert r.exit_code == 2 and "Invalid value" in r.output, (bad, r.output)

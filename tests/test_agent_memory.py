"""The search memory (specpilot/agent/memory.py): what it keeps, nearest-fingerprint seeding, and
that it survives kill -9 mid-write and several processes writing at once."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from specpilot.agent.fingerprint import Fingerprint
from specpilot.agent.memory import Memory, MemoryStoreError

ROOT = Path(__file__).resolve().parents[1]
FP = Fingerprint("qwen3", "qwen3-8x384-v8192-L8", "dflash", "L2-b16", "cpu", "float32", "b1")

WRITER = textwrap.dedent("""
    import sys
    from specpilot.agent.fingerprint import Fingerprint
    from specpilot.agent.memory import Memory
    path, name, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
    fp = Fingerprint("qwen3", "s", "dflash", "d", "cpu", "float32", "b1")
    m = Memory(path)
    i = 0
    while n < 0 or i < n:
        m.record(run=name, round=1, trial=i, fingerprint=fp, pipeline=f"draft-block-size{{size={2 + i % 14}}}",
                 proposer="test", status="validated", relative=0.9, forcing_passed=True)
        print(i, flush=True)  # committed before it is printed
        i += 1
""")


def writer(path: Path, name: str, n: int) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-c", WRITER, str(path), name, str(n)], stdout=subprocess.PIPE, text=True,
                            env=env)


def row(m: Memory, fp: Fingerprint, pipeline: str, relative: float, improved: bool) -> int:
    rid = m.record(run="r", round=1, trial=1, fingerprint=fp, pipeline=pipeline, proposer="test", status="validated",
                   relative=relative, forcing_passed=True)
    if improved:
        m.mark_improved(rid)
    return rid


def test_mechanisms_come_from_the_nearest_fingerprints(tmp_path):
    m = Memory(tmp_path / "m.db")
    row(m, FP, "cuda-graphs", 0.5, True)
    row(m, FP, "tree-verify{budget=16, topk=2}", 0.4, False)  # validated but never an improvement
    pard = Fingerprint(**{**FP.__dict__, "drafter_kind": "pard"})
    row(m, pard, "draft-block-size{size=4}", 0.3, True)
    far = Fingerprint(**{**FP.__dict__, "device": "h200", "dtype": "bfloat16", "batch": "b32"})
    row(m, far, "fused-decoder", 0.2, True)
    got = m.mechanisms(FP)
    assert [g.pipeline for g in got] == ["cuda-graphs", "draft-block-size{size=4}"]  # nearest first; far excluded
    assert got[0].distance == 0 and got[1].distance == 1
    rejected = m.record(run="r", round=1, trial=2, fingerprint=FP, pipeline="x", proposer="llm", status="rejected",
                        reason="unknown pass 'x'")
    m.mark_improved(rejected)  # a rejected trial never becomes a mechanism
    assert "x" not in [g.pipeline for g in m.mechanisms(FP)]
    summary = {s["fingerprint"]["drafter_kind"] + s["fingerprint"]["device"]: s for s in m.summary()}
    assert summary["dflashcpu"]["trials"] == 3 and summary["dflashcpu"]["rejected"] == 1


def test_not_a_store_is_a_clear_error(tmp_path):
    bad = tmp_path / "bad.db"
    bad.write_bytes(b"this is no sqlite file at all" * 100)
    with pytest.raises(MemoryStoreError, match="bad.db"):
        Memory(bad)


def test_survives_kill_9_mid_round(tmp_path):
    path = tmp_path / "m.db"
    p = writer(path, "killed", -1)
    printed = []
    deadline = time.time() + 60
    while len(printed) < 20 and time.time() < deadline:
        printed.append(p.stdout.readline())
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    m = Memory(path)
    assert m.integrity() == "ok"
    assert m.count() >= len(printed) >= 20  # every row printed was committed before it
    m.record(run="after", round=1, trial=1, fingerprint=FP, pipeline="", proposer="test", status="validated")
    assert m.count() >= 21


def test_concurrent_writers(tmp_path):
    path = tmp_path / "m.db"
    Memory(path).close()
    procs = [writer(path, f"w{i}", 25) for i in range(3)]
    for p in procs:
        out, _ = p.communicate(timeout=120)
        assert p.returncode == 0
    m = Memory(path)
    assert m.integrity() == "ok"
    assert m.count() == 75
    assert sorted({r["run"] for r in m.trials()}) == ["w0", "w1", "w2"]

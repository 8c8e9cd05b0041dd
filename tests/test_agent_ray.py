"""`--workers ray://ADDRESS`: candidates as Ray tasks on a local Ray instance (slow: starting a head
node takes tens of seconds). Skipped only where Ray is not installed.

The head runs with `ray start --head --block` in its own process group, stopped by that group's id
at the end (SIGTERM, then SIGKILL after 5 s). Where the machine's Ray uses token authentication (a token in ~/.ray/auth_token), the
client is told so through RAY_AUTH_MODE=token, set before ray is first imported."""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from specpilot.agent.trial import FAILED, VALIDATED, TrialJob
from specpilot.agent.workers import RayPool
from specpilot.compiler import run_trial
from specpilot.spec import load_spec

from conftest import free_port, tiny_spec

if importlib.util.find_spec("ray") is None:
    pytest.skip("Ray is not installed (requirements.lock pins ray[client])", allow_module_level=True)


@pytest.mark.slow
def test_ray_workers_run_real_trials(tmp_path, monkeypatch):
    assert "ray" not in sys.modules, "ray must not be imported before RAY_AUTH_MODE can be set"
    gcs, client = free_port(), free_port()
    short = Path(tempfile.mkdtemp(prefix="sp-ray-", dir="/tmp"))  # Ray's socket paths must stay short
    exe = Path(sys.executable).with_name("ray")
    head = subprocess.Popen([str(exe), "start", "--head", "--block", f"--port={gcs}", f"--ray-client-server-port={client}",
                             "--min-worker-port=0", "--max-worker-port=0", "--num-cpus=2", "--include-dashboard=false",
                             f"--temp-dir={short}", "--disable-usage-stats"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        spec_path = tmp_path / "p.yaml"
        spec_path.write_text(tiny_spec("dflash"))
        spec = load_spec(spec_path)
        deadline = time.time() + 150
        while True:  # the client server listens once the head is up
            assert head.poll() is None, "ray start --head exited"
            try:
                socket.create_connection(("127.0.0.1", client), timeout=1).close()
                break
            except OSError:
                assert time.time() < deadline, "the Ray head did not come up in 150 s"
                time.sleep(1)
        if (Path.home() / ".ray" / "auth_token").exists():  # a head that made a token wants it; read at ray's import
            monkeypatch.setenv("RAY_AUTH_MODE", "token")
        pool = RayPool(run_trial, f"ray://127.0.0.1:{client}")
        try:
            results = pool.run([TrialJob(1, spec, ""), TrialJob(2, spec, "draft-block-size{size=3}"),
                                TrialJob(3, spec, "no-such-pass")])
        finally:
            pool.close()
        assert [r.status for r in results] == [VALIDATED, VALIDATED, FAILED]
        assert results[1].tokens_checked > 0 and results[1].relative
    finally:
        if head.poll() is None:  # SIGTERM, then SIGKILL: `ray start --block` outlived 30 s of SIGTERM here
            os.killpg(head.pid, signal.SIGTERM)
            try:
                head.wait(timeout=5)
            except subprocess.TimeoutExpired:
                os.killpg(head.pid, signal.SIGKILL)
                head.wait(timeout=30)
        shutil.rmtree(short, ignore_errors=True)

"""`specpilot serve` as users meet it: a real server process on localhost, driven by the official
openai client (completions, chat, streaming, stop sequences, seeds, errors, concurrent clients), then
the queue limit, a client that leaves mid-stream, and a clean shutdown on SIGTERM."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from specpilot.compiler import compile_pipeline, load_engine
from specpilot.runtime.sampling import SamplingParams
from specpilot.spec import load_spec

from conftest import free_port, server_env

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "def add(a, b):"


def start_server(engine_dir: Path, *args: str, log: Path) -> tuple[subprocess.Popen, str]:
    """`specpilot serve ENGINE` in a fresh process; returns it and its base URL once /health answers."""
    port = free_port()
    env = server_env()
    proc = subprocess.Popen([sys.executable, "-m", "specpilot.cli", "serve", str(engine_dir), "--port", str(port),
                             "--threads", "1", "--device", "cpu", *args], cwd=ROOT, env=env,
                            stdout=log.open("w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"server exited with {proc.returncode}:\n{log.read_text()}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.2)
    proc.kill()
    raise AssertionError(f"server did not start:\n{log.read_text()}")


def wait_for_metric(url: str, name: str, value: float, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        lines = httpx.get(f"{url}/metrics").text.splitlines()
        if f"{name} {value}" in lines:
            return
        time.sleep(0.1)
    raise AssertionError(f"{name} never reached {value}")


def stop_server(proc: subprocess.Popen) -> int:
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise


@pytest.fixture(scope="module")
def engine_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("serve")
    spec = root / "pipeline.yaml"
    spec.write_text("name: zoo-pard\ntarget: code-qwen3\ndrafter:\n  kind: pard\ngpu: h200\nserving:\n"
                    "  max_new_tokens: 8\nbenchmark:\n  prompts: code-smoke\n  num_prompts: 1\n")
    compile_pipeline(load_spec(spec), out_dir=root / "engine", device="cpu")
    return root / "engine"


@pytest.fixture(scope="module")
def reference(engine_dir):
    """The engine in this process: what the server must answer, token for token."""
    loaded = load_engine(engine_dir, device="cpu")

    def output(prompt: str, n: int, sampling: SamplingParams = SamplingParams()) -> str:
        ids = loaded.tokenizer.encode(prompt).ids
        return loaded.tokenizer.decode(loaded.engine.generate(ids, n, sampling).tokens)

    return output


@pytest.fixture(scope="module")
def server(engine_dir, tmp_path_factory):
    proc, url = start_server(engine_dir, "--max-batch", "4", log=tmp_path_factory.mktemp("log") / "server.log")
    yield url
    assert stop_server(proc) == 0


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="none", max_retries=0, timeout=60)


def test_models_lists_the_engine(client):
    models = client.models.list().data
    assert [m.id for m in models] == ["zoo-pard"]


def test_greedy_completion_is_the_engines_output_with_usage(client, reference):
    r = client.completions.create(model="zoo-pard", prompt=PROMPT, max_tokens=24, temperature=0)
    assert r.choices[0].text == reference(PROMPT, 24)
    assert r.choices[0].finish_reason == "length"
    assert (r.usage.completion_tokens, r.usage.total_tokens) == (24, 24 + r.usage.prompt_tokens)


def test_streamed_chunks_add_up_to_the_completion(client, reference):
    chunks = list(client.completions.create(model="zoo-pard", prompt=PROMPT, max_tokens=24, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == reference(PROMPT, 24)
    assert len([c for c in chunks if c.choices]) > 2  # streamed in pieces, not one block
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 24


def test_chat_uses_the_template_and_streams(client, reference):
    messages = [{"role": "user", "content": "write add"}]
    r = client.chat.completions.create(model="zoo-pard", messages=messages, max_tokens=16, temperature=0)
    expected = reference("user: write add\nassistant:", 16)  # the plain template (the zoo has none)
    assert r.choices[0].message.content == expected and r.choices[0].message.role == "assistant"
    stream = client.chat.completions.create(model="zoo-pard", messages=messages, max_tokens=16, temperature=0,
                                            stream=True)
    parts = [c.choices[0].delta.content or "" for c in stream]
    assert "".join(parts) == expected


@pytest.mark.parametrize("stream", [False, True])
def test_stop_sequence_cuts_the_text_before_it(client, reference, stream):
    full = reference(PROMPT, 24)
    stop = full[10:14]
    expected = full[:full.find(stop)]
    r = client.completions.create(model="zoo-pard", prompt=PROMPT, max_tokens=24, temperature=0, stop=[stop],
                                  stream=stream)
    if stream:
        chunks = list(r)
        text, reason = "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason
    else:
        text, reason = r.choices[0].text, r.choices[0].finish_reason
    assert (text, reason) == (expected, "stop")


def test_sampling_is_the_engines_lossless_speculative_sampling_for_the_seed(client, reference):
    def sample(seed):
        return client.completions.create(model="zoo-pard", prompt=PROMPT, max_tokens=12, temperature=1.0,
                                         top_p=0.9, seed=seed).choices[0].text

    assert sample(7) == sample(7) == reference(PROMPT, 12, SamplingParams(1.0, 0.9, seed=7))
    assert len({sample(s) for s in (1, 2, 3)}) > 1


@pytest.mark.parametrize("kwargs, param, code", [
    (dict(model="gpt-4"), "model", "model_not_found"),
    (dict(max_tokens=-1), "max_tokens", "invalid_value"),
    (dict(prompt="x " * 1100), "prompt", "context_length_exceeded"),
    (dict(temperature=3.0), "temperature", "invalid_value"),
])
def test_bad_requests_get_openai_shaped_400s(client, kwargs, param, code):
    args = dict(model="zoo-pard", prompt=PROMPT, max_tokens=4) | kwargs
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(**args)
    assert e.value.status_code == 400
    assert (e.value.body["param"], e.value.body["code"]) == (param, code)
    assert e.value.body["type"] == "invalid_request_error" and e.value.body["message"]


def test_malformed_json_is_a_400(server):
    r = httpx.post(f"{server}/v1/completions", content=b'{"model": "zoo-pard", "prompt": ',
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"


def test_concurrent_clients_each_get_their_own_output(client, reference):
    prompts = [PROMPT, "import os\n", "class Stack:", "def fib(n):", "for i in range(", "x = [", "# sort"]

    def ask(prompt):
        return client.completions.create(model="zoo-pard", prompt=prompt, max_tokens=16, temperature=0).choices[0].text

    with ThreadPoolExecutor(len(prompts)) as pool:
        got = list(pool.map(ask, prompts))
    assert got == [reference(p, 16) for p in prompts]


def test_metrics_count_requests_and_tokens(client, server):
    client.completions.create(model="zoo-pard", prompt=PROMPT, max_tokens=5, temperature=0)
    text = httpx.get(f"{server}/metrics").text
    values = {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines()
              if line and not line.startswith("#")}
    assert values['specpilot_http_requests_total{endpoint="/v1/completions",status="200"}'] >= 1
    assert values["specpilot_generation_tokens_total"] >= 5
    assert "specpilot_time_to_first_token_seconds_bucket" in text


@pytest.mark.slow
def test_full_queue_disconnect_and_shutdown(engine_dir, tmp_path):
    """One slot, one queue place: a third request is refused with 429; a client that leaves mid-stream,
    or gives up on a non-streamed request, frees its slot (the next request is served); SIGTERM lets a
    running stream finish, then exits 0."""
    proc, url = start_server(engine_dir, "--max-batch", "1", "--max-queue", "1", log=tmp_path / "server.log")
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)
        long = dict(model="zoo-pard", prompt=PROMPT, max_tokens=900, temperature=0)
        running = client.completions.create(**long, stream=True)
        next(iter(running))  # admitted and streaming
        with ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(client.completions.create, **(long | dict(max_tokens=4)))
            wait_for_metric(url, "specpilot_requests_waiting", 1.0)
            with pytest.raises(openai.RateLimitError) as e:
                client.completions.create(**long)
            assert e.value.status_code == 429 and e.value.body["code"] == "queue_full"
            running.close()  # the client leaves: its slot goes to the waiting request
            assert waiting.result(timeout=60).choices[0].finish_reason == "length"
        with pytest.raises(httpx.ReadTimeout):  # a non-streamed request whose client gives up
            httpx.post(f"{url}/v1/completions", json=long, timeout=2)
        assert client.completions.create(**(long | dict(max_tokens=4))).choices[0].finish_reason == "length"
        metrics = httpx.get(f"{url}/metrics").text
        assert 'specpilot_requests_finished_total{reason="abort"} 2.0' in metrics

        with httpx.stream("POST", f"{url}/v1/completions", json=long | dict(max_tokens=40, stream=True)) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
            proc.send_signal(signal.SIGTERM)
            rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]"
        assert json.loads(rest[-2][6:])["choices"][0]["finish_reason"] == "length"
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()

"""A bounded load test of `specpilot serve`: many concurrent streaming clients against a real server process.

    python -m bench.e2e.serve_load [--engine DIR] [--concurrency 64] [--requests 128] [--max-tokens 32]
                                   [--max-batch 16] [--sampled 0.5] [--budget-s 300] [--device auto]
                                   [--out FILE|DIR] [--tag TAG]

Compiles the zoo's PARD pair into an engine (or serves --engine), starts `specpilot serve` in a
fresh process, and opens `--concurrency` streams at once through the official openai client (asyncio),
`--requests` in all, each prompt one of `code-smoke`'s: greedy, or a `--sampled` share of them at
temperature 0.9, top_p 0.95 and seed i (request i). A request counts as complete when its streamed
text equals the engine's own output for its prompt (greedy, or its seed's speculative sampling;
computed in this process: no token missing, none duplicated, none from another request) and its
usage says `--max-tokens` tokens or it stopped at EOS; the server's generation-token counter must equal the sum of the usages (no
token generated twice). Requests not started before `--budget-s` are left out and counted.
Writes bench/results/serve_load_<gpu|cpu>[_<tag>].json through the harness: throughput (output
tokens/s over the run's wall time), requests/s, p50/p99 of latency and time to first token.
With --batching (the default) every request, greedy or sampled, runs in the server's batched engine
(runtime/batch.py); --no-batching steps them one after another (serve/batch1.py).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch

from specpilot.bench import harness
from specpilot.bench.prompts import load_prompts
from specpilot.compiler import compile_pipeline, load_engine
from specpilot.runtime.sampling import SamplingParams
from specpilot.spec import parse_spec


def percentile(values: list[float], q: float) -> float:
    """The q-quantile (0..1) by linear interpolation between order statistics."""
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=1000, method="inclusive")[max(0, min(998, round(q * 1000) - 1))]


def build_engine_dir(out: Path, device: str) -> Path:
    spec = parse_spec({"name": "zoo-pard", "target": "code-qwen3", "drafter": {"kind": "pard"},
                       "serving": {"max_new_tokens": 8}, "benchmark": {"prompts": "code-smoke", "num_prompts": 1}},
                      "bench.e2e.serve_load")
    compile_pipeline(spec, out_dir=out, device=device)
    return out


def start_server(engine: Path, port: int, args, log: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "specpilot.cli", "serve", str(engine), "--port", str(port), "--device", args.device,
           "--max-batch", str(args.max_batch), "--max-queue", str(args.requests), "--log-level", "warning"]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    if not args.batching:
        cmd += ["--no-batching"]
    path = os.pathsep.join(filter(None, [str(harness.ROOT), os.environ.get("PYTHONPATH")]))  # ours first, kept the rest
    env = {**os.environ, "PYTHONPATH": path}
    proc = subprocess.Popen(cmd, cwd=harness.ROOT, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}:\n{log.read_text()}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            time.sleep(0.25)
    proc.kill()
    raise RuntimeError(f"the server did not start in 120 s:\n{log.read_text()}")


SAMPLED = SamplingParams(temperature=0.9, top_p=0.95)  # a sampled request's; its seed is its index


def sampled_requests(requests: int, share: float) -> set[int]:
    """The indices of the requests sent sampled: `share` of them, spread evenly."""
    return {i for i in range(requests) if int((i + 1) * share) > int(i * share)}


async def one_request(client, model: str, prompt: str, max_tokens: int, seed: int | None) -> dict:
    t0 = time.perf_counter()
    ttft, parts, usage, reason = None, [], None, None
    sampling = dict(temperature=0) if seed is None else dict(temperature=SAMPLED.temperature, top_p=SAMPLED.top_p,
                                                            seed=seed)
    stream = await client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, stream=True,
                                             stream_options={"include_usage": True}, **sampling)
    async for chunk in stream:
        if chunk.choices:
            if ttft is None and chunk.choices[0].text:
                ttft = time.perf_counter() - t0
            parts.append(chunk.choices[0].text)
            reason = chunk.choices[0].finish_reason or reason
        if chunk.usage:
            usage = chunk.usage
    return {"prompt": prompt, "seed": seed, "text": "".join(parts), "finish_reason": reason, "ttft_s": ttft,
            "latency_s": time.perf_counter() - t0, "completion_tokens": usage.completion_tokens if usage else None}


async def run_load(url: str, model: str, prompts: list[str], args) -> tuple[list[dict], int, float]:
    import openai

    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=args.budget_s)
    gate = asyncio.Semaphore(args.concurrency)
    start = time.perf_counter()
    skipped = 0
    sampled = sampled_requests(args.requests, args.sampled)

    async def worker(i: int):
        nonlocal skipped
        async with gate:
            if time.perf_counter() - start > args.budget_s:
                skipped += 1
                return None
            return await one_request(client, model, prompts[i % len(prompts)], args.max_tokens,
                                     i if i in sampled else None)

    results = await asyncio.gather(*(worker(i) for i in range(args.requests)), return_exceptions=True)
    wall = time.perf_counter() - start
    rows = []
    for r in results:
        if isinstance(r, BaseException):
            rows.append({"error": f"{type(r).__name__}: {r}"})
        elif r is not None:
            rows.append(r)
    return rows, skipped, wall


def engine_output(loaded, prompt: str, max_tokens: int, seed: int | None) -> str:
    """The engine's own text for a request: greedy, or sampled as SAMPLED with `seed`."""
    sampling = SamplingParams() if seed is None else SamplingParams(SAMPLED.temperature, SAMPLED.top_p, seed)
    ids = loaded.tokenizer.encode(prompt).ids
    return loaded.tokenizer.decode(loaded.engine.generate(ids, max_tokens, sampling).tokens)


def server_generated_tokens(url: str) -> float:
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith("specpilot_generation_tokens_total "):
            return float(line.split()[1])
    return float("nan")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", type=Path, help="an engine directory (default: compile the zoo's PARD pair)")
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--requests", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--max-batch", type=int, default=16)
    ap.add_argument("--sampled", type=float, default=0.0, help="the share of requests sent sampled (0..1)")
    ap.add_argument("--budget-s", type=float, default=300.0, help="no request starts after this many seconds")
    ap.add_argument("--threads", type=int, default=None, help="the server's torch threads (CPU)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--batching", action=argparse.BooleanOptionalAction, default=True,
                    help="requests in the server's batched engine (--no-batching: one after another)")
    harness.add_results_args(ap, smoke=False)
    args = ap.parse_args(argv)
    if not 0 <= args.sampled <= 1:
        ap.error(f"--sampled must be in [0, 1], got {args.sampled}")

    work = Path(tempfile.mkdtemp(prefix="serve_load."))
    engine_dir = args.engine or build_engine_dir(work / "engine", args.device)
    loaded = load_engine(engine_dir, device=args.device)
    model, device = loaded.manifest["name"], loaded.engine.device
    prompts = load_prompts("code-smoke", 8, source="bench.e2e.serve_load")
    asked = [(p, None) for p in prompts] + [(prompts[i % len(prompts)], i)
                                            for i in sampled_requests(args.requests, args.sampled)]
    expected = {(p, seed): engine_output(loaded, p, args.max_tokens, seed) for p, seed in asked}
    del loaded
    if device.type == "cuda":
        torch.cuda.empty_cache()

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = start_server(engine_dir, port, args, work / "server.log")
    url = f"http://127.0.0.1:{port}"
    try:
        rows, skipped, wall = asyncio.run(run_load(url, model, prompts, args))
        generated = server_generated_tokens(url)
    finally:
        proc.send_signal(signal.SIGTERM)
        exit_status = proc.wait(timeout=60)

    done = [r for r in rows if "error" not in r]
    for r in done:
        r["equal_to_engine"] = r["text"] == expected[r["prompt"], r["seed"]]
        r["complete"] = r["equal_to_engine"] and (r["completion_tokens"] == args.max_tokens
                                                  or r["finish_reason"] == "stop")
    tokens = sum(r["completion_tokens"] or 0 for r in done)
    latency = [r["latency_s"] for r in done]
    ttft = [r["ttft_s"] for r in done if r["ttft_s"] is not None]
    summary = {
        "engine": model, "requests_sent": len(rows), "requests_skipped_by_budget": skipped,
        "errors": len(rows) - len(done), "complete": sum(r["complete"] for r in done),
        "all_complete": bool(done) and all(r["complete"] for r in done) and len(done) == len(rows),
        "server_generated_tokens": generated, "client_tokens": tokens,
        "none_duplicated": generated == tokens and all(r["equal_to_engine"] for r in done),
        "wall_s": round(wall, 3), "output_tokens_per_s": round(tokens / wall, 2),
        "requests_per_s": round(len(done) / wall, 3),
        "latency_p50_s": round(percentile(latency, 0.5), 4) if latency else None,
        "latency_p99_s": round(percentile(latency, 0.99), 4) if latency else None,
        "ttft_p50_s": round(percentile(ttft, 0.5), 4) if ttft else None,
        "ttft_p99_s": round(percentile(ttft, 0.99), 4) if ttft else None,
        "server_exit_status": exit_status,
        "sampled_requests": sum(r.get("seed") is not None for r in done),
        "compute": "the batched engine (runtime/batch.py)" if args.batching else
                   "batch-1 loops stepped in turn (serve/batch1.py): not batched",
    }
    path = harness.write_results("serve_load", device, [{k: v for k, v in r.items() if k != "text"} for r in rows],
                                 args={k: str(v) for k, v in vars(args).items()}, out=args.out, tag=args.tag,
                                 **summary)
    print(f"{summary['complete']}/{len(rows)} complete, {summary['output_tokens_per_s']} tokens/s, "
          f"p50 {summary['latency_p50_s']} s, p99 {summary['latency_p99_s']} s -> {path}")
    return 0 if summary["all_complete"] and summary["none_duplicated"] and exit_status == 0 else 1


if __name__ == "__main__":
    sys.exit(main())

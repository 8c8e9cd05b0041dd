"""Batched serving measured: the batched engine against batched AR on the same runtime, per concurrency.

For a concurrency c, `c` requests are kept in flight (a finished one is replaced by the next prompt,
cycling through the prompts until `requests` have been served): continuous batching as a server
sees it under a steady load. Both runs use the same engine modules and attention (the batched AR
is `Engine.batched_ar`: the same runtime with no drafter), and the same prompts in the same order.

Per concurrency: decode tokens/s (the prefill forwards' time and the first token each commits left
out, as every speedup of the project is), output tokens/s over the whole run (prefill included: what
a server sees), mean and p90 per-request latency (admission to last token), steps, τ (tokens a request
commits per step it speculated, bonus included), and the speedup over batched AR in decode tokens/s
(beside it the whole run's). Every request's output is kept, so a caller can compare it with the
batch-1 outputs or force its tokens.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from specpilot.bench.harness import Measurement
from specpilot.runtime.engine_api import RequestParams


@dataclass
class BatchRun:
    concurrency: int
    seconds: float
    tokens: int
    steps: int
    latencies_s: list[float]
    outputs: dict[int, list[int]] = field(default_factory=dict)  # request index -> output
    tau: float = 1.0
    verify_rows: int = 0
    ar_steps: int = 0
    prefill_s: float = 0.0
    prefill_tokens: int = 0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens the decode steps committed per second of decoding (prefill's time and first tokens out)."""
        seconds = self.seconds - self.prefill_s
        return (self.tokens - self.prefill_tokens) / seconds if seconds > 0 else 0.0

    def summary(self) -> dict:
        lat = sorted(self.latencies_s)
        return {"concurrency": self.concurrency, "tokens_per_s": round(self.tokens_per_s, 2), "tokens": self.tokens,
                "decode_tokens_per_s": round(self.decode_tokens_per_s, 2), "seconds": round(self.seconds, 4),
                "prefill_s": round(self.prefill_s, 4), "steps": self.steps,
                "latency_mean_ms": round(1e3 * statistics.fmean(lat), 3) if lat else None,
                "latency_p90_ms": round(1e3 * lat[int(0.9 * (len(lat) - 1))], 3) if lat else None,
                "tau": round(self.tau, 4), "verify_rows_per_step": round(self.verify_rows / max(1, self.steps), 2),
                "ar_steps": self.ar_steps}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def serve(engine, prompts: Sequence[Sequence[int]], *, concurrency: int, requests: int, max_new_tokens: int,
          on_admit: Callable[[int, list[int]], None] | None = None) -> BatchRun:
    """Keep `concurrency` requests in flight until `requests` (prompts cycled) have finished."""
    device = engine.target.device
    params = RequestParams(max_new_tokens=max_new_tokens)
    started: dict[str, float] = {}
    latencies, outputs = [], {}
    next_i, steps, tokens = 0, 0, 0
    before = dataclasses.replace(engine.stats)  # this run's share of the engine's running sums
    sync(device)
    t0 = time.perf_counter()
    while next_i < requests or engine.active():
        while next_i < requests and len(engine.active()) < min(concurrency, engine.max_batch):
            prompt = list(prompts[next_i % len(prompts)])
            if on_admit is not None:
                on_admit(next_i, prompt)
            engine.admit(str(next_i), prompt, params)
            started[str(next_i)] = time.perf_counter()
            next_i += 1
        for toks in engine.step().values():
            tokens += len(toks)
        steps += 1
        for rid in engine.active():
            if engine.done(rid):
                sync(device)
                latencies.append(time.perf_counter() - started.pop(rid))
                outputs[int(rid)] = engine.output(rid)
                engine.release(rid)
    sync(device)
    seconds = time.perf_counter() - t0
    stats = engine.stats
    run = BatchRun(concurrency, seconds, tokens, steps, latencies, outputs, verify_rows=stats.verify_rows - before.verify_rows,
                   ar_steps=stats.ar_steps - before.ar_steps, prefill_s=stats.prefill_s - before.prefill_s,
                   prefill_tokens=stats.prefill_tokens - before.prefill_tokens)
    return run


def measure_concurrency(engine_for: Callable[[int], object], ar_for: Callable[[int], object],
                        prompts: Sequence[Sequence[int]], concurrency: int, *, max_new_tokens: int,
                        requests: int | None = None, on_admit=None, ar: BatchRun | None = None,
                        settle: Callable[[dict[int, list[int]]], None] | None = None) -> dict:
    """Batched speculative and batched AR at one concurrency: (summary row, spec outputs, AR outputs).
    Each engine first serves `concurrency` requests of a few tokens (kernels compiled, graphs of the
    shapes a load reaches captured), unmeasured. `ar`: a batched AR run of the same load, reused.
    `settle` (replay plans): the speculative engine first serves the whole load unmeasured and
    `settle` gets its outputs (what this load's verifies chose at bf16 near-ties) before the timed run."""
    requests = requests or max(2 * concurrency, len(prompts))
    warm = dict(concurrency=concurrency, requests=concurrency, max_new_tokens=min(16, max_new_tokens))
    if ar is None:
        ar_engine = ar_for(concurrency)
        serve(ar_engine, prompts, **warm)
        ar = serve(ar_engine, prompts, concurrency=concurrency, requests=requests, max_new_tokens=max_new_tokens)
    spec_engine = engine_for(concurrency)
    serve(spec_engine, prompts, **warm, on_admit=on_admit)
    if settle is not None:
        settle(serve(spec_engine, prompts, concurrency=concurrency, requests=requests, max_new_tokens=max_new_tokens,
                     on_admit=on_admit).outputs)
    spec_engine.stats = type(spec_engine.stats)()
    sp = serve(spec_engine, prompts, concurrency=concurrency, requests=requests, max_new_tokens=max_new_tokens,
               on_admit=on_admit)
    s = spec_engine.stats
    sp.tau = s.tau
    row = {"concurrency": concurrency, "requests": requests, "ar": ar.summary(), "spec": sp.summary(),
           "speedup_over_batched_ar": round(sp.decode_tokens_per_s / ar.decode_tokens_per_s, 4)
           if ar.decode_tokens_per_s else None,
           "speedup_served_prefill_included": round(sp.tokens_per_s / ar.tokens_per_s, 4) if ar.tokens_per_s else None,
           "outputs_equal_batched_ar": sum(sp.outputs[i] == ar.outputs.get(i) for i in sp.outputs)}
    drafting = getattr(spec_engine, "graphed_draft", None)
    if drafting is not None:  # forwards counted since the engine was made ("eager": past the largest bucket)
        row["graphs"] = {"verify_shapes": len(spec_engine.graphed.steps), "draft_shapes": len(drafting.steps),
                         "draft_forwards": dict(drafting.replays), "verify_forwards": dict(spec_engine.graphed.replays)}
    return {"row": row, "spec_outputs": sp.outputs, "ar_outputs": ar.outputs, "ar_run": ar}


def step_rows(engine) -> int:
    """Rows one step of `engine`'s program verifies a request at most: its block, or its tree's nodes."""
    propose = engine.program.step.one("propose")[1]
    return max(engine.block_size, propose["budget"] + 1 if propose["shape"] == "tree" else 0)


def measure_batches(engine, prompts: Sequence[Sequence[int]], guesses: Sequence[Sequence[int]],
                    sizes: Sequence[int], max_new_tokens: int, *, requests: int | None = None,
                    graphs: bool = False, ar_runs: dict | None = None) -> dict:
    """Every concurrency of `sizes`: the compiled engine batched (Engine.batched) against batched
    AR. `guesses`: each prompt's batch-1 output (a replay engine's plans follow them). Returns the
    rows and every request's output with its prompt (for token forcing). `ar_runs` (concurrency ->
    batched AR run) is filled and reused: variants of one engine share their baseline."""
    ar_runs = {} if ar_runs is None else ar_runs
    from specpilot.runtime.batch_replay import BatchReplay

    capacity = max(map(len, prompts)) + max_new_tokens + step_rows(engine) + 2
    rows, forced_prompts, forced_outputs = [], [], []
    for c in sizes:
        hook = None
        if engine.replay is not None:
            hook = BatchReplay(engine.replay.distribution, slots=c + 1, size=capacity + engine.block_size + 1,
                               device=engine.device, seed=engine.replay.seed)
            for p, g in zip(prompts, guesses):
                hook.suggest(p, g)
        n = requests or max(2 * c, len(prompts))

        def settle(outputs: dict[int, list[int]], hook=hook) -> None:  # a prompt's plan follows its last run
            for i, out in sorted(outputs.items()):
                hook.suggest(prompts[i % len(prompts)], out)
        made = {}
        got = measure_concurrency(lambda m: made.setdefault(m, engine.batched(max_batch=m, capacity=capacity,
                                                                              draft_hook=hook, graphs=graphs)),
                                  lambda m: engine.batched_ar(max_batch=m, capacity=capacity, graphs=graphs),
                                  prompts, c, max_new_tokens=max_new_tokens, requests=n, ar=ar_runs.get(c),
                                  settle=settle if hook is not None else None)
        ar_runs[c] = got["ar_run"]
        row = got["row"]
        cost = made[c].policy.cost
        if cost is not None:  # the step-cost table the engine profiled for its mechanisms
            row["measured_verify_ms"] = {t: round(ms, 4) for t, ms in cost.verify_ms}
        row["outputs_equal_batch1"] = sum(out == list(guesses[i % len(prompts)]) for i, out in got["spec_outputs"].items())
        rows.append(row)
        for i, out in sorted(got["spec_outputs"].items())[: len(prompts)]:
            forced_prompts.append(list(prompts[i % len(prompts)]))
            forced_outputs.append(out)
    return {"rows": rows, "prompts": forced_prompts, "outputs": forced_outputs,
            "note": "tokens/s over each run (prefill included), latency from admission to the last token; AR = the "
                    "same batched runtime with no drafter; outputs of the first requests at each concurrency are "
                    "token-forced with the batch-1 outputs"}


def measure_served(engine, baseline, prompts: Sequence[Sequence[int]], concurrency: int, max_new_tokens: int,
                   requests: int | None = None) -> Measurement:
    """A search trial at batch: `engine` batched (its schedule's mechanisms) against the stock
    `baseline`'s batched AR, `concurrency` requests in flight (measure_concurrency), as a Measurement:
    every request's prompt and output (for token forcing), each run's decode time (its prefill
    forwards left out, as every speedup of the project is: `decode_tokens_per_s`), so its ms/token
    figures are 1000 / decode tokens per second of each run, and the engine's τ."""
    capacity = max(map(len, prompts)) + max_new_tokens + step_rows(engine) + 2
    got = measure_concurrency(lambda m: engine.batched(max_batch=m, capacity=capacity),
                              lambda m: baseline.batched_ar(max_batch=m, capacity=capacity), prompts, concurrency,
                              max_new_tokens=max_new_tokens, requests=requests)
    order = sorted(got["spec_outputs"])
    row = got["row"]
    m = Measurement(prompts=[list(prompts[i % len(prompts)]) for i in order],
                    ar_tokens=[list(got["ar_outputs"].get(i, [])) for i in order],
                    spec_tokens=[list(got["spec_outputs"][i]) for i in order], served_tau=row["spec"]["tau"])
    for side, tokens in (("ar", m.ar_tokens), ("spec", m.spec_tokens)):
        rate = row[side]["decode_tokens_per_s"]
        setattr(m, f"{side}_decode_s", sum(map(len, tokens)) / rate if rate else 0.0)
    return m

"""Where candidates are built and measured.

- `InlinePool`: in this process, one candidate after another (one worker on a CPU, and tests).
- `ProcessPool`: N worker processes (spawned), each pinned to a device index: worker i runs on
  `devices[i % len(devices)]`, so on a host of several GPUs each worker has one GPU, and on one GPU
  or a CPU they share it. A worker that dies mid-trial (killed, out of memory) fails that trial
  and the others go on.
- `InterleavedPool`: all candidates of a round in one process on one GPU (or a CPU with one
  worker), timed round-robin and repeated (`specpilot.compiler.run_trials_interleaved`, as
  bench/steps/step_ab does), so that a drift of the card's clocks or of a shared CPU's load lands
  on every candidate alike rather than picking the winner; each trial carries its per-repeat
  engine/AR (`extra["rounds_relative"]`) for the search's confidence rule.
- `RayPool`: `--workers ray://ADDRESS`: each candidate a Ray task on the cluster.

The work itself (`evaluate`: TrialJob -> TrialResult) is handed in by the caller above the agent.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from ..errors import SpecError
from .trial import TrialJob, TrialResult

PACKAGE = Path(__file__).resolve().parents[1]  # the specpilot package a Ray job ships to its workers
Evaluate = Callable[[TrialJob], TrialResult]
EvaluateMany = Callable[[list[TrialJob]], list[TrialResult]]
OnResult = Callable[[TrialResult], None]


class InlinePool:
    def __init__(self, evaluate: Evaluate, device: str = "cpu"):
        self.evaluate, self.device = evaluate, device
        self.size = 1

    def run(self, jobs: Sequence[TrialJob], on_result: OnResult | None = None) -> list[TrialResult]:
        out = []
        for job in jobs:
            r = self.evaluate(replace(job, device=self.device))
            out.append(r)
            if on_result:
                on_result(r)
        return out

    def close(self) -> None:
        pass


def _worker_main(index: int, device: str, threads: int, evaluate: Evaluate, jobs, results) -> None:
    import torch

    torch.set_num_threads(threads)
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    while True:
        job = jobs.get()
        if job is None:
            return
        results.put(("start", index, job.trial))
        try:
            r = evaluate(replace(job, device=device))
        except Exception as e:  # the evaluate function reports faults as FAILED; this is a last resort
            r = TrialResult.failed(job, f"worker {index}: {type(e).__name__}: {e}")
        r.extra["worker"] = index
        results.put(("done", index, r))


class ProcessPool:
    """N spawned worker processes; worker i pinned to devices[i % len(devices)]."""

    def __init__(self, evaluate: Evaluate, n: int, devices: Sequence[str] = ("cpu",)):
        ctx = mp.get_context("spawn")
        self.size, self.devices = n, list(devices)
        self.jobs, self.results = ctx.Queue(), ctx.Queue()
        share = max(1, (os.cpu_count() or 1) // n) if all(d == "cpu" for d in self.devices) else 1
        self.procs = [ctx.Process(target=_worker_main, args=(i, self.devices[i % len(self.devices)], share, evaluate,
                                                              self.jobs, self.results), daemon=True)
                      for i in range(n)]
        for p in self.procs:
            p.start()

    def device_of(self, worker: int) -> str:
        return self.devices[worker % len(self.devices)]

    def run(self, jobs: Sequence[TrialJob], on_result: OnResult | None = None) -> list[TrialResult]:
        by_trial = {j.trial: j for j in jobs}
        for j in jobs:
            self.jobs.put(j)
        running: dict[int, int] = {}  # worker -> trial
        done: dict[int, TrialResult] = {}
        while len(done) < len(jobs):
            try:
                kind, worker, payload = self.results.get(timeout=0.5)
            except queue.Empty:
                for w, trial in list(running.items()):
                    if not self.procs[w].is_alive():
                        r = TrialResult.failed(by_trial[trial], f"worker {w} died (exit code {self.procs[w].exitcode})")
                        done[trial] = r
                        del running[w]
                        if on_result:
                            on_result(r)
                if not any(p.is_alive() for p in self.procs) and len(done) < len(jobs):
                    for trial, job in by_trial.items():
                        if trial not in done:
                            done[trial] = TrialResult.failed(job, "no worker left alive")
                continue
            if kind == "start":
                running[worker] = payload
            else:
                running.pop(worker, None)
                done[payload.trial] = payload
                if on_result:
                    on_result(payload)
        return [done[j.trial] for j in jobs]

    def close(self) -> None:
        for _ in self.procs:
            self.jobs.put(None)
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.terminate()


class InterleavedPool:
    """One process, one device: a round's candidates built together and timed round-robin."""

    def __init__(self, evaluate_many: EvaluateMany, device: str):
        self.evaluate_many, self.device = evaluate_many, device
        self.size = 1

    def run(self, jobs: Sequence[TrialJob], on_result: OnResult | None = None) -> list[TrialResult]:
        out = self.evaluate_many([replace(j, device=self.device) for j in jobs])
        for r in out:
            if on_result:
                on_result(r)
        return out

    def close(self) -> None:
        pass


class RayPool:
    """Candidates as Ray tasks on the cluster at `address` (ray://HOST:PORT, or "auto")."""

    def __init__(self, evaluate: Evaluate, address: str, device: str = "cpu"):
        try:
            import ray
        except ImportError:
            raise SpecError(f"--workers {address}: Ray is not installed (pip install 'ray[client]')") from None
        self.ray = ray
        # the cluster runs this checkout's specpilot, shipped with the job (a cluster's own install may differ)
        ray.init(address=address, ignore_reinit_error=True, log_to_driver=False,
                 runtime_env={"py_modules": [str(PACKAGE)], "excludes": ["__pycache__"]})
        self.task = ray.remote(num_gpus=1 if device.startswith("cuda") else 0)(evaluate)
        self.device = device
        self.size = max(1, int(ray.cluster_resources().get("CPU", 1)))

    def run(self, jobs: Sequence[TrialJob], on_result: OnResult | None = None) -> list[TrialResult]:
        ray = self.ray
        pending = {self.task.remote(replace(j, device=self.device)): j for j in jobs}
        done: dict[int, TrialResult] = {}
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1)
            job = pending.pop(ready[0])
            try:
                r = ray.get(ready[0])
            except Exception as e:  # a task that died on the cluster fails its trial only
                r = TrialResult.failed(job, f"ray task: {type(e).__name__}: {str(e)[:300]}")
            done[job.trial] = r
            if on_result:
                on_result(r)
        return [done[j.trial] for j in jobs]

    def close(self) -> None:
        self.ray.shutdown()


@dataclass(frozen=True)
class WorkersSpec:
    """What --workers says: a count ("4"), "auto" (one a GPU, else one), or a Ray address."""

    count: int = 1
    ray: str | None = None

    @staticmethod
    def parse(text: str) -> "WorkersSpec":
        text = text.strip()
        if text.startswith("ray://") or text == "ray:auto":
            return WorkersSpec(ray="auto" if text == "ray:auto" else text)
        if text == "auto":
            return WorkersSpec(0)
        if text.isdigit() and int(text) >= 1:
            return WorkersSpec(int(text))
        raise SpecError(f"--workers: expected a number of workers (1, 2, ...), 'auto', or ray://HOST:PORT; got {text!r}")


def make_pool(spec: WorkersSpec, evaluate: Evaluate, evaluate_many: EvaluateMany | None, device: str):
    """The pool --workers asks for on `device` ("cpu", "cuda")."""
    if spec.ray:
        return RayPool(evaluate, spec.ray, device)
    if device.startswith("cuda"):
        import torch

        gpus = [f"cuda:{i}" for i in range(torch.cuda.device_count())] or [device]
        n = spec.count or len(gpus)
        if n == 1:
            return InterleavedPool(evaluate_many, gpus[0]) if evaluate_many is not None else InlinePool(evaluate, gpus[0])
        return ProcessPool(evaluate, n, gpus)
    n = spec.count or 1
    if n > 1:
        return ProcessPool(evaluate, n, [device])
    # one worker on a CPU: interleaved too (a shared machine's load drifts as a card's clocks do)
    return InterleavedPool(evaluate_many, device) if evaluate_many is not None else InlinePool(evaluate, device)

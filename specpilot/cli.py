"""The `specpilot` command line. Commands only parse arguments and print; the work is elsewhere."""

from __future__ import annotations

import functools
import sys
from contextlib import contextmanager
from pathlib import Path

import click
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from .errors import SpecError, SpecpilotError

console = Console()
err_console = Console(stderr=True)


def user_errors(fn):
    """Turn a SpecpilotError into one line on stderr and exit status 2 (no traceback)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except SpecpilotError as e:
            err_console.print(f"[bold red]error:[/] {e}", highlight=False, soft_wrap=True)
            sys.exit(2)

    return wrapper


@contextmanager
def progress_bar(label: str, total: int):
    with Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=err_console, transient=True) as bar:
        task = bar.add_task(label, total=total)
        yield lambda: bar.advance(task)


@click.group()
@click.version_option(package_name="specpilot")
def main():
    """specpilot: compile speculative-decoding deployments into validated engines."""


@main.command("compile")
@click.argument("pipeline", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--gpu", help="GPU name or alias from the database, e.g. h200, a100 (overrides the spec's `gpu`).")
@click.option("-o", "--output", type=click.Path(file_okay=False, path_type=Path), help="Engine directory to write.")
@click.option("--passes", "passes", help="Pass pipeline string (overrides the spec's `passes`).")
@click.option("--device", default="auto", show_default=True, help="cpu, cuda or auto.")
@user_errors
def compile_cmd(pipeline, gpu, output, passes, device):
    """Compile PIPELINE (a pipeline.yaml) into a validated engine directory.

    Plugins the pipeline names (its `plugins:` field, or an installed plugin's pass in the pass
    pipeline) are imported: they are trusted Python code you install on purpose. Rules files are
    data: nothing in them becomes Python."""
    from .compiler import compile_pipeline
    from .spec import load_spec

    spec = load_spec(pipeline).with_gpu(gpu)
    out = output or Path("engines") / spec.name
    with progress_bar("compiling: AR baseline + engine per prompt", spec.benchmark.num_prompts) as tick:
        result = compile_pipeline(spec, out_dir=out, passes=passes, device=device, progress=tick)
    _print_report(result.report, result.records)
    if not result.validation.passed:
        _print_failures(result.validation)
        err_console.print("[bold red]engine rejected:[/] token forcing found hard failures; nothing written")
        sys.exit(1)
    console.print(f"engine written to [bold]{result.out_dir}[/]")


def _print_report(report: dict, records) -> None:
    table = Table(title=f"specpilot compile: {report['name']}", show_header=False)
    table.add_column(style="bold")
    table.add_column()
    for r in records:
        table.add_row(f"pass {r.spec}", ("changed" if r.changed else "no change") + (f": {r.summary}" if r.summary else ""))
    table.add_row("IR hash", report["ir_hash"])
    table.add_row("drafter", f"{report['drafter']['kind']}, block {report['drafter']['block_size']}")
    table.add_row("τ (incl. bonus)", f"{report['tau']:.3f}")
    table.add_row("acceptance histogram", str(report["acceptance_histogram"]))
    table.add_row("AR ms/token", f"{report['ar_ms_per_token']:.2f}")
    table.add_row("engine ms/token", f"{report['engine_ms_per_token']:.2f}")
    table.add_row("speedup over AR (measured here)", f"{report['speedup_over_ar']:.2f}×")
    table.add_row("outputs equal to AR greedy", report["outputs_equal_ar"])
    table.add_row("token forcing", report["token_forcing"])
    table.add_row("device", report["environment"]["device"])
    console.print(table)


def _print_failures(validation) -> None:
    for p in validation.prompts:
        for m in p.hard_failures[:3]:
            err_console.print(f"  prompt {p.prompt} token {m.position}: engine {m.candidate}, reference {m.reference}, "
                              f"margin {m.margin:.4g} > tolerance {m.tolerance:.3g}")


@main.command("explain")
@click.argument("pipeline", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--gpu", help="GPU name or alias from the database, e.g. h200, a100 (overrides the spec's `gpu`), "
              "or cpu: this host's CPU, its figures measured here once and cached.")
@click.option("--passes", "passes", help="Pass pipeline string (overrides the spec's `passes`).")
@click.option("--tau", type=float, help="Acceptance length (incl. bonus) to assume; default: measured records.")
@click.option("--results", "results", multiple=True, type=click.Path(path_type=Path),
              help="Results files or folders to calibrate with (default: the files gpus.yaml lists for the GPU).")
@click.option("--png", type=click.Path(dir_okay=False, path_type=Path), help="Write the roofline/gap chart here.")
@click.option("--ir", is_flag=True, help="Print the IR the passes produced (what the cost model prices) instead.")
@user_errors
def explain_cmd(pipeline, gpu, passes, tau, results, png, ir):
    """Where PIPELINE's step time goes on a GPU (or this host's CPU), per the roofline cost model, and the
    ranked gaps."""
    from .compiler import explain_pipeline, explained_program
    from .spec import load_spec

    on_cpu = (gpu or "").strip().lower() == "cpu"
    spec = load_spec(pipeline) if on_cpu else load_spec(pipeline).with_gpu(gpu)
    if ir:
        from .ir import print_program

        click.echo(print_program(explained_program(spec, passes, on_cpu=on_cpu)), nl=False)
        return
    estimate = explain_pipeline(spec, passes=passes, tau=tau, results=results or None, on_cpu=on_cpu)
    from .cost import plot_gaps, render_table

    console.print(render_table(estimate))
    if png:
        console.print(f"chart written to {plot_gaps(estimate, png)}")


@main.command("passes")
@click.option("--no-plugins", is_flag=True, help="List only what is registered without importing any installed plugin.")
def passes_cmd(no_plugins):
    """List the passes (built-in, from installed plugins) with where each came from, its parameters,
    contract and how a search meets it (a what-if the cost model predicts, or measured); then the
    plugins' weight formats and kernels.

    Installed plugins are imported to list them: plugins are trusted Python code that you install
    on purpose. A broken plugin is listed with its error; the others still load. Rules files and
    the search agent's proposals are data and never become Python."""
    from .passes import REGISTRY
    from .passes.plugins import KERNELS_GROUP, PASSES, load_installed, origin_of

    installed = [] if no_plugins else load_installed()
    table = Table(title="passes")
    table.add_column("name", no_wrap=True)
    for col in ("from", "parameters", "contract", "search", "what it does"):
        table.add_column(col, overflow="fold")
    for name, cls in sorted(REGISTRY.items()):
        params = ", ".join(f"{f.name.replace('_', '-')}: {f.type} = {f.default!r}" for f in cls.params()) or "-"
        table.add_row(name, str(origin_of(cls)), params, "lossless" if cls.lossless else "lossy", _cost_view(cls),
                      _first_line(cls))
    console.print(table)
    others = [i for i in installed if i.group != PASSES and not i.error]
    if others:
        table = Table(title="weight formats and kernels from plugins")
        for col in ("kind", "name", "from"):
            table.add_column(col)
        for i in others:
            table.add_row("kernel" if i.group == KERNELS_GROUP else "weight format", i.name, str(i.origin))
        console.print(table)
    for i in installed:
        if i.error:
            err_console.print(f"[bold red]broken plugin:[/] {i.error}", highlight=False, soft_wrap=True)


def _cost_view(cls) -> str:
    """How a search meets a pass: as a what-if the cost model predicts (the gap it closes), or by
    measuring it (no `closes`: the cost model offers no prediction); lossy passes never."""
    if not cls.lossless:
        return "never (lossy)"
    if not cls.closes:
        return "measured: the cost model offers no what-if"
    return f"predicted: closes {cls.closes}"


@main.command("tune")
@click.argument("pipeline", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--gpu", help="GPU name or alias the cost model prices for (overrides the spec's `gpu`); with "
              "--device cpu it prices this host's CPU instead, measured once and cached per host.")
@click.option("--rounds", type=click.IntRange(0), default=3, show_default=True, help="Search rounds at most.")
@click.option("--candidates", type=click.IntRange(1), default=4, show_default=True, help="Candidates measured a round.")
@click.option("--workers", default="1", show_default=True,
              help="Worker processes (N), 'auto' (one a GPU), or ray://HOST:PORT for a Ray cluster.")
@click.option("--memory", "memory", type=click.Path(dir_okay=False, path_type=Path),
              help="SQLite memory store of trials (created if missing); seeds the search from similar deployments.")
@click.option("--proposer", help="Base URL of an OpenAI-compatible endpoint to ask for candidates (e.g. http://127.0.0.1:8000/v1).")
@click.option("--proposer-model", default="specpilot-proposer", show_default=True, help="Model name sent to --proposer.")
@click.option("--min-gain", type=float, default=0.02, show_default=True, help="Stop when a round gains less than this share.")
@click.option("--repeats", type=click.IntRange(1), default=3, show_default=True,
              help="One worker: times each candidate and the round's control are timed round-robin; a candidate "
                   "wins when its paired ratio to the control is at most 1 - min-gain and its 90%% upper bound "
                   "is below 1.")
@click.option("--device", default="auto", show_default=True, help="cpu, cuda or auto.")
@click.option("-o", "--output", type=click.Path(file_okay=False, path_type=Path), required=True,
              help="Directory for the best engine (DIR/engine) and the search report (DIR/report.html).")
@user_errors
def tune_cmd(pipeline, gpu, rounds, candidates, workers, memory, proposer, proposer_model, min_gain, repeats, device,
             output):
    """Search pass pipelines for PIPELINE: the cost model ranks gaps and prunes, workers measure,
    token forcing gates every candidate; writes the best validated engine and a search report.
    Ctrl-C stops with the best engine so far. Proposals (an LLM's included) are data: parsed by the
    DSL and checked by the IR verifier, never run as Python."""
    from .agent.llm import LLMConfig
    from .agent.search import TuneConfig
    from .bench.harness import git_commit
    from .compiler import tune_pipeline
    from .spec import load_spec

    spec = load_spec(pipeline).with_gpu(gpu)
    llm = LLMConfig(proposer, proposer_model) if proposer else None
    config = TuneConfig(rounds=rounds, candidates=candidates, min_gain=min_gain, llm=llm, repeats=repeats,
                        commit=git_commit())
    with Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=err_console, transient=True) as bar:
        task = bar.add_task("tuning: trials measured", total=1 + rounds * (candidates + 1))
        result = tune_pipeline(spec, out_dir=output, config=config, workers=workers, memory=memory, device=device,
                               progress=lambda r: bar.advance(task))
    s = result.search
    console.print(f"start  [bold]{s.start or '(empty)'}[/]: {s.start_relative or float('nan'):.3f} of AR (measured)")
    console.print(f"chosen [bold]{s.best or '(empty)'}[/]: {s.best_relative or float('nan'):.3f} of AR (measured); "
                  f"{sum(r.status == 'validated' for r in s.trials)} validated, "
                  f"{sum(r.status == 'rejected' for r in s.trials)} rejected, "
                  f"{sum(r.status == 'failed' for r in s.trials)} failed; stopped: {s.stopped}")
    if result.engine is not None and result.engine.out_dir:
        console.print(f"engine written to [bold]{result.engine.out_dir}[/]; report: {result.report}")
    else:
        err_console.print(f"[bold red]no engine written:[/] the chosen pipeline failed token forcing when compiled; "
                          f"report: {result.report}")
        sys.exit(1)


@main.command("memory")
@click.argument("store", type=click.Path(dir_okay=False, exists=True, path_type=Path))
@click.option("--trials", is_flag=True, help="List every trial rather than a summary per deployment.")
@user_errors
def memory_cmd(store, trials):
    """List what the search memory STORE holds: per deployment fingerprint, its trials and mechanisms."""
    from .agent.memory import Memory

    mem = Memory(store)
    if trials:
        table = Table(title=f"trials in {store}")
        for col in ("id", "run", "round", "pipeline", "proposer", "status", "engine/AR", "τ", "reason"):
            table.add_column(col, overflow="fold")
        for r in mem.trials():
            table.add_row(str(r["id"]), r["run"], str(r["round"]), r["pipeline"] or "(empty)", r["proposer"], r["status"]
                          + (" *" if r["improved"] else ""), f"{r['relative']:.3f}" if r["relative"] else "",
                          f"{r['tau']:.2f}" if r["tau"] else "", (r["reason"] or "")[:120])
        console.print(table)
        return
    table = Table(title=f"search memory {store} (* mechanism: improved speed, token forcing passed)")
    for col in ("deployment", "runs", "trials", "validated", "rejected", "failed", "mechanisms", "best pipeline", "engine/AR"):
        table.add_column(col, overflow="fold")
    for s in mem.summary():
        fp = s["fingerprint"]
        table.add_row(f"{fp['target_shape']} + {fp['drafter_kind']} {fp['drafter_shape']} on {fp['device']}, "
                      f"{fp['dtype']}, {fp['batch']}", str(s["runs"]), str(s["trials"]), str(s["validated"]),
                      str(s["rejected"]), str(s["failed"]), str(s["mechanisms"]), s["best_pipeline"] or "-",
                      f"{s['best_relative']:.3f}" if s["best_relative"] else "-")
    console.print(table)


@main.command("profiles")
def profiles_cmd():
    """List the acceptance profiles a replay drafter draws from, with their τ and sources."""
    from .profiles import load_profile, profile_names

    table = Table(title="acceptance profiles (specpilot/profiles/data)")
    for col in ("name", "method", "target", "block", "status", "τ by benchmark", "source"):
        table.add_column(col)
    for name in profile_names():
        p = load_profile(name)
        if not p.usable:
            taus = "(not entered)"
        elif p.base is not None:
            taus = f"modeled from {p.base.name} by tree budget"
        else:
            taus = ", ".join(f"{b} {t:.2f}" for b, t in p.taus.items())
        table.add_row(name, p.method, p.target, str(p.block_size), p.status, taus, f"arXiv {p.source.arxiv}")
    console.print(table)


def _first_line(cls) -> str:
    """A pass's own docstring, else its module's (dataclasses invent a signature docstring)."""
    doc = cls.__doc__ or ""
    if not doc or doc.startswith(cls.__name__ + "("):
        doc = getattr(sys.modules.get(cls.__module__), "__doc__", "") or ""
    return next((line.strip() for line in doc.splitlines() if line.strip()), "")


@main.command("run")
@click.argument("engine", type=click.Path(file_okay=False, path_type=Path))
@click.option("--prompt", required=True, help="Prompt text.")
@click.option("--max-new-tokens", type=int, default=None, help="Default: the engine spec's serving.max_new_tokens.")
@click.option("--device", default="auto", show_default=True)
@click.option("--temperature", type=click.FloatRange(0.0, 100.0), default=0.0, show_default=True,
              help="0: greedy (token-forced); above: lossless speculative sampling.")
@click.option("--top-p", type=click.FloatRange(0.0, 1.0, min_open=True), default=1.0, show_default=True)
@click.option("--seed", type=click.IntRange(0, 2**64 - 1), default=0, show_default=True)
@click.option("--chat", is_flag=True, help="PROMPT as a user message in the target's chat template; print the answer.")
@user_errors
def run_cmd(engine, prompt, max_new_tokens, device, temperature, top_p, seed, chat):
    """Generate from PROMPT with a compiled ENGINE."""
    from .compiler import load_engine
    from .runtime.sampling import SamplingParams
    from .runtime.tokenizer import chat_prompt, chat_template

    loaded = load_engine(engine, device=device)
    text = prompt
    if chat:
        template = chat_template(loaded.root / "target")
        if template is None:
            raise SpecError(f"{loaded.root / 'target' / 'tokenizer_config.json'}: no 'chat_template' (--chat needs "
                            f"a target with one)")
        text = chat_prompt(template, [{"role": "user", "content": prompt}])
    ids = loaded.tokenizer.encode(text).ids
    n = max_new_tokens or loaded.spec.serving.max_new_tokens
    gen = loaded.engine.generate(ids, n, SamplingParams(temperature=temperature, top_p=top_p, seed=seed))
    click.echo(("" if chat else prompt) + loaded.tokenizer.decode(gen.tokens))
    err_console.print(f"{len(gen.tokens)} tokens, {gen.steps} steps, τ {gen.tau:.2f}", highlight=False)


@main.command("verify")
@click.argument("engine", type=click.Path(file_okay=False, path_type=Path))
@click.option("--device", default="auto", show_default=True)
@user_errors
def verify_cmd(engine, device):
    """Re-run ENGINE on its benchmark prompts and token-force every output token."""
    from .compiler import load_engine, verify_engine

    loaded = load_engine(engine, device=device)
    with progress_bar("verifying", loaded.spec.benchmark.num_prompts) as tick:
        report = verify_engine(loaded, progress=tick)
    console.print(report.summary())
    if not report.passed:
        _print_failures(report)
        sys.exit(1)


@main.command("serve")
@click.argument("engine", type=click.Path(file_okay=False, path_type=Path))
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", type=int, default=8000, show_default=True)
@click.option("--max-batch", type=click.IntRange(min=1), default=8, show_default=True,
              help="Requests the engine runs at once.")
@click.option("--max-queue", type=click.IntRange(min=0), default=64, show_default=True,
              help="Requests waiting for a slot; more are refused with HTTP 429.")
@click.option("--drain", type=click.FloatRange(min=0), default=30.0, show_default=True,
              help="Seconds in-flight requests may take to finish at shutdown (SIGINT/SIGTERM).")
@click.option("--threads", type=click.IntRange(min=1), default=None, help="torch intra-op threads (CPU).")
@click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]), default="info",
              show_default=True, help="uvicorn's log level (info: a line per request).")
@click.option("--batching/--no-batching", default=True, show_default=True,
              help="Greedy requests share the batched engine's verify (else every request runs one after another).")
@click.option("--device", default="auto", show_default=True)
@user_errors
def serve_cmd(engine, host, port, max_batch, max_queue, drain, threads, log_level, batching, device):
    """Serve ENGINE behind an OpenAI-compatible API (/v1/completions, /v1/chat/completions, /v1/models,
    /metrics). See docs/SERVING.md."""
    from .compiler import load_engine
    from .serve import ServeConfig, engine_chat_template, run_server

    if threads:
        import torch

        torch.set_num_threads(threads)
    loaded = load_engine(engine, device=device)
    config = ServeConfig(host=host, port=port, max_batch=max_batch, max_queue=max_queue, drain_s=drain,
                         log_level=log_level, batching=batching)
    err_console.print(f"serving [bold]{loaded.manifest['name']}[/] from {engine} on http://{host}:{port}/v1",
                      highlight=False)
    run_server(loaded.manifest["name"], loaded.engine, loaded.tokenizer, engine_chat_template(engine), config)


if __name__ == "__main__":
    main()

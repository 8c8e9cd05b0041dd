"""The search report: one self-contained HTML page (plots inline as SVG) and its JSON.

The page shows the chosen pipeline and why (its measured time against the start's and the round
that took it), the search's progress (every measured trial, best so far), the cost model's
prediction against the measurement for every trial (raw, and calibrated from earlier trials), the
roofline gaps before and after, each round's log, and every trial with its verdict and reason
(rejected proposals included).
"""

from __future__ import annotations

import html
import io
import json
from dataclasses import asdict
from pathlib import Path

from .search import SearchResult

CSS = ("body{font-family:sans-serif;max-width:70em;margin:2em auto;color:#222}table{border-collapse:collapse;"
       "font-size:90%}td,th{border:1px solid #ccc;padding:2px 6px;text-align:left;vertical-align:top}"
       "code{background:#f4f4f4}.rejected{color:#a33}.failed{color:#888}.validated{color:#262}figure{margin:1em 0}")


def _svg(fig) -> str:
    buf = io.StringIO()
    fig.savefig(buf, format="svg", bbox_inches="tight")
    text = buf.getvalue()
    return text[text.index("<svg"):]


def _plots(result: SearchResult) -> dict[str, str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    measured = [r for r in result.trials if r.relative is not None]
    out = {}
    fig, ax = plt.subplots(figsize=(7, 3.2))
    best, xs, ys = None, [], []
    for r in measured:
        if r.status == "validated":
            best = r.relative if best is None else min(best, r.relative)
        xs.append(r.trial)
        ys.append(best)
    for status, marker, color in (("validated", "o", "tab:green"), ("rejected", "x", "tab:red")):
        pts = [(r.trial, r.relative) for r in measured if r.status == status]
        if pts:
            ax.scatter(*zip(*pts), marker=marker, color=color, label=status)
    if xs:
        ax.step(xs, [y if y is not None else float("nan") for y in ys], where="post", color="k", label="best so far")
    ax.set_xlabel("trial")
    ax.set_ylabel("engine / AR time per token (measured)")
    ax.legend(fontsize=8)
    out["progress"] = _svg(fig)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(4.5, 4))
    pts = [(r.predicted_rel, r.relative, r.calibrated_rel) for r in measured if r.predicted_rel]
    if pts:
        ax.scatter([p[0] for p in pts], [p[1] for p in pts], label="predicted (roofline)", marker="o")
        ax.scatter([p[2] for p in pts], [p[1] for p in pts], label="calibrated from earlier trials", marker="^")
        lo = min(min(p[0], p[1], p[2]) for p in pts) * 0.8
        hi = max(max(p[0], p[1], p[2]) for p in pts) * 1.25
        ax.plot([lo, hi], [lo, hi], color="grey", lw=0.8)
        ax.set_xscale("log")
        ax.set_yscale("log")
        from matplotlib.ticker import NullFormatter, ScalarFormatter

        for axis in (ax.xaxis, ax.yaxis):
            axis.set_major_formatter(ScalarFormatter())
            axis.set_minor_formatter(NullFormatter())
    ax.set_xlabel("predicted engine / AR")
    ax.set_ylabel("measured engine / AR")
    ax.legend(fontsize=8)
    out["predicted-vs-measured"] = _svg(fig)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 3.2))
    names = sorted({g["what"] for g in result.gaps_before + result.gaps_after})
    before = {g["what"]: g["saving_ms"] for g in result.gaps_before}
    after = {g["what"]: g["saving_ms"] for g in result.gaps_after}
    ys = range(len(names))
    ax.barh([y - 0.2 for y in ys], [before.get(n, 0) for n in names], height=0.4, label="start")
    ax.barh([y + 0.2 for y in ys], [after.get(n, 0) for n in names], height=0.4, label="chosen")
    ax.set_yticks(list(ys), [n[:40] for n in names], fontsize=7)
    ax.set_xlabel(f"predicted gap, ms per output token ({result.cost_device or 'the cost model'})")
    ax.legend(fontsize=8)
    out["gaps"] = _svg(fig)
    plt.close(fig)
    return out


def _fmt(x, digits: int = 3) -> str:
    return "" if x is None else f"{x:.{digits}f}"


def render_html(result: SearchResult, title: str, engine_report: dict | None = None) -> str:
    e = html.escape
    plots = _plots(result)
    ranks = result.rank_correlation
    chosen = next((r for r in result.trials if r.improved and r.pipeline == result.best), None)
    why = (f"It measured {_fmt(result.best_relative)} of the AR loop's time per token against "
           f"{_fmt(result.start_relative)} for the starting pipeline ({e(result.start or '(empty)')})")
    if chosen is not None:
        why += f", taken in round {chosen.round} ({e(chosen.proposer)}: {e(chosen.note)})"
    why += "; token forcing passed on every output token." if result.best_relative else "."
    if engine_report:
        why += (f" The engine written: {engine_report.get('speedup_over_ar', 0):.2f}× over AR, "
                f"{e(engine_report.get('token_forcing', ''))}.")
    rounds = "".join(
        f"<tr><td>{r.round}</td><td><code>{e(r.incumbent or '(empty)')}</code></td><td>{_fmt(r.incumbent_relative)}</td>"
        f"<td>{r.proposals}</td><td>{r.rejected}</td><td>{r.measured}</td><td><code>{e(r.chosen or '-')}</code></td>"
        f"<td>{_fmt(r.gain)}</td><td>{e('; '.join(r.notes))}</td></tr>" for r in result.rounds)
    trials = "".join(
        f"<tr class='{e(r.status)}'><td>{r.trial}</td><td>{r.round}</td><td><code>{e(r.pipeline or '(empty)')}</code></td>"
        f"<td>{e(r.proposer)}{' (control)' if r.control else ''}{' (confirmation)' if r.note.startswith('confirmation') else ''}</td><td>{e(r.status)}</td><td>{_fmt(r.predicted_ms, 4)}</td>"
        f"<td>{_fmt(r.predicted_rel)}</td><td>{_fmt(r.calibrated_rel)}</td><td>{_fmt(r.measured_ms)}</td>"
        f"<td>{_fmt(r.relative)}</td><td>{_fmt(r.tau, 2)}</td><td>{_fmt(r.peak_memory_gib, 1)}</td>"
        f"<td>{e(r.reason or r.forcing)[:300]}</td></tr>"
        for r in result.trials)
    return f"""<!DOCTYPE html>
<html><head><meta charset="utf-8"><title>specpilot tune: {e(title)}</title><style>{CSS}</style></head><body>
<h1>specpilot tune: {e(title)}</h1>
<h2>Chosen pipeline</h2>
<p><code id="chosen-pipeline">{e(result.best or '(empty)')}</code></p>
<p id="why">{why} Stopped: {e(result.stopped)}.</p>
<h2>Search progress</h2><figure id="plot-progress">{plots['progress']}</figure>
<h2>Predicted against measured</h2>
<p>Every measured trial: the roofline model's engine/AR ratio, priced on <span id="cost-device">{e(result.cost_device)}</span>,
and that ratio calibrated by this deployment's earlier trials only, against the ratio measured here.
Spearman's rho of predicted against measured over {ranks.get('n', 0)} trials: raw {_fmt(ranks.get('raw'), 2)},
calibrated {_fmt(ranks.get('calibrated'), 2)}.</p>
<figure id="plot-predicted-vs-measured">{plots['predicted-vs-measured']}</figure>
<h2>Roofline gaps before and after</h2><figure id="plot-gaps">{plots['gaps']}</figure>
<h2>Rounds</h2>
<table><tr><th>round</th><th>incumbent</th><th>engine/AR</th><th>proposals</th><th>rejected</th><th>measured</th>
<th>taken</th><th>gain</th><th>notes</th></tr>{rounds}</table>
<h2>Trials</h2>
<table id="trials"><tr><th>#</th><th>round</th><th>pipeline</th><th>proposer</th><th>status</th><th>predicted ms</th>
<th>predicted engine/AR</th><th>calibrated</th><th>measured ms</th><th>measured engine/AR</th><th>τ</th>
<th>peak GiB</th><th>verdict</th></tr>
{trials}</table>
</body></html>
"""


def write_report(out: Path, result: SearchResult, title: str, engine_report: dict | None = None) -> Path:
    """search.json and report.html into `out` (created); the page's path."""
    out.mkdir(parents=True, exist_ok=True)
    doc = {"run": result.run, "start": result.start, "best": result.best, "best_relative": result.best_relative,
           "start_relative": result.start_relative, "stopped": result.stopped, "interrupted": result.interrupted,
           "gaps_before": result.gaps_before, "gaps_after": result.gaps_after, "cost_device": result.cost_device,
           "rank_correlation": result.rank_correlation,
           "rounds": [asdict(r) for r in result.rounds], "trials": [asdict(r) for r in result.trials],
           "engine": engine_report}
    (out / "search.json").write_text(json.dumps(doc, indent=2, default=str) + "\n")
    page = out / "report.html"
    page.write_text(render_html(result, title, engine_report))
    return page

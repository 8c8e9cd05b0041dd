"""How an `Estimate` is shown: a rich table (`render_table`) and a roofline/gap chart (`plot_gaps`).

Every number shown carries its source ("predicted" or "measured"). matplotlib is imported only
when a chart is drawn (the Agg backend, no display), so the package works without it.
"""

from __future__ import annotations

from pathlib import Path

from rich.table import Table

from .model import Estimate

_STEP_FIGURES = (("AR step (baseline)", "t_ar"), ("draft step", "t_draft"), ("verify step", "t_verify"),
                 ("step overhead", "overhead"))


def _ms(seconds: float | None) -> str:
    return "" if seconds is None else f"{seconds * 1e3:.3f} ms"


def render_table(estimate: Estimate) -> Table:
    """Step times beside their floors and the ceiling, τ and speedup, then the ranked gaps."""
    e, c = estimate, estimate.ceiling
    table = Table(title=f"{e.shape} on {e.gpu}: where a step's time goes", title_justify="left")
    table.add_column("figure")
    table.add_column("current", justify="right")
    table.add_column("source")
    table.add_column("floor", justify="right")
    table.add_column("ceiling", justify="right")
    table.add_column("note", overflow="fold")
    ceiling = {"t_ar": c.t_ar, "t_draft": c.t_draft, "t_verify": c.t_verify, "overhead": c.overhead}
    for label, key in _STEP_FIGURES:
        f = getattr(e, key)
        table.add_row(label, _ms(f.value), f.source, _ms(f.floor), _ms(ceiling[key]), f.note)
    table.add_row("τ (accepted + 1)", f"{e.tau.value:.2f}", e.tau.source, "", f"{c.tau:.2f}", e.tau.note)
    table.add_row("time per output token", _ms(e.t_token.value), e.t_token.source, _ms(e.t_token.floor),
                  _ms(c.t_token), e.t_token.note)
    table.add_row("speedup vs AR", f"{e.speedup.value:.2f}x", e.speedup.source, "", f"{c.speedup:.2f}x",
                  f"ceiling: block {c.block_size}, {c.proposal}; {c.speedup_at_floor_ar:.2f}x vs an AR step at its floor")
    table.add_section()
    table.add_row("[bold]gaps[/bold] (ms per output token)", "", "", "", "", "")
    for i, g in enumerate(e.gaps, 1):
        table.add_row(f"{i}. {g.what}", _ms(g.saving), g.source, "", f"{g.fraction:.0%}",
                      g.pipeline or "(no pass yet)")
    if e.calibration and any(abs(v - 1.0) > 1e-9 for v in e.calibration.values()):
        table.add_section()
        cal = ", ".join(f"{k} x{v:.3f}" for k, v in e.calibration.items())
        table.add_row("calibration (measured / predicted)", "", "measured", "", "", cal)
    for note in e.notes:
        table.add_row("note", "", "", "", "", note)
    return table


def plot_gaps(estimate: Estimate, path: str | Path) -> Path:
    """Write a PNG: the roofline of the step's ops, where the step's time goes, and the ranked gaps."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from .gpu import load_gpu

    e = estimate
    path = Path(path)
    fig, (ax_roof, ax_steps, ax_gaps) = plt.subplots(1, 3, figsize=(18, 5.5))

    # 1. roofline: achieved FLOP/s against arithmetic intensity, per op kind of each step (predicted)
    try:
        gpu = load_gpu(e.gpu)
        bw, rate = gpu.bandwidth, gpu.bf16_rate
    except Exception:  # an estimate for a GPU built by hand
        bw = rate = None
    colors = {"ar": "tab:blue", "draft": "tab:green", "verify": "tab:orange"}
    for what, step in (("ar", e.steps.ar), ("draft", e.steps.draft), ("verify", e.steps.verify)):
        for op, t in step.by_op().items():
            if t["bytes"] <= 0 or t["flops"] <= 0 or t["time"] <= 0:
                continue
            x, y = t["flops"] / t["bytes"], t["flops"] / t["time"]
            ax_roof.scatter(x, y, color=colors[what], s=12 + 300 * t["time"] / max(step.raw_time, 1e-12),
                            label=what if op in ("linear",) else None, alpha=0.7)
            if op in ("linear", "lm_head", "attention"):
                ax_roof.annotate(op, (x, y), fontsize=7, xytext=(4, -3), textcoords="offset points")
    if bw and rate:
        import numpy as np

        x = np.logspace(-1, 4, 200)
        ax_roof.plot(x, np.minimum(x * bw, rate), "k-", lw=1,
                     label=f"roofline ({gpu.source_of('bandwidth')} bandwidth, {gpu.source_of('bf16_rate')} rate)")
        ax_roof.legend(fontsize=7, loc="lower right")
    ax_roof.set_xscale("log")
    ax_roof.set_yscale("log")
    ax_roof.set_xlabel("arithmetic intensity (FLOP/byte)")
    ax_roof.set_ylabel("FLOP/s (predicted)")
    ax_roof.set_title("roofline per op kind (predicted; marker area = share of the step)", fontsize=10)

    # 2. step times: current (stacked by op kind) beside floor and ceiling
    groups = {"weights (linear, lm_head, experts)": ("linear", "lm_head", "embed", "moe"), "attention": ("attention", "gated_deltanet"),
              "norms, rope, elementwise": ("rmsnorm", "rope", "mlp", "add", "argmax")}
    labels = ["AR", "draft", "verify"]
    steps = [e.steps.ar, e.steps.draft, e.steps.verify]
    shown = [e.t_ar, e.t_draft, e.t_verify]
    bottom = [0.0] * 3
    for name, ops in groups.items():
        vals = []
        for s in steps:
            by = s.by_op()
            vals.append(sum(by.get(op, {}).get("time", 0.0) for op in ops) * s.scale * 1e3)
        ax_steps.bar(labels, vals, bottom=bottom, label=name)
        bottom = [b + v for b, v in zip(bottom, vals)]
    overhead = [0.0, 0.0, e.overhead.value * 1e3]
    ax_steps.bar(labels, overhead, bottom=bottom, label="step overhead (accept, commit, tree)")
    floors = [f.floor * 1e3 if f.floor is not None else 0.0 for f in shown]
    ax_steps.scatter(labels, floors, marker="_", s=900, c="k", label="floor (bytes / bandwidth)", zorder=3)
    for i, f in enumerate(shown):
        ax_steps.annotate(f"{f.value * 1e3:.2f} ms\n{f.source}", (i, bottom[i] + overhead[i]), ha="center",
                          va="bottom", fontsize=8)
    ax_steps.set_ylabel("ms per step")
    ax_steps.set_ylim(0, max(b + o for b, o in zip(bottom, overhead)) * 1.2 or 1.0)
    ax_steps.set_title(f"step times: τ {e.tau.value:.2f} ({e.tau.source}), speedup {e.speedup.value:.2f}x "
                       f"({e.speedup.source})", fontsize=10)
    ax_steps.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.07), ncol=2)

    # 3. gaps, ranked, each with the pass that closes it
    names = [f"{g.pipeline or '(no pass yet)'}\n{g.what}" for g in e.gaps][::-1]
    savings = [g.saving * 1e3 for g in e.gaps][::-1]
    ax_gaps.barh(names, savings, color="tab:red")
    for y, g in enumerate(e.gaps[::-1]):
        ax_gaps.annotate(f" {g.saving * 1e3:.3f} ms ({g.fraction:.0%})", (g.saving * 1e3, y), va="center", fontsize=7)
    ax_gaps.tick_params(axis="y", labelsize=7)
    if savings:
        ax_gaps.set_xlim(0, max(savings) * 1.35)
    ax_gaps.set_xlabel("ms per output token (predicted)")
    ax_gaps.set_title(f"gaps to the ceiling ({e.ceiling.speedup:.2f}x, predicted)", fontsize=10)

    fig.suptitle(f"{e.shape} on {e.gpu}: predicted time per token {e.t_token.value * 1e3:.3f} ms, "
                 f"ceiling {e.ceiling.t_token * 1e3:.3f} ms", fontsize=11)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path

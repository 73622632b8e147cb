"""The run's report: ``results.json``, ``report.md`` (one row per arm) and PNG plots."""

from __future__ import annotations

import logging
from pathlib import Path

from sinv_prune.pipeline.recipe import Recipe
from sinv_prune.pipeline.rundir import write_json, write_text

logger = logging.getLogger("sinv_prune")


def write_report(root: Path, results: dict, recipe: Recipe, *, plots: bool = True) -> None:
    """Write results.json, report.md and (optionally) plots into the run directory ``root``."""
    figures = []
    if plots:
        figures.append(plot_perplexity_vs_params(results, root / "plots" / "perplexity_vs_params.png"))
        trace = root / "trace.jsonl"
        if trace.exists():
            from sinv_prune.scoring.diagnostics import plot_trace, summarize_trace

            figures += [Path(p) for p in plot_trace(trace, root / "plots").values()]
            results["trace_summary"] = summarize_trace(trace)
    results["plots"] = [str(p.relative_to(root)) for p in figures]
    write_json(root / "results.json", results)
    write_text(root / "report.md", markdown_report(results, recipe))


def summary_rows(results: dict) -> list[dict]:
    """Rows for the summary table and report.md: baseline first, then each arm."""
    base = results["baseline"]
    rows = [_row("baseline", "-", None, base, None, base)]
    for arm in results["arms"]:
        row = _row(arm["name"], arm["criterion"], removed_text(arm), arm["pruned"], arm.get("finetuned"), base)
        rows.append(row | {"layout": arm.get("layout")})
    return rows


def removed_text(counts: dict) -> str:
    """``"4 heads"``, ``"4 heads + 96 channels"``: what an arm removed (from its state or results row)."""
    counted = [(counts.get(f"{what}_removed"), what) for what in ("heads", "channels", "layers")]
    return " + ".join(f"{n:,} {what}" for n, what in counted if n) or "nothing"


SPEED_COLUMN = "forward speed-up vs baseline, median [IQR]"


def _row(name, criterion, removed, pruned, tuned, base) -> dict:
    """One table row; speed-up is the median ratio of interleaved forwards against the baseline."""
    return {
        "arm": name,
        "criterion": criterion,
        "layout": None,  # the arm's GQA layout (selection), set by summary_rows
        "removed": removed,
        "params": pruned["params"],
        "params %": 100.0 * pruned["params"] / base["params"],
        "ppl pruned": pruned["perplexity"],
        "ppl fine-tuned": tuned["perplexity"] if tuned else None,
        SPEED_COLUMN: speed_cell(pruned.get("speed"), baseline=name == "baseline"),
    }


def speed_cell(speed: dict | None, *, baseline: bool = False) -> str | None:
    """``"1.31 [1.27, 1.35]"``; ``"below resolution"`` when its spread overlaps the A/A control's.

    The baseline's own cell is its A/A control (the base timed against itself). Results from
    before the control was measured show the bare median, marked as such.
    """
    if not speed or speed.get("speedup_vs_baseline") is None:
        return None
    if "resolved" not in speed:
        return f"{speed['speedup_vs_baseline']:.2f} (spread not measured)"
    if baseline:
        control = speed["control"]
        return f"A/A {control['speedup']:.2f} {_interval(control['speedup_iqr'])}"
    if not speed["resolved"]:
        return "below resolution"
    return f"{speed['speedup_vs_baseline']:.2f} {_interval(speed['speedup_iqr'])}"


def _interval(pair: list[float]) -> str:
    return f"[{pair[0]:.2f}, {pair[1]:.2f}]"


def speed_note(results: dict) -> str | None:
    """What the speed column measures, with this run's shapes and its A/A control range."""
    base = results["baseline"].get("speed")
    if not base or "control" not in base:
        return None
    models = [results["baseline"]] + [a[k] for a in results["arms"] for k in ("pruned", "finetuned") if a.get(k)]
    controls = [m["speed"]["control"]["speedup_iqr"] for m in models if "control" in (m.get("speed") or {})]
    threads = f"{base['threads']} thread" + ("s" if base["threads"] != 1 else "")
    return (
        f"Speed-up: the baseline's forward latency over the model's ({base['batch_size']} x {base['seq_len']} "
        f"random tokens, `{base['device']}`, {threads}), median of {base['repeats']} interleaved repeats, with "
        "the interquartile range of the per-repeat ratios. Each measurement also times the baseline against "
        "itself in the same loop (an A/A control, which would be 1.00 without noise); across this run its "
        f"interquartile ranges span {min(c[0] for c in controls):.2f}-{max(c[1] for c in controls):.2f}. "
        "\"below resolution\": the model's range overlaps its control's, so the difference is within "
        "the timing noise of this machine (method in docs/evaluation.md)."
    )


def distill_note(results: dict) -> str | None:
    """Which arms were fine-tuned by distillation, from which teacher, with which temperature and alpha."""
    settings: dict[tuple, list[str]] = {}
    for arm in results["arms"]:
        if arm.get("distill"):
            d = arm["distill"]
            settings.setdefault((d["teacher"], d["temperature"], d["alpha"]), []).append(f"`{arm['name']}`")
    notes = [
        f"Fine-tuned by distillation from the teacher `{teacher}` (temperature {t:g}, alpha {a:g}; loss = "
        f"alpha T^2 KL(teacher || student) + (1 - alpha) LM loss): {', '.join(names)}."
        for (teacher, t, a), names in settings.items()
    ]
    return " ".join(notes) or None


def recovery_note(results: dict) -> str | None:
    """How each compensated or iterative arm was made: method, calibration, error, rounds."""
    notes = []
    for arm in results["arms"]:
        comp, rounds = arm.get("compensation"), arm.get("rounds") or 1
        parts = []
        if comp:
            fits = comp.get("layers") or []
            before = sum(f["error_before"] for f in fits) / len(fits) if fits else None
            after = sum(f["error_after"] for f in fits) / len(fits) if fits else None
            error = f", mean layer error {before:.3f} -> {after:.3f}" if fits else ""
            parts.append(f"compensated by `{comp['method']}` on {comp['tokens']:,} calibration tokens "
                         f"in {comp['seconds']:.1f} s{error}")  # fmt: skip
        elif arm.get("compensate"):
            parts.append(f"compensated by `{arm['compensate']['method']}` in every round")
        if rounds > 1:
            parts.append(f"removed in {len(arm.get('per_round') or [])} rounds (re-scored each round)")
        if parts:
            notes.append(f"`{arm['name']}`: " + "; ".join(parts) + ".")
    return " ".join(notes) or None


def allocation_note(results: dict) -> str | None:
    """How arms with a non-uniform allocation spread their cut: strategy, parameters, kept widths' range."""
    notes = []
    for arm in results["arms"]:
        for found in arm.get("allocation") or []:
            kept = "; ".join(f"{u} kept {w['min']}-{w['max']} per layer" for u, w in found.get("kept", {}).items())
            search = found.get("search")
            fit = f"; search KL {search['seed_fitness']:.4g} -> {search['best_fitness']:.4g}" if search else ""
            notes.append(f"`{arm['name']}`: allocation `{found['strategy']}`, {found['removed_params']:,} of "
                         f"{found['target_params']:,} target parameters removed; {kept}{fit}.")  # fmt: skip
    return " ".join(notes) or None


def markdown_report(results: dict, recipe: Recipe) -> str:
    rows = summary_rows(results)
    run = results.get("run", {})
    ppl_word = "MLM perplexity" if run.get("task") == "masked-lm" else "perplexity"
    lines = [
        f"# {recipe.name}",
        "",
        f"Evaluated on the `{run.get('eval_split')}` split ({ppl_word}; method in docs/evaluation.md), "
        f"device `{run.get('device')}`. Every arm starts from the same base model.",
        "",
        "| " + " | ".join(rows[0]) + " |",
        "| " + " | ".join("---" for _ in rows[0]) + " |",
    ]
    for row in rows:
        lines.append("| " + " | ".join(format_cell(v) for v in row.values()) + " |")
    note = speed_note(results)
    if note:
        lines += ["", note]
    for note in (distill_note(results), recovery_note(results), allocation_note(results)):
        if note:
            lines += ["", note]
    crossed = [a for a in results["arms"] if "crossed" in a.get("score_report", {})]
    for arm in crossed:
        rep = arm["score_report"]
        what = f"{rep.get('measure', 'C_Q')} < {rep.get('threshold')}"
        lines += ["", f"`{arm['name']}`: {rep['crossed']} heads crossed {what} within the window; "
                  "the rest were ordered by their lowest value in it."]  # fmt: skip
    if results.get("trace_summary"):
        summary = results["trace_summary"]
        lines += ["", "## Convergence trace", "", "```", _short(summary), "```"]
    for plot in results.get("plots", []):
        lines += ["", f"![{Path(plot).stem}]({plot})"]
    lines += ["", "Full numbers: `results.json`; the resolved recipe: `recipe.yaml`.", ""]
    return "\n".join(lines)


def _short(summary: dict) -> str:
    keys = ("threshold", "measurements", "last_step", "stop_rule", "never_converged_layers",
            "undertrained_layers", "heads_total", "heads_ever_below", "heads_below_at_end")  # fmt: skip
    return "\n".join(f"{k}: {summary[k]}" for k in keys if k in summary)


def format_cell(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.2f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


MARKERS = ("o", "s", "^", "D", "v", "P", "X", "<", ">", "h")


def plot_perplexity_vs_params(results: dict, path: Path) -> Path:
    """Save :func:`perplexity_vs_params_figure` as a PNG at ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = perplexity_vs_params_figure(results)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


def perplexity_vs_params_figure(results: dict):
    """Perplexity against parameter count: one marker per arm, open after pruning, filled after fine-tuning.

    Arms at (nearly) the same parameter count are spread sideways by a few points on screen,
    in their order in the recipe, so none hides another; their data coordinates stay exact.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.transforms import offset_copy

    fig, ax = plt.subplots(figsize=(7.2, 4.4), dpi=120)
    base = results["baseline"]
    ax.scatter([base["params"]], [base["perplexity"]], marker="*", s=180, color="black", label="baseline", zorder=3)
    arms = results["arms"]
    offsets = _dodge([a["pruned"]["params"] for a in arms], base["params"])
    for i, (arm, dx) in enumerate(zip(arms, offsets, strict=True)):
        color, marker = f"C{i % 10}", MARKERS[i % len(MARKERS)]
        shifted = offset_copy(ax.transData, fig=fig, x=dx, units="points")
        pruned, tuned = arm["pruned"], arm.get("finetuned")
        ax.scatter([pruned["params"]], [pruned["perplexity"]], marker=marker, s=50, facecolors="white",
                   edgecolors=color, linewidths=1.5, transform=shifted, zorder=3)  # fmt: skip
        if tuned:
            ax.scatter([tuned["params"]], [tuned["perplexity"]], marker=marker, s=50, color=color,
                       transform=shifted, zorder=4)  # fmt: skip
        ax.scatter([], [], marker=marker, s=50, color=color, label=arm["name"])  # the legend entry
        ax.update_datalim([(m["params"], m["perplexity"]) for m in (pruned, tuned) if m])  # shifted points don't
    ax.scatter([], [], marker="o", s=50, facecolors="white", edgecolors="gray", label="open: after pruning")
    if any(a.get("finetuned") for a in arms):
        ax.scatter([], [], marker="o", s=50, color="gray", label="filled: after fine-tuning")
    ppls = [base["perplexity"]] + [a[k]["perplexity"] for a in arms for k in ("pruned", "finetuned") if a.get(k)]
    _plain_axes(ax, ppls)
    spread = " (arms with equal counts spread sideways)" if any(offsets) else ""
    ax.set_xlabel("parameters" + spread)
    ax.set_ylabel("perplexity (lower is better)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5), frameon=False)
    fig.tight_layout()
    return fig


def _dodge(xs: list[float], baseline: float, step: float = 9.0) -> list[float]:
    """Sideways offsets in points: arms within 1% of the x span of each other share a centred row."""
    span = (max([*xs, baseline]) - min([*xs, baseline])) or max(abs(baseline), 1.0)
    groups: list[list[int]] = []
    for i, x in enumerate(xs):
        for group in groups:
            if abs(xs[group[0]] - x) <= 0.01 * span:
                group.append(i)
                break
        else:
            groups.append([i])
    offsets = [0.0] * len(xs)
    for group in groups:
        for j, i in enumerate(group):
            offsets[i] = (j - (len(group) - 1) / 2) * step
    return offsets


def _plain_axes(ax, perplexities: list[float]) -> None:
    """Plain-number tick labels; a log y axis only when perplexities span more than a factor of 3."""
    from matplotlib.ticker import FuncFormatter, MaxNLocator, NullFormatter

    if max(perplexities) > 3 * min(perplexities):
        ax.set_yscale("log")
        ax.yaxis.set_minor_formatter(NullFormatter())
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.xaxis.set_major_locator(MaxNLocator(nbins=6))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:,.0f}"))
    ax.margins(x=0.1, y=0.08)
    ax.autoscale_view()

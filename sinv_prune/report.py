"""The run's report: ``results.json``, ``report.md`` (one row per arm) and PNG plots."""

from __future__ import annotations

import logging
from pathlib import Path

from sinv_prune.recipe import Recipe
from sinv_prune.rundir import write_json, write_text

logger = logging.getLogger("sinv_prune")


def write_report(root: Path, results: dict, recipe: Recipe, *, plots: bool = True) -> None:
    """Write results.json, report.md and (optionally) plots into the run directory ``root``."""
    figures = []
    if plots:
        figures.append(plot_perplexity_vs_params(results, root / "plots" / "perplexity_vs_params.png"))
        trace = root / "trace.jsonl"
        if trace.exists():
            from sinv_prune.diagnostics import plot_trace, summarize_trace

            figures += [Path(p) for p in plot_trace(trace, root / "plots").values()]
            results["trace_summary"] = summarize_trace(trace)
    results["plots"] = [str(p.relative_to(root)) for p in figures]
    write_json(root / "results.json", results)
    write_text(root / "report.md", markdown_report(results, recipe))


def summary_rows(results: dict) -> list[dict]:
    """Rows for the summary table and report.md: baseline first, then each arm."""
    base = results["baseline"]
    rows = [_row("baseline", "-", 0, base, None, base)]
    for arm in results["arms"]:
        row = _row(arm["name"], arm["criterion"], arm["heads_removed"], arm["pruned"], arm.get("finetuned"), base)
        rows.append(row | {"layout": arm.get("layout")})
    return rows


def _row(name, criterion, removed, pruned, tuned, base) -> dict:
    """One table row; speed-up is the median ratio of interleaved forwards against the baseline."""
    speedup = (pruned.get("speed") or {}).get("speedup_vs_baseline")
    return {
        "arm": name,
        "criterion": criterion,
        "layout": None,  # the arm's GQA layout (selection), set by summary_rows
        "heads removed": removed,
        "params": pruned["params"],
        "params %": 100.0 * pruned["params"] / base["params"],
        "ppl pruned": pruned["perplexity"],
        "ppl fine-tuned": tuned["perplexity"] if tuned else None,
        "speed-up": speedup,
    }


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


def plot_perplexity_vs_params(results: dict, path: Path) -> Path:
    """Perplexity against parameter count, one series per criterion, before/after fine-tuning."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=120)
    base = results["baseline"]
    ax.scatter([base["params"]], [base["perplexity"]], marker="*", s=160, color="black", label="baseline", zorder=3)
    by_crit: dict[str, list[dict]] = {}
    for arm in results["arms"]:
        by_crit.setdefault(arm["criterion"], []).append(arm)
    for i, (crit, arms) in enumerate(sorted(by_crit.items())):
        color = f"C{i % 10}"
        arms = sorted(arms, key=lambda a: a["pruned"]["params"])
        ax.plot([a["pruned"]["params"] for a in arms], [a["pruned"]["perplexity"] for a in arms],
                "o--", color=color, label=f"{crit} (pruned)")  # fmt: skip
        tuned = [a for a in arms if a.get("finetuned")]
        if tuned:
            ax.plot([a["finetuned"]["params"] for a in tuned], [a["finetuned"]["perplexity"] for a in tuned],
                    "s-", color=color, label=f"{crit} (fine-tuned)")  # fmt: skip
    ax.set_xlabel("parameters")
    ax.set_ylabel("perplexity")
    ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path

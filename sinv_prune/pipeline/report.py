"""The run's report: ``results.json``, ``report.md`` (one row per arm) and PNG plots."""

from __future__ import annotations

import logging
from pathlib import Path

from sinv_prune.hub.model_card import gguf_cell, speed_cell
from sinv_prune.lmeval.report import evaluations, generation_lines, mean_accuracy, task_lines, task_names
from sinv_prune.pipeline.recipe import Recipe
from sinv_prune.pipeline.report_routing import plot_routing, routing_lines
from sinv_prune.rundir import write_json, write_text
from sinv_prune.strict_json import with_null_reasons
from sinv_prune.units import get_unit, unit_names

logger = logging.getLogger("sinv_prune")


def write_report(root: Path, results: dict, recipe: Recipe, *, plots: bool = True) -> None:
    """Write results.json, report.md and (optionally) plots into the run directory ``root``."""
    figures = []
    if plots:
        figures.append(plot_perplexity_vs_params(results, root / "plots" / "perplexity_vs_params.png"))
        accuracy = plot_accuracy_vs_params(results, root / "plots" / "accuracy_vs_params.png")
        figures += [accuracy] if accuracy else []
        from sinv_prune.pipeline.recovery import plot_recovery

        curve = plot_recovery(results, root / "plots" / "recovery_curve.png")
        figures += [curve] if curve else []
        trace = root / "trace.jsonl"
        if trace.exists():
            from sinv_prune.scoring.diagnostics import plot_trace, summarize_trace

            figures += [Path(p) for p in plot_trace(trace, root / "plots").values()]
            results["trace_summary"] = summarize_trace(trace)
        routing = plot_routing(results, root / "plots")  # MoE runs: linked from the routing table, not inlined
        if routing:
            results["routing_plots"] = {name: str(p.relative_to(root)) for name, p in routing.items()}
    results["plots"] = [str(p.relative_to(root)) for p in figures]
    write_json(root / "results.json", with_null_reasons(results))
    write_text(root / "report.md", markdown_report(results, recipe))


def summary_rows(results: dict) -> list[dict]:
    """Rows for the summary table and report.md: baseline first, then each arm.

    The ``layout`` column (how a GQA layer loses heads) is there only when the model has GQA
    (``results["run"]["gqa"]``; results written before it was recorded keep the column) and some
    arm removes heads: elsewhere every layout is the same cut. The ``gguf`` column (type and size of
    each model's llama.cpp file) is there only when the run exported (``results["gguf"]``).
    """
    base = results["baseline"]
    rows = [_row("baseline", "-", None, base, None, base)]
    for arm in results["arms"]:
        row = _row(arm["name"], arm["criterion"], removed_text(arm), arm["pruned"], arm.get("finetuned"), base)
        rows.append(row | {"layout": arm.get("layout")})
    gqa = results.get("run", {}).get("gqa", True)
    if not gqa or all(row["layout"] is None for row in rows):
        for row in rows:
            del row["layout"]
    names = task_names(results)
    if names:  # the zero-shot tasks' mean next to perplexity (each task is in report.md's task table)
        models = [(base, None)] + [(arm["pruned"], arm.get("finetuned")) for arm in results["arms"]]
        for row, (pruned, tuned) in zip(rows, models, strict=True):
            speed = row.pop(SPEED_COLUMN)
            row[TASKS_PRUNED] = _accuracy(mean_accuracy(pruned, names))
            row[TASKS_TUNED] = _accuracy(mean_accuracy(tuned, names)) if tuned else None
            row[SPEED_COLUMN] = speed
    gguf = results.get("gguf")
    if gguf:  # export.gguf ran: each model's file (the arm's final model), before the speed column
        for row in rows:
            speed = row.pop(SPEED_COLUMN)
            row[GGUF_COLUMN] = gguf_cell(gguf.get(row["arm"]))
            row[SPEED_COLUMN] = speed
    return rows


#: Summary columns of a run with zero-shot tasks: the mean of the task columns (acc_norm or acc).
TASKS_PRUNED, TASKS_TUNED = "tasks mean pruned", "tasks mean fine-tuned"


#: Summary column of a run with ``export.gguf``: each model's GGUF type and file size.
GGUF_COLUMN = "gguf"


def _accuracy(value: float | None) -> str | None:
    return None if value is None else f"{value:.3f}"


def removed_text(counts: dict) -> str:
    """``"4 heads"``, ``"4 heads + 96 channels"``: what an arm removed (from its state or results row)."""
    plurals = [get_unit(name).plural for name in unit_names()]  # heads, channels, ..., layers
    counted = [(counts.get(f"{what}_removed"), what) for what in plurals]
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
            key = (d["teacher"], d["temperature"], d["alpha"], d.get("cache_top_k"))
            settings.setdefault(key, []).append(f"`{arm['name']}`")
    notes = [
        f"Fine-tuned by distillation from the teacher `{teacher}` (temperature {t:g}, alpha {a:g}; loss = "
        f"alpha T^2 KL(teacher || student) + (1 - alpha) LM loss"
        + (f"; the KL over the teacher's cached top-{k} tokens" if k else "")
        + f"): {', '.join(names)}."
        for (teacher, t, a, k), names in settings.items()
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
                         f"in {comp['seconds']:.1f} s{error}{_kept(comp)}")  # fmt: skip
        elif arm.get("compensate"):
            parts.append(f"compensated by `{arm['compensate']['method']}` in every round")
        if rounds > 1:
            parts.append(f"removed in {len(arm.get('per_round') or [])} rounds (re-scored each round)")
        if parts:
            notes.append(f"`{arm['name']}`: " + "; ".join(parts) + ".")
    return " ".join(notes) or None


def curve_note(results: dict) -> str | None:
    """Each recovery curve's first and last points (``finetune.eval_every_tokens``; all points in results.json)."""
    notes = []
    for arm in results["arms"]:
        points = arm.get("recovery_curve") or []
        if len(points) >= 2 and points[0].get("perplexity") is not None and points[-1].get("perplexity") is not None:
            first, last = points[0], points[-1]
            notes.append(f"`{arm['name']}` {first['perplexity']:.4g} at 0 tokens -> {last['perplexity']:.4g} at "
                         f"{last['tokens']:,} ({len(points)} points)")  # fmt: skip
    if not notes:
        return None
    return "Recovery curve (perplexity on the evaluation text while fine-tuning; plots/recovery_curve.png): " + (
        "; ".join(notes) + "."
    )


def _kept(comp: dict) -> str:
    """Which model the held-out tokens chose (compensated or plainly pruned), with their losses."""
    loss = comp.get("heldout_loss")
    if not loss:
        return ""
    return (f"; held-out {comp['heldout_kind']} {loss['plain']:.4f} plain, {loss['compensated']:.4f} compensated "
            f"({comp['heldout_tokens']:,} tokens): kept the {comp['kept']} model")  # fmt: skip


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
    for note in (distill_note(results), recovery_note(results), allocation_note(results), curve_note(results)):
        if note:
            lines += ["", note]
    crossed = [a for a in results["arms"] if "crossed" in a.get("score_report", {})]
    for arm in crossed:
        rep = arm["score_report"]
        what = f"{rep.get('measure', 'C_Q')} < {rep.get('threshold')}"
        lines += ["", f"`{arm['name']}`: {rep['crossed']} heads crossed {what} within the window; "
                  "the rest were ordered by their lowest value in it."]  # fmt: skip
    for extra in (task_lines(results), generation_lines(results)):
        lines += ["", *extra] if extra else []
    if results.get("trace_summary"):
        summary = results["trace_summary"]
        lines += ["", "## Convergence trace", "", "```", _short(summary), "```"]
    routing = routing_lines(results, results.get("routing_plots", {}))
    lines += ["", *routing] if routing else []
    lines += gguf_section(results.get("gguf"))
    for plot in results.get("plots", []):
        lines += ["", f"![{Path(plot).stem}]({plot})"]
    lines += ["", "Full numbers: `results.json`; the resolved recipe: `recipe.yaml`.", ""]
    return "\n".join(lines)


def gguf_section(gguf: dict | None) -> list[str]:
    """report.md lines for ``export.gguf``: file, llama.cpp architecture, size and the round-trip check."""
    if not gguf:
        return []
    lines = ["", "## GGUF files (llama.cpp)", "", "| model | file | architecture | type | size | llama.cpp check |",
             "| --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    for name, row in gguf.items():
        check = row.get("verify")
        if check is None:
            cell = "not run (llama-cpp-python not installed)"
        else:
            exact = f"max rel. logit diff {check['max_rel_diff']:.1e}, " if check["exact_type"] else ""
            verdict = "passed" if check["passed"] else "FAILED"
            cell = f"{verdict}: {exact}top-1 {check['top1_agreement']:.1%} of {check['tokens']} tokens"
        lines.append(f"| {name} | `{row['path']}` | {row['arch']} | {row['type']} | "
                     f"{row['size_bytes'] / 2**20:,.1f} MiB | {cell} |")  # fmt: skip
    shown = {k: v["verify"] for k, v in gguf.items() if (v.get("verify") or {}).get("continuation_transformers")}
    if shown:
        lines += ["", "Greedy continuations of the check's prompt:", "", "| model | transformers | llama.cpp |",
                  "| --- | --- | --- |"]  # fmt: skip
        for name, check in shown.items():
            cells = [
                repr(check[k]).replace("|", "\\|") for k in ("continuation_transformers", "continuation_llama_cpp")
            ]
            lines.append(f"| {name} | {cells[0]} | {cells[1]} |")
    return lines


def _short(summary: dict) -> str:
    keys = ("threshold", "measurements", "last_step", "stop_rule", "never_converged_layers",
            "undertrained_layers", "heads_total", "heads_ever_below", "heads_below_at_end")  # fmt: skip
    return "\n".join(f"{k}: {summary[k]}" for k in keys if k in summary)


def plain_table(rows: list[dict]) -> str:
    """``rows`` as aligned text columns, every cell in full (for logs and pipes, where rich would truncate)."""
    cells = [list(rows[0])] + [[format_cell(v) for v in row.values()] for row in rows]
    widths = [max(len(line[i]) for line in cells) for i in range(len(cells[0]))]
    left = [key in ("arm", "criterion", "layout", "removed") for key in rows[0]]
    lines = []
    for n, line in enumerate(cells):
        lines.append("  ".join(c.ljust(w) if lf else c.rjust(w) for c, w, lf in zip(line, widths, left, strict=True)))
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(line.rstrip() for line in lines)


def format_cell(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.2f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


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
    """Perplexity per arm (:func:`~sinv_prune.pipeline.report_figure.per_arm_figure`)."""
    from sinv_prune.pipeline.report_figure import per_arm_figure

    return per_arm_figure(results, lambda ev: ev.get("perplexity"), "perplexity (lower is better)")


def plot_accuracy_vs_params(results: dict, path: Path) -> Path | None:
    """Mean task accuracy per arm, drawn like the perplexity plot (arms as columns, open after pruning,
    filled after fine-tuning); None when the run has no tasks."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from sinv_prune.pipeline.report_figure import per_arm_figure

    names = task_names(results)
    if not names or all(mean_accuracy(ev, names) is None for ev in evaluations(results)):
        return None
    label = f"mean accuracy over {len(names)} task{'s' if len(names) > 1 else ''} (higher is better)"
    fig = per_arm_figure(results, lambda ev: mean_accuracy(ev, names), label, log_y=False, note=", ".join(names))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path

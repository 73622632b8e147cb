"""The report's zero-shot task table, its pins, the accuracy plot and the generations side by side.

Each task's column shows the metric lm-eval names ``acc_norm`` where the task reports it, else
``acc`` (:func:`sinv_prune.lmeval.headline`), with its standard error; ``mean`` is the plain
mean of those columns. Rows: the baseline, then every arm after pruning and after fine-tuning.
"""

from __future__ import annotations

from sinv_prune.lmeval.harness import headline


def _models(results: dict) -> list[tuple[str, str, dict]]:
    """``(arm, stage, evaluation)`` for the baseline and every arm's pruned and fine-tuned model."""
    rows = [("baseline", "-", results["baseline"])]
    for arm in results["arms"]:
        for stage in ("pruned", "finetuned"):
            if arm.get(stage):
                rows.append((arm["name"], "fine-tuned" if stage == "finetuned" else stage, arm[stage]))
    return rows


def evaluations(results: dict) -> list[dict]:
    """The baseline's evaluation, then each arm's as pruned and as fine-tuned (where it was)."""
    return [evaluation for _, _, evaluation in _models(results)]


def _first_with_tasks(results: dict) -> dict:
    """The first evaluation (baseline, then the arms' models) that ran the tasks (``evaluate.tasks_on``)."""
    if "baseline" not in results:  # a partial results dict (a model card's minimal one)
        return {}
    return next((ev for ev in evaluations(results) if ev.get("tasks")), {})


def task_names(results: dict) -> list[str]:
    """The report's task columns: the tasks of the first model that ran them, a group's aggregate instead of
    its subtasks."""
    first = _first_with_tasks(results)
    pins = first.get("lm_eval") or {}
    return list(pins.get("columns") or (first.get("tasks") or {}).keys())


def _headline(metrics: dict | None):
    return headline(metrics) if metrics else None


def mean_accuracy(evaluation: dict, names: list[str]) -> float | None:
    """The mean over ``names`` of each task's headline metric (None if a task lacks one)."""
    values = [_headline((evaluation.get("tasks") or {}).get(n)) for n in names]
    if not values or any(v is None for v in values):
        return None
    return sum(v[1] for v in values) / len(values)


def task_header(results: dict, name: str) -> str:
    """A task's column header: its name and the metric shown, ``arc_easy (acc_norm)``."""
    head = _headline(_first_with_tasks(results)["tasks"][name])
    return f"{name} ({head[0]})" if head else name


def task_cell(evaluation: dict, name: str) -> str:
    """``0.2600 ± 0.0311``: the task's headline metric with its standard error, ``-`` where missing."""
    metrics = (evaluation.get("tasks") or {}).get(name)
    head = _headline(metrics)
    if head is None:
        return "-"
    stderr = metrics.get(f"{head[0]}_stderr")
    return f"{head[1]:.4f}" + (f" ± {stderr:.4f}" if stderr is not None else "")


def task_pins(results: dict) -> dict | None:
    """The lm-eval pins of the run (version, few-shot, limit, task versions), if it evaluated tasks."""
    return (results.get("run") or {}).get("lm_eval") or _first_with_tasks(results).get("lm_eval")


def task_lines(results: dict) -> list[str]:
    """Markdown: the task table (a column per task and the mean) and the pins under it; [] without tasks."""
    names = task_names(results)
    if not names:
        return []
    columns = [task_header(results, name) for name in names]
    lines = [
        "## Zero-shot tasks (lm-evaluation-harness)",
        "",
        "| arm | stage | params | " + " | ".join(columns) + " | mean |",
        "| --- | --- | ---: | " + " | ".join("---:" for _ in columns) + " | ---: |",
    ]
    for arm, stage, evaluation in _models(results):
        cells = [task_cell(evaluation, name) for name in names]
        mean = mean_accuracy(evaluation, names)
        mean_cell = "-" if mean is None else f"{mean:.4f}"
        lines.append(f"| {arm} | {stage} | {evaluation['params']:,} | " + " | ".join(cells) + f" | {mean_cell} |")
    pins = task_pins(results)
    if pins:
        lines += ["", pins_text(pins)]
    return lines


def pins_text(pins: dict) -> str:
    """One paragraph: lm-eval's version, few-shot count, limit, batch size, each task's version and items."""
    shots = "each task's default few-shot count" if pins["num_fewshot"] is None else f"{pins['num_fewshot']}-shot"
    limit = "all items" if pins["limit"] is None else f"limit {pins['limit']} items per task"
    per_task = []
    for name, info in pins["tasks"].items():
        samples = info.get("samples") or {}
        items = f", {samples['effective']:,} of {samples['original']:,} items" if samples else ""
        per_task.append(f"`{name}` v{info.get('version')}{items}")
    built = [f"`{name}` built from {b['source']} (sha256 {b['sha256'][:12]}, {b['items']:,} items)"
             for name, b in (pins.get("builds") or {}).items()]  # fmt: skip
    text = (
        f"lm-eval {pins['lm_eval_version']}, {shots}, {limit}, batch size {pins['batch_size']}; "
        f"standard errors as lm-eval computes them ({pins['bootstrap_iters']:,} bootstrap resamples where "
        f"there is no closed form). Tasks: {'; '.join(per_task)}."
    )
    return text + (" " + "; ".join(built) + "." if built else "")


def generation_lines(results: dict) -> list[str]:
    """Markdown: per prompt, every model's greedy continuation one under another; [] without generations."""
    models = [(a, s, e) for a, s, e in _models(results) if e.get("generations")]
    if not models:
        return []
    prompts = [g["prompt"] for g in models[0][2]["generations"]]
    lines = ["## Generations", "", "Greedy continuations (32 new tokens at most, stopped at EOS) of each prompt."]
    for i, prompt in enumerate(prompts):
        lines += ["", f"**{_cell(prompt)}** ...", ""]
        for arm, stage, evaluation in models:
            gens = evaluation["generations"]
            text = gens[i]["continuation"] if i < len(gens) else ""
            where = arm if stage == "-" else f"{arm} ({stage})"
            lines.append(f"- `{where}`: {_cell(text) or '(nothing)'}")
    return lines


def _cell(text: str) -> str:
    return " ".join(text.split("\n")).strip()

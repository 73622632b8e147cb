"""The evaluate stage's zero-shot tasks (lm-eval, ``evaluate.tasks``) and generations (``evaluate.prompts``).

Per model, :func:`model_tasks` adds to its results row

* ``tasks``: ``{task: {metric: value, metric_stderr: value, "samples": n}}`` from
  :func:`sinv_prune.lmeval.evaluate_tasks`, on the model in memory;
* ``lm_eval``: the pins (lm-eval's version, task versions, few-shot count, limit, batch size);
* ``generations``: greedy continuations of the prompts (causal LMs only).

The shipped ``wikitext_lastword`` task is built into ``RUN_DIR/tasks/``. The task set (and
lm-eval's task index, 5 s when lm-eval's own tasks are named) is resolved once per run.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from sinv_prune.pipeline.recipe import Recipe, RecipeError

logger = logging.getLogger("sinv_prune")


def check_recipe_tasks(recipe: Recipe, masked_lm: bool) -> None:
    """Preflight: lm-eval installed, every task known, nothing written; masked LMs take no tasks."""
    from sinv_prune.lmeval import TasksError, resolve_tasks

    spec = recipe.evaluate
    if not spec.tasks:
        return
    if masked_lm:
        raise RecipeError("evaluate.tasks: lm-eval tasks score causal LMs; this recipe's model is a masked LM")
    try:
        resolve_tasks(list(spec.tasks), recipe._base_dir, where="evaluate.tasks")
    except TasksError as err:
        raise RecipeError(str(err)) from None


_TASK_SETS: dict[tuple, tuple] = {}


def task_seconds(recipe: Recipe, probe) -> tuple[float, list[str], int]:
    """One model's ``evaluate.tasks`` in seconds (``wikitext_lastword`` only), what was counted, tasks not counted."""
    import math

    from sinv_prune.pipeline.estimate_row import CHARS_PER_TOKEN

    spec = recipe.evaluate
    seconds, counted = 0.0, []
    if "wikitext_lastword" in spec.tasks:
        from sinv_prune.lmeval.lastword import TASK_NAME, lastword_items, source_file

        items = lastword_items(source_file().read_text(encoding="utf-8").splitlines())
        limit = spec.limit if spec.limit is not None else len(items)
        n = min(len(items), math.ceil(limit * len(items)) if isinstance(limit, float) else limit)
        tokens = sum(len(it["context"]) + len(it["target"]) + 1 for it in items) / len(items) / CHARS_PER_TOKEN
        batch = spec.window_batch_size  # auto: lm-eval's own choice on an accelerator is larger (errs long)
        seconds = math.ceil(n / batch) * probe.forward(int(batch * tokens))
        counted.append(f"{TASK_NAME} {n} items of ~{tokens:.0f} tokens")
    return seconds, counted, len(spec.tasks) - len(counted)


def _task_set(entries: tuple[str, ...], base_dir: str, build_dir: str):
    """The resolved tasks and lm-eval's task manager, kept while their directories exist (one run)."""
    from sinv_prune.lmeval import resolve_tasks

    key = (entries, base_dir, build_dir)
    cached = _TASK_SETS.get(key)
    if cached is None or not all(Path(p).is_dir() for p in cached[0].include):
        tasks = resolve_tasks(list(entries), base_dir, build_dir=build_dir, where="evaluate.tasks")
        _TASK_SETS.clear()
        _TASK_SETS[key] = cached = (tasks, tasks.task_manager())
    return cached


def model_tasks(
    recipe: Recipe, root: Path, tokenizer, model, *, masked_lm: bool, label: str = "", tasks: bool = True
) -> dict[str, Any]:
    """The recipe's lm-eval tasks (unless ``tasks`` is false) and generations for one model (an empty dict when
    it asks for neither)."""
    from sinv_prune.pipeline.generations import DEFAULT_PROMPTS, greedy_continuations

    spec = recipe.evaluate
    out: dict[str, Any] = {}
    if spec.tasks and tasks and not masked_lm:
        from sinv_prune.lmeval import evaluate_tasks, headline

        task_set, manager = _task_set(tuple(spec.tasks), str(recipe._base_dir), str(Path(root) / "tasks"))
        result = evaluate_tasks(
            model,
            tokenizer,
            task_set,
            num_fewshot=spec.num_fewshot,
            limit=spec.limit,
            batch_size=spec.task_batch_size,
            task_manager=manager,
        )
        out["tasks"], out["lm_eval"] = result["tasks"], result["pins"]
        shown = {name: headline(m) for name, m in result["tasks"].items()}
        logger.info("tasks %s: %s", label, ", ".join(f"{n} {h[0]} {h[1]:.4f}" for n, h in shown.items() if h))
    prompts = DEFAULT_PROMPTS if spec.prompts is None else tuple(spec.prompts)
    if prompts and not masked_lm:
        out["generations"] = greedy_continuations(model, tokenizer, prompts)
    return out


def estimate_rows(recipe: Recipe, probe) -> list:
    """``--dry-run`` rows for the tasks and generations of every model (``[]`` when there are none).

    ``wikitext_lastword`` is sized from its source (items, or ``limit``; tokens from the text's
    characters); other tasks' sizes are unknown before lm-eval loads them and are not counted.
    Each generated token is counted as a one-token forward.
    """
    from sinv_prune.pipeline.estimate_row import Row
    from sinv_prune.pipeline.generations import DEFAULT_PROMPTS, NEW_TOKENS

    spec = recipe.evaluate
    models = recipe.evaluated_models
    rows = []
    if spec.tasks:
        seconds, counted, rest = task_seconds(recipe, probe)
        tasked = recipe.task_models
        what = f"{tasked} models x " + ", ".join(counted or ["tasks"])
        what += f" (+{rest} tasks not counted)" if rest else ""
        rows.append(Row("evaluate tasks (lm-eval)", tasked * seconds, what))
    prompts = DEFAULT_PROMPTS if spec.prompts is None else spec.prompts
    if prompts and recipe.model.architecture not in ("bert", "roberta"):
        seconds = models * len(prompts) * NEW_TOKENS * probe.forward(1)
        rows.append(Row("generations", seconds, f"{models} models x {len(prompts)} prompts x {NEW_TOKENS} tokens"))
    return rows

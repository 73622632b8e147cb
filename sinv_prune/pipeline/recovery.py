"""The recovery curve (``finetune.eval_every_tokens``): how an arm's quality comes back as it fine-tunes.

:class:`RecoveryCurve` is a ``TrainerCallback``. It evaluates the model before the first step (0
tokens: the pruned model as it left the prune stage), after each optimizer step that takes the tokens
seen past another multiple of ``every_tokens``, and after the last step. Tokens seen after step ``s``
are ``s * tokens_per_step`` (:func:`sinv_prune.pipeline.training.tokens_per_step`). A point is::

    {"tokens": 250000, "step": 62, "perplexity": 31.4, "<task>": 0.41, ...}

``perplexity``: on the evaluate stage's text (the test split, else valid) with its window and stride,
over its first ``finetune.eval_max_tokens`` tokens (omitted: ``data.max_eval_tokens``, the evaluate
stage's own amount); a masked LM's is its MLM perplexity. Each task of ``evaluate.tasks`` adds its
headline metric (``acc_norm`` where lm-eval reports it, else ``acc``) under the task's name, unless
``finetune.eval_tasks`` is false. The
points are rewritten to ``recovery.json`` (strict JSON) in the arm's directory after each one, so a
resumed fine-tune keeps those taken up to its checkpoint; the main process evaluates, the others wait
at the next step.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Callable
from pathlib import Path

from transformers import TrainerCallback

from sinv_prune.strict_json import null_non_finite

logger = logging.getLogger("sinv_prune")


class RecoveryCurve(TrainerCallback):
    """Evaluate every ``every_tokens`` tokens seen (and at 0 and at the end) into ``path``.

    ``evaluate(model) -> dict`` gives a point's measurements (perplexity, tasks); ``seq_len`` is the
    training blocks' length (with the Trainer's batch size, accumulation and processes: tokens a step).
    """

    def __init__(self, evaluate: Callable, every_tokens: int, seq_len: int, path: Path):
        if every_tokens <= 0:
            raise ValueError(f"every_tokens must be positive, got {every_tokens}")
        self.evaluate, self.every, self.seq_len, self.path = evaluate, int(every_tokens), int(seq_len), Path(path)
        self.points: list[dict] = []
        self._checked_resume = False

    def _per_step(self, args) -> int:
        return args.per_device_train_batch_size * self.seq_len * args.gradient_accumulation_steps * args.world_size

    def _add(self, args, state, model, step: int) -> None:
        if state.is_world_process_zero:
            was_training = model.training
            model.eval()
            try:
                with own_forward(model):
                    point = {"tokens": step * self._per_step(args), "step": step, **self.evaluate(model)}
            finally:
                model.train(was_training)
            self.points.append(point)
            logger.info("recovery curve: %s", point)
            self._write()

    def _write(self) -> None:
        from sinv_prune.rundir import write_json

        write_json(self.path, null_non_finite(self.points)[0])

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        # A resumed fine-tune: the Trainer loads its step after this call; stale points go at the first step.
        self.points = json.loads(self.path.read_text()) if self.path.is_file() else []
        if not self.points:
            self._add(args, state, model, 0)

    def on_step_end(self, args, state, control, model=None, **kwargs):
        step = state.global_step
        if not self._checked_resume:
            self._checked_resume = True
            self.points = [p for p in self.points if p["step"] < step]
        per_step = self._per_step(args)
        if (step * per_step) // self.every > ((step - 1) * per_step) // self.every:
            self._add(args, state, model, step)

    def on_train_end(self, args, state, control, model=None, **kwargs):
        if not self.points or self.points[-1]["step"] != state.global_step:
            self._add(args, state, model, state.global_step)


@contextlib.contextmanager
def own_forward(model):
    """Within the block, ``model`` runs its own ``forward``: under the Trainer's mixed precision (``bf16``)
    accelerate replaces it by one wrapped in autocast, and a curve point must measure what the saved float32
    model computes, not its bfloat16 products."""
    original = model.__dict__.get("_original_forward")
    if original is None or "forward" not in model.__dict__:
        yield
        return
    wrapped = model.__dict__["forward"]
    model.forward = original
    try:
        yield
    finally:
        model.forward = wrapped


def curve_evaluator(run, masked_lm: bool) -> Callable:
    """``evaluate(model) -> {"perplexity": ..., task: value}`` on the run's evaluation text (see the module)."""
    from sinv_prune.pipeline.evaluation import mlm_loss, perplexity

    recipe, data = run.recipe, run.recipe.data
    ids = run.ids["test" if "test" in run.ids else "valid"]
    max_tokens = recipe.finetune.eval_max_tokens or data.max_eval_tokens
    batch_size = recipe.evaluate.window_batch_size

    def evaluate(model) -> dict:
        if masked_lm:
            res = mlm_loss(model, ids, seq_len=data.seq_len, seed=recipe.seed, batch_size=batch_size,
                           mask_token_id=run.tokenizer.mask_token_id, special_ids=tuple(run.tokenizer.all_special_ids),
                           max_tokens=max_tokens)  # fmt: skip
            return {"perplexity": res["mlm_perplexity"]}
        res = perplexity(model, ids, seq_len=data.seq_len, stride=data.eval_stride or data.seq_len,
                         batch_size=batch_size, max_tokens=max_tokens, progress=False)  # fmt: skip
        return {"perplexity": res["perplexity"], **_task_values(run, model)}

    return evaluate


def _task_values(run, model) -> dict:
    """The headline metric of each of ``evaluate.tasks`` (nothing when there are none)."""
    spec = run.recipe.evaluate
    if not spec.tasks or not run.recipe.finetune.eval_tasks:
        return {}
    from sinv_prune.lmeval import evaluate_tasks, headline
    from sinv_prune.pipeline.tasks import _task_set

    tasks, manager = _task_set(tuple(spec.tasks), str(run.recipe._base_dir), str(Path(run.root) / "tasks"))
    result = evaluate_tasks(model, run.tokenizer, tasks, num_fewshot=spec.num_fewshot, limit=spec.limit,
                            batch_size=spec.task_batch_size, task_manager=manager)  # fmt: skip
    return {name: shown[1] for name, metrics in result["tasks"].items() if (shown := headline(metrics))}


def plot_recovery(results: dict, path: Path) -> Path | None:
    """Perplexity against tokens seen, one line per arm with a curve (None when no arm has one)."""
    curves = [(a["name"], a["recovery_curve"]) for a in results["arms"] if a.get("recovery_curve")]
    if not curves:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from sinv_prune.pipeline.report_figure import _plain_y

    fig, ax = plt.subplots(figsize=(6.4, 4.4), dpi=120)
    values = []
    for i, (name, points) in enumerate(curves):
        shown = [(p["tokens"], p["perplexity"]) for p in points if p.get("perplexity") is not None]
        if shown:
            ax.plot(*zip(*shown, strict=True), marker="o", markersize=3, color=f"C{i % 10}", label=name)
            values += [v for _, v in shown]
    base = results["baseline"].get("perplexity")
    if base is not None:
        ax.axhline(base, color="black", linestyle="--", linewidth=1, label="baseline (unpruned, evaluate stage)")
        values.append(base)
    if values:
        _plain_y(ax, values)  # a log axis only when the values span more than a factor of 3
    ax.set_xlabel("fine-tune tokens seen")
    ax.set_ylabel("perplexity (lower is better)")
    ax.set_title("recovery during fine-tuning")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path

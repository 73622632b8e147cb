"""lm-evaluation-harness on an in-memory model: the one place ``lm_eval`` is imported.

``lm-eval`` is an optional extra (``pip install "sinv_prune[eval]"``);
:func:`~sinv_prune.lmeval.dependency.require_lm_eval` turns its absence into a one-line
:class:`~sinv_prune.lmeval.dependency.TasksError` naming that command.

A task entry (recipe ``evaluate.tasks``, ``sinv-prune eval --tasks``) is one of

* ``wikitext_lastword``: the offline task shipped here (:mod:`sinv_prune.lmeval.lastword`),
  built from the local WikiText-2 test text into a directory the caller owns;
* a directory of lm-eval task YAML files (local data: ``dataset_path: json`` with
  ``dataset_kwargs: {data_files: ...}``, relative paths read from the YAML's directory): every
  task defined in it;
* any other name: a task, group or tag of lm-eval's own registry (their data usually come from
  the Hub, which must then be reachable).

:func:`evaluate_tasks` wraps the model in ``HFLM(pretrained=model, tokenizer=...)`` (no reload
by id, so remote-code pruned and GGUF-loaded models evaluate as they are in memory) and calls
``lm_eval.simple_evaluate``. It returns each task's metrics with their standard errors, and the
pins that change numbers: lm-eval's version, each task's version, few-shot count, limit.
"""

from __future__ import annotations

import contextlib
import difflib
import io
import json
import logging
import os
import random
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sinv_prune.lmeval.dependency import TasksError, require_lm_eval
from sinv_prune.log_level import log_level
from sinv_prune.progress import bar

logger = logging.getLogger("sinv_prune")

#: lm-eval's batch size on the CPU when ``auto`` is asked: its detection times batches of up to 64
#: of the longest request five times, and finds no out-of-memory error to stop at on the CPU.
CPU_AUTO_BATCH_SIZE = 8
#: Bootstrap resamples for standard errors without a closed form (perplexity): lm-eval's default,
#: 100,000, takes minutes per task on a CPU and adds nothing at the precision a stderr is read.
BOOTSTRAP_ITERS = 1000


@dataclass
class TaskSet:
    """Resolved task entries: the names lm-eval evaluates and the directories that define some of them."""

    names: list[str] = field(default_factory=list)
    include: list[str] = field(default_factory=list)
    defaults: bool = False  # whether lm-eval's own registry is needed (5 s to index)
    builds: dict[str, dict] = field(default_factory=dict)  # built tasks: their build.json

    def task_manager(self):
        """lm-eval's ``TaskManager`` over the directories (and its own tasks only where needed)."""
        require_lm_eval()
        from lm_eval.tasks import TaskManager

        manager = TaskManager(include_path=self.include or None, include_defaults=self.defaults)
        return _data_files_from_yaml_dir(manager)


def _data_files_from_yaml_dir(manager):
    """Make each task YAML's relative ``dataset_kwargs.data_files`` resolve from the YAML's directory.

    lm-eval hands them to ``datasets.load_dataset`` as written, which reads them from the working
    directory: a task directory would work only when run from where its author stood. Every task and
    group config passes through the manager's factory (lm-eval 0.4.13), where the paths are made
    absolute from the directory of the YAML that defines the task.
    """
    factory = getattr(manager, "_factory", None)
    load = getattr(factory, "_load_full_config", None)
    if load is None:
        logger.warning("this lm-eval has no TaskFactory._load_full_config: task YAMLs' relative data_files "
                       "are read from the working directory")  # fmt: skip
        return manager

    def load_full_config(entry, overrides=None):
        config = load(entry, overrides)
        path = getattr(entry, "yaml_path", None)
        return with_data_files_from(config, Path(path).parent) if path else config

    factory._load_full_config = load_full_config
    return manager


def with_data_files_from(config: dict, base_dir: Path) -> dict:
    """``config`` with its relative ``dataset_kwargs.data_files`` (str, list or split -> either) under ``base_dir``."""
    kwargs = config.get("dataset_kwargs")
    if not isinstance(kwargs, dict) or not kwargs.get("data_files"):
        return config

    def absolute(file):
        if not isinstance(file, str) or "://" in file:  # URLs (hf://, https://) stay as they are
            return file
        path = Path(file).expanduser()
        return str(path if path.is_absolute() else base_dir / path)

    def each(files):
        return [absolute(f) for f in files] if isinstance(files, (list, tuple)) else absolute(files)

    files = kwargs["data_files"]
    files = {split: each(f) for split, f in files.items()} if isinstance(files, dict) else each(files)
    return {**config, "dataset_kwargs": {**kwargs, "data_files": files}}


def _entry_dir(entry: str, base_dir: Path) -> Path | None:
    """The directory ``entry`` names (relative to ``base_dir``), None for a task name."""
    path = Path(entry).expanduser()
    path = path if path.is_absolute() else base_dir / path
    if path.exists() or "/" in entry or entry.startswith((".", "~")) or os.sep in entry:
        return path
    return None


def _dir_tasks(path: Path, where: str) -> list[str]:
    from lm_eval.tasks import TaskManager

    if not path.exists():
        raise TasksError(f"{where}: no such task directory: {path}")
    if not path.is_dir():
        raise TasksError(f"{where}: {path} is a file; give the directory that holds lm-eval task YAML files")
    names = TaskManager(include_path=str(path), include_defaults=False).all_subtasks
    if not names:
        raise TasksError(f"{where}: no lm-eval task (a YAML file with a 'task:' key) in {path}")
    return names


def resolve_tasks(
    entries: list[str], base_dir: str | os.PathLike = ".", *, build_dir: str | os.PathLike | None = None,
    where: str = "tasks",
) -> TaskSet:  # fmt: skip
    """Check ``entries`` and resolve them to a :class:`TaskSet`; ``TasksError`` naming ``where[i]`` if one is bad.

    ``build_dir`` None checks only (nothing is written: the preflight); otherwise the shipped
    tasks are built there.
    """
    from sinv_prune.lmeval import lastword

    try:
        require_lm_eval()
    except TasksError as err:
        raise TasksError(f"{where}: {err}") from None
    base_dir = Path(base_dir)
    out = TaskSet()
    named: list[tuple[str, str]] = []
    for i, entry in enumerate(entries):
        here = f"{where}[{i}]"
        if entry == lastword.TASK_NAME:
            try:
                if build_dir is None:
                    lastword.source_file()
                    built = None
                else:
                    built = lastword.build_lastword_task(build_dir)
            except (FileNotFoundError, ValueError) as err:
                raise TasksError(f"{here}: {err}") from None
            if built is not None:
                out.include.append(str(built))
                out.builds[entry] = json.loads((built / "build.json").read_text())
            out.names.append(entry)
            continue
        path = _entry_dir(entry, base_dir)
        if path is not None:
            out.names += _dir_tasks(path, here)
            out.include.append(str(path.resolve()))
        else:
            named.append((here, entry))
            out.names.append(entry)
    if named:
        out.defaults = True
        known = set(out.task_manager().all_tasks)
        for here, name in named:
            if name not in known:
                close = difflib.get_close_matches(name, sorted(known), n=3)
                hint = f"; did you mean {', '.join(close)}?" if close else ""
                raise TasksError(f"{here}: unknown lm-eval task {name!r}{hint}")
    dupes = sorted({n for n in out.names if out.names.count(n) > 1})
    if dupes:
        raise TasksError(f"{where}: task {dupes[0]!r} is asked for twice")
    return out


def resolve_batch_size(batch_size: int | str, device) -> int | str:
    """``auto`` is lm-eval's own detection on an accelerator, :data:`CPU_AUTO_BATCH_SIZE` on the CPU."""
    if batch_size != "auto":
        return int(batch_size)
    return CPU_AUTO_BATCH_SIZE if str(device).startswith("cpu") else "auto"


def evaluate_tasks(
    model,
    tokenizer,
    tasks: TaskSet,
    *,
    num_fewshot: int | None = 0,
    limit: int | float | None = None,
    batch_size: int | str = "auto",
    bootstrap_iters: int = BOOTSTRAP_ITERS,
    task_manager=None,
) -> dict[str, Any]:
    """Evaluate the in-memory ``model`` on ``tasks`` with lm-eval; the model stays where it is.

    Returns ``{"tasks": {name: {metric: value, metric_stderr: value, ..., "samples": n}},
    "pins": {...}, "lm_eval": lm-eval's own result dict}``. Metrics keep lm-eval's names
    (``acc``, ``acc_norm``, ``perplexity``; a filter other than ``none`` stays in the name,
    ``exact_match,strict-match``). Python, NumPy and torch random states are restored after.
    """
    require_lm_eval()
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM

    batch = resolve_batch_size(batch_size, model.device)
    with _quiet_lm_eval(), _lm_eval_bars(), _keep_rng():
        lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch)
        raw = simple_evaluate(
            model=lm,
            tasks=list(tasks.names),
            num_fewshot=num_fewshot,
            limit=limit,
            bootstrap_iters=bootstrap_iters,
            task_manager=task_manager or tasks.task_manager(),
            log_samples=False,
        )
    per_task = {name: task_metrics(raw["results"][name]) for name in raw["results"]}
    for name, row in per_task.items():
        samples = raw.get("n-samples", {}).get(name)
        if samples:
            row["samples"] = samples["effective"]
    return {"tasks": per_task, "pins": pins(raw, tasks, num_fewshot, limit, batch, bootstrap_iters), "lm_eval": raw}


def task_metrics(entry: dict) -> dict[str, float | None]:
    """lm-eval's ``{"acc,none": x, "acc_stderr,none": s, "alias": ...}`` -> ``{"acc": x, "acc_stderr": s}``."""
    out: dict[str, float | None] = {}
    for key, value in entry.items():
        if "," not in key:
            continue  # alias, name, sample_len
        metric, _, filt = key.partition(",")
        name = metric if filt == "none" else key
        out[name] = float(value) if isinstance(value, (int, float)) else None  # "N/A" stderrs
    return out


def pins(raw: dict, tasks: TaskSet, num_fewshot, limit, batch_size, bootstrap_iters: int) -> dict[str, Any]:
    """What changes the numbers: lm-eval's version, each task's version, few-shot count, limit, ..."""
    import lm_eval

    per_task = {}
    for name in raw["results"]:
        per_task[name] = {
            "version": raw.get("versions", {}).get(name),
            "num_fewshot": raw.get("n-shot", {}).get(name),
            "samples": raw.get("n-samples", {}).get(name),
            "higher_is_better": raw.get("higher_is_better", {}).get(name),
        }
    children = {c for subtasks in (raw.get("group_subtasks") or {}).values() for c in subtasks}
    return {
        "lm_eval_version": raw.get("lm_eval_version") or getattr(lm_eval, "__version__", None),
        # the report's columns: every result that is not inside a group (a group shows its aggregate)
        "columns": [name for name in raw["results"] if name not in children],
        "num_fewshot": num_fewshot,
        "limit": limit,
        "batch_size": batch_size,
        "bootstrap_iters": bootstrap_iters,
        "tasks": per_task,
        "task_dirs": list(tasks.include),
        "builds": dict(tasks.builds),
    }


HEADLINE_METRICS = ("acc_norm", "acc")


def headline(metrics: dict) -> tuple[str, float] | None:
    """The metric a task's report column shows: ``acc_norm`` where lm-eval reports it, else ``acc``."""
    for name in HEADLINE_METRICS:
        if metrics.get(name) is not None:
            return name, metrics[name]
    return None


def make_table(result: dict) -> str:
    """lm-eval's own markdown table of an :func:`evaluate_tasks` result."""
    from lm_eval.utils import make_table as lm_make_table

    return lm_make_table(result["lm_eval"])


def lm_eval_chatty() -> bool:
    """Whether lm-eval may talk: its logger set to INFO or lower by the caller (``sinv-prune -v`` does)."""
    return logging.NOTSET < logging.getLogger("lm_eval").level <= logging.INFO


@contextlib.contextmanager
def _quiet_lm_eval():
    """lm-eval's chatter off unless :func:`lm_eval_chatty`: its log lines below ERROR (the warnings about
    a model passed as an object are expected here), its prints ("bootstrapping for stddev") and the
    datasets library's bars while it loads task data. Bootstrap in-process."""
    import datasets

    env = os.environ.get("DISABLE_MULTIPROC")
    os.environ["DISABLE_MULTIPROC"] = "1"  # no process pool forked from a process holding a model
    datasets_bars = datasets.is_progress_bar_enabled()
    chatty = lm_eval_chatty()
    try:
        with contextlib.ExitStack() as stack:
            if not chatty:
                stack.enter_context(log_level("lm_eval", logging.ERROR))
                stack.enter_context(contextlib.redirect_stdout(io.StringIO()))
                datasets.disable_progress_bars()
            yield
    finally:
        if not chatty and datasets_bars:
            datasets.enable_progress_bars()
        if env is None:
            os.environ.pop("DISABLE_MULTIPROC", None)
        else:
            os.environ["DISABLE_MULTIPROC"] = env


def _lm_eval_bar(iterable=None, desc: str | None = None, total=None, **kwargs):
    """tqdm's signature for lm-eval's bars, drawn by :func:`sinv_prune.progress.bar` (bars, notes or nothing)."""
    return bar(iterable, desc=desc or "lm-eval", total=total, **kwargs)


@contextlib.contextmanager
def _lm_eval_bars():
    """lm-eval's own tqdm bars (``from tqdm import tqdm`` in its modules, some inside functions) go through
    :func:`sinv_prune.progress.bar` for the block: a quiet run shows none, a log gets note lines."""
    import tqdm

    original = tqdm.tqdm
    modules = [m for name, m in list(sys.modules.items()) if name.split(".")[0] == "lm_eval"
               and getattr(m, "tqdm", None) is original]  # fmt: skip
    tqdm.tqdm = _lm_eval_bar
    for module in modules:
        module.tqdm = _lm_eval_bar
    try:
        yield
    finally:
        tqdm.tqdm = original
        for module in modules:
            module.tqdm = original


@contextlib.contextmanager
def _keep_rng():
    """simple_evaluate seeds Python, NumPy and torch; the caller's random streams go on as before."""
    import numpy as np
    import torch

    state, np_state = random.getstate(), np.random.get_state()
    with torch.random.fork_rng():
        try:
            yield
        finally:
            random.setstate(state)
            np.random.set_state(np_state)

"""Zero-shot tasks through lm-evaluation-harness (the ``[eval]`` extra) and the offline last-word task.

See :mod:`sinv_prune.lmeval.harness` (running lm-eval on an in-memory model) and
:mod:`sinv_prune.lmeval.lastword` (the WikiText-2 last-word task). Importing this package does
not import ``lm_eval``.
"""

from sinv_prune.lmeval.dependency import PIP_COMMAND, TasksError, require_lm_eval
from sinv_prune.lmeval.harness import TaskSet, evaluate_tasks, headline, make_table, resolve_tasks
from sinv_prune.lmeval.lastword import TASK_NAME as LASTWORD_TASK
from sinv_prune.lmeval.lastword import build_lastword_task

__all__ = [
    "LASTWORD_TASK",
    "PIP_COMMAND",
    "TaskSet",
    "TasksError",
    "build_lastword_task",
    "evaluate_tasks",
    "headline",
    "make_table",
    "require_lm_eval",
    "resolve_tasks",
]

"""The optional-dependency check: lm-eval (the ``[eval]`` extra) present, or a one-line error naming the pip command.

Its own module so that the harness and the shipped last-word task both check it without importing
each other.
"""

from __future__ import annotations

PIP_COMMAND = 'pip install "sinv_prune[eval]"'


class TasksError(ValueError):
    """A task list that cannot run (lm-eval missing, unknown task, empty directory); one line."""


def require_lm_eval():
    """The ``lm_eval`` module, or :class:`TasksError` with the pip command when it is not installed."""
    try:
        import lm_eval
    except ImportError:
        raise TasksError(f"lm-eval is not installed; run: {PIP_COMMAND}") from None
    return lm_eval

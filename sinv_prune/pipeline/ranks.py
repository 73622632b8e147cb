"""Which process does what under ``torchrun`` / ``accelerate launch`` (one process: all of it).

The recipe pipeline runs every stage on the main process and only training on every rank
(through ``transformers.Trainer``, which shards the data and averages gradients). The process
group is accelerate's :class:`~accelerate.PartialState`, the one the Trainer uses too: ``gloo``
when the run's device is the CPU, ``nccl`` on CUDA. Without a launcher (no ``WORLD_SIZE`` > 1)
nothing is initialised and every helper here is a no-op.

While the main process works alone (scoring, a ``shrink`` search, a teacher cache, the evaluation:
hours on a large model) the other processes wait in a collective, which torch gives up on after the
process group's timeout (30 minutes for gloo, 10 for NCCL by default). The group is made with
:data:`TIMEOUT_S` (``SINV_PRUNE_DDP_TIMEOUT``, seconds; default 24 hours) instead: a process that dies
still stops the launch at once (``torchrun`` ends the others).
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

#: Seconds a collective may wait (the process group's timeout), from ``SINV_PRUNE_DDP_TIMEOUT``.
TIMEOUT_S = 24 * 3600


def timeout_s() -> float:
    """The process group's timeout in seconds: ``SINV_PRUNE_DDP_TIMEOUT`` or :data:`TIMEOUT_S`."""
    given = os.environ.get("SINV_PRUNE_DDP_TIMEOUT")
    if given is None:
        return TIMEOUT_S
    try:
        value = float(given)
    except ValueError:
        value = -1.0
    if value <= 0:
        from sinv_prune.pipeline.recipe import RecipeError  # bad input before any work: the CLI's exit code 2

        raise RecipeError(f"SINV_PRUNE_DDP_TIMEOUT: {given!r} is not a positive number of seconds")
    return value


def launched() -> bool:
    """True when a launcher started several processes (``WORLD_SIZE`` > 1 in the environment)."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def main_by_env() -> bool:
    """Whether this is the main process, from the launcher's ``RANK`` (before any process group exists)."""
    return int(os.environ.get("RANK", "0")) == 0


class Ranks:
    """This process's place in the launch: ``world_size``, ``is_main`` and ``on_main(fn)`` (a barrier)."""

    def __init__(self, device: str = "cpu"):
        self._state = None
        if launched():
            from datetime import timedelta

            from accelerate import PartialState

            # cpu=True makes accelerate pick gloo, as TrainingArguments(use_cpu=True) does.
            self._state = PartialState(cpu=str(device) == "cpu", timeout=timedelta(seconds=timeout_s()))

    @property
    def world_size(self) -> int:
        return self._state.num_processes if self._state is not None else 1

    @property
    def is_main(self) -> bool:
        return self._state is None or self._state.is_main_process

    def on_main(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the main process only; every process returns its result or raises its error.

        The result (or exception) is broadcast, so this is also a barrier, and an error on the main
        process stops the others with the same error instead of leaving them waiting.
        """
        if self.world_size == 1:
            return fn()
        import torch.distributed as dist

        box: list[Any] = [None]
        error = None
        if self.is_main:
            try:
                box[0] = (True, fn())
            except BaseException as err:  # noqa: BLE001 - re-raised below, and on the other ranks
                error = err
                box[0] = (False, _picklable(err))
        dist.broadcast_object_list(box, src=0)
        if error is not None:
            raise error
        ok, value = box[0]
        if not ok:
            raise value
        return value


def _picklable(err: BaseException) -> BaseException:
    """``err``, or a RuntimeError with its message when it cannot travel to the other processes."""
    try:
        pickle.dumps(err)
    except Exception:  # noqa: BLE001 - any pickling failure
        return RuntimeError(f"{type(err).__name__}: {err}")
    return err

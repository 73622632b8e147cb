"""``ConvergenceCallback``: measuring, stopping and freezing inside ``transformers.Trainer``."""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

from transformers import TrainerCallback

from sinv_prune.pipeline.tracking.freezer import HeadFreezer
from sinv_prune.pipeline.tracking.rule import (
    DEFAULT_EVERY_N_STEPS,
    DEFAULT_RULE_MEASURES,
    DEFAULT_THRESHOLD,
    DEFAULT_TRACE_NAME,
    OVERHEAD_WARNING,
    _flat,
    log_scalars,
    rule_max,
    stop_rule,
    track,
)
from sinv_prune.scoring.trace import append_trace

logger = logging.getLogger(__name__)


# -- the callback -----------------------------------------------------------------------------


class ConvergenceCallback(TrainerCallback):
    """Tracks the S-invariant measures during ``Trainer`` training; optional stop and freeze.

    Args:
        trace_path: JSON-lines trace to append to; default ``{output_dir}/sinv_trace.jsonl``.
        every_n_steps: measure every this many optimizer steps (``0``/``None``: only at epoch
            ends). The default keeps the overhead under 2% on the models benchmarked in
            ``scripts/bench_measures.py``; the measuring time is recorded and the callback warns
            at the end of training when it took more than 2% of the training time.
        on_epoch_end: also measure at each epoch end (skipped if that step was just measured).
        on_train_begin: measure once before the first step (the initial baseline; the rule is
            not evaluated on it).
        threshold: the stopping threshold (paper: 0.05).
        measures: the measures the stopping rule requires below ``threshold`` (``None`` values ignored).
        stop: set ``control.should_training_stop`` when the rule fires. With ``stop=False`` the
            rule is still evaluated and its firing written to the trace and the log.
        freeze_converged: freeze a head's Q/K/V/O slices once its ``C_Q`` is below
            ``freeze_threshold`` (default: ``threshold``); see :class:`HeadFreezer`.
        keys: the measures to compute (default: all of ``head_measures``, with the per-expert
            ``C_FF_experts`` for a model with experts); must include the rule's ``measures``
            (and ``C_Q`` when freezing).
        log_to_trainer: add summary scalars (:func:`log_scalars`) to the Trainer's logs. They
            reach the Trainer's ``log_history`` and every callback called after this one;
            reporting integrations (TensorBoard, W&B) are created before user callbacks, so
            use :meth:`attach` to put this callback in front of them.
        log_per_layer: include per-layer ``C_Q`` mean / max among the scalars.

    Trace lines: a ``{"event": "train_begin", ...}`` note with the settings, measurement lines
    ``{"step", "epoch", "when", "loss", "loss_step", "eval_loss", "eval_loss_step", **measures}``
    (loss fields: the latest value in ``state.log_history`` and the step it was logged at,
    when there is one), ``{"event": "heads_frozen"}`` notes, ``{"event": "stop_rule_fired"}``
    when the rule first holds, and at the end ``{"event": "stop_rule_not_fired"}`` if it never did.
    """

    def __init__(
        self,
        trace_path: str | os.PathLike | None = None,
        every_n_steps: int | None = DEFAULT_EVERY_N_STEPS,
        *,
        on_epoch_end: bool = True,
        on_train_begin: bool = True,
        threshold: float = DEFAULT_THRESHOLD,
        measures: Sequence[str] = DEFAULT_RULE_MEASURES,
        stop: bool = False,
        freeze_converged: bool = False,
        freeze_threshold: float | None = None,
        keys: Iterable[str] | None = None,
        log_to_trainer: bool = True,
        log_per_layer: bool = True,
    ):
        self.trace_path = Path(trace_path) if trace_path is not None else None
        self.every_n_steps = int(every_n_steps or 0)
        self.measure_on_epoch_end = on_epoch_end
        self.measure_on_train_begin = on_train_begin
        self.threshold = float(threshold)
        self.measures = tuple(measures)
        self.stop = stop
        self.freeze_converged = freeze_converged
        self.freeze_threshold = self.threshold if freeze_threshold is None else float(freeze_threshold)
        self.keys = None if keys is None else tuple(keys)
        if self.keys is not None:
            needed = set(self.measures) | ({"C_Q"} if freeze_converged else set())
            if needed - set(self.keys):
                raise ValueError(f"keys {self.keys} must include {sorted(needed - set(self.keys))}")
        self.log_to_trainer = log_to_trainer
        self.log_per_layer = log_per_layer
        self._reset()

    def _reset(self) -> None:
        self.records: list[dict] = []  # measurement records of this run (kept in memory)
        self.fired_at: int | None = None
        self.freezer: HeadFreezer | None = None
        self._last_step: int | None = None
        self._unlogged: dict[str, float] | None = None
        self._closest: tuple[float, int] | None = None  # (smallest rule_max, its step)
        self._measure_seconds = 0.0
        self._train_start = 0.0
        self._write = True

    def attach(self, trainer) -> ConvergenceCallback:
        """Add this callback to ``trainer`` ahead of its other callbacks, so that the reporting
        integrations (TensorBoard, W&B, ...) see the scalars it adds to the logs; returns self."""
        trainer.callback_handler.callbacks.insert(0, self)
        return self

    # -- events ---------------------------------------------------------------------------
    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self._reset()
        self._write = state.is_world_process_zero
        if self.trace_path is None:
            self.trace_path = Path(args.output_dir) / DEFAULT_TRACE_NAME
        if self._write:
            self.trace_path.parent.mkdir(parents=True, exist_ok=True)
            self._note(
                {
                    "event": "train_begin",
                    "step": state.global_step,
                    "threshold": self.threshold,
                    "measures": list(self.measures),
                    "every_n_steps": self.every_n_steps,
                    "stop": self.stop,
                    "freeze_converged": self.freeze_converged,
                    "freeze_threshold": self.freeze_threshold if self.freeze_converged else None,
                }
            )
        if self.freeze_converged:
            self.freezer = HeadFreezer(model)
        self._train_start = time.perf_counter()
        if self.measure_on_train_begin:
            self._measure(args, state, control, model, when="train_begin", rule=False)

    def on_optimizer_step(self, args, state, control, **kwargs):
        if self.freezer is not None and any(self.freezer.frozen):
            self.freezer.restore()

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if self.every_n_steps and state.global_step % self.every_n_steps == 0:
            self._measure(args, state, control, model, when="step")

    def on_epoch_end(self, args, state, control, model=None, **kwargs):
        if self.measure_on_epoch_end:
            self._measure(args, state, control, model, when="epoch_end")

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not self.log_to_trainer or self._unlogged is None or logs is None:
            return
        scalars, self._unlogged = self._unlogged, None
        logs.update(scalars)
        # Trainer.log appended a copy of ``logs`` to log_history before calling us: update it too.
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(scalars)

    def on_train_end(self, args, state, control, model=None, **kwargs):
        if self._last_step != state.global_step and model is not None:
            self._measure(args, state, control, model, when="train_end", rule=self.fired_at is None)
        elapsed = time.perf_counter() - self._train_start
        overhead = self._measure_seconds / elapsed if elapsed > 0 else None
        timing = {
            "measure_seconds_total": round(self._measure_seconds, 4),
            "train_seconds": round(elapsed, 4),
            "overhead": None if overhead is None else round(overhead, 5),
        }
        if self.fired_at is None:
            closest, at = self._closest if self._closest else (None, None)
            final = self.records[-1] if self.records else None
            note = {
                "event": "stop_rule_not_fired",
                "step": state.global_step,
                "epoch": state.epoch,
                "threshold": self.threshold,
                "measures": list(self.measures),
                "min_max_measure": closest,
                "min_max_step": at,
                "final_max": _per_measure_max(final, self.measures) if final else None,
                **timing,
            }
            self._note(note)
            logger.info(
                "sinv_prune: stopping rule never fired (threshold %.3g); closest max measure %s at step %s",
                self.threshold,
                _fmt(closest),
                at,
            )
        else:
            self._note({"event": "train_end", "step": state.global_step, "epoch": state.epoch, **timing})
        if overhead is not None and overhead > OVERHEAD_WARNING and elapsed > 10:
            logger.warning(
                "sinv_prune: convergence tracking took %.1f%% of the training time; raise every_n_steps (now %d)",
                100 * overhead,
                self.every_n_steps,
            )
        if self.freezer is not None:
            self.freezer.remove()

    # -- internals -----------------------------------------------------------------------
    def _note(self, note: dict) -> None:
        if self._write and self.trace_path is not None:
            append_trace(self.trace_path, note)

    def _measure(self, args, state, control, model, *, when: str, rule: bool = True) -> None:
        step = state.global_step
        if model is None or self._last_step == step:
            return
        self._last_step = step
        start = time.perf_counter()
        fields = {"when": when, **_latest(state.log_history, "loss"), **_latest(state.log_history, "eval_loss")}
        record = track(model, None, step, state.epoch, keys=self.keys, **fields)
        if self.freezer is not None:
            newly = self.freezer.freeze_below(record, self.freeze_threshold)
            record["frozen"] = self.freezer.frozen_heads()
            if newly:
                self._note(
                    {
                        "event": "heads_frozen",
                        "step": step,
                        "epoch": state.epoch,
                        "heads": {str(k): v for k, v in newly.items()},
                        "threshold": self.freeze_threshold,
                    }
                )
                logger.info("sinv_prune: froze heads %s at step %d", newly, step)
        if self._write:
            append_trace(self.trace_path, record)
        self.records.append(record)
        if self.log_to_trainer:
            self._unlogged = log_scalars(record, per_layer=self.log_per_layer, measures=self.measures)
        if rule and self.fired_at is None:
            top = rule_max(record, self.measures)
            if top is not None and not math.isnan(top) and (self._closest is None or top < self._closest[0]):
                self._closest = (top, step)
            if stop_rule(record, self.threshold, self.measures):
                self.fired_at = step
                self._note(
                    {
                        "event": "stop_rule_fired",
                        "step": step,
                        "epoch": state.epoch,
                        "threshold": self.threshold,
                        "measures": list(self.measures),
                        "max_measure": top,
                        "stopped": self.stop,
                    }
                )
                logger.warning(
                    "sinv_prune: stopping rule fired at step %d (epoch %s): every %s value is below %.3g (max %.4g)%s",
                    step,
                    _fmt(state.epoch),
                    "/".join(self.measures),
                    self.threshold,
                    top,
                    "; stopping training" if self.stop else "; stop=False, training continues",
                )
                if self.stop:
                    control.should_training_stop = True
        self._measure_seconds += time.perf_counter() - start


def _latest(history: list[dict], key: str) -> dict:
    for entry in reversed(history):
        if key in entry:
            return {key: entry[key], f"{key}_step": entry.get("step")}
    return {}


def _per_measure_max(record: dict, measures: Sequence[str]) -> dict[str, float | None]:
    out = {}
    for m in measures:
        vals = _flat(record.get(m))
        out[m] = max(vals) if vals else None
    return out


def _fmt(x) -> str:
    return "n/a" if x is None else f"{x:.4g}"

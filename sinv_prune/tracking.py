"""Convergence tracking during training: a ``TrainerCallback``, the paper's stopping rule, head freezing.

The NN6 paper stops training "when all measures fall below 0.05" and freezes heads that
have converged. This module measures :func:`sinv_prune.measures.head_measures` every
``every_n_steps`` optimizer steps (and at each epoch end), appends each measurement to a
JSON-lines trace (:mod:`sinv_prune.trace`), puts summary scalars into the Trainer's logs,
and, on request, stops training or freezes converged heads.

* :func:`stop_rule` -- the rule on one measurement record: every value of every chosen
  measure is below the threshold (``None`` values are ignored).
* :func:`track` -- measure, append to a trace, return the record (for custom loops).
* :class:`HeadFreezer` -- keeps chosen heads' Q/K/V/O slices fixed during training.
* :class:`ConvergenceCallback` -- all of the above inside ``transformers.Trainer``.

Measured values so far (SmolLM2-135M: C_Q 0.55-0.92; a tiny GPT-2 after 600 steps:
0.65-0.74; random init ~0.71) are far from 0.05, so the rule usually never fires: the
callback then writes a ``stop_rule_not_fired`` note telling how close the run came.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch
from torch import nn
from transformers import TrainerCallback

from sinv_prune.arch import get_adapter
from sinv_prune.measures import head_measures
from sinv_prune.trace import append_trace

logger = logging.getLogger(__name__)

#: The paper's stopping threshold ("all layers C < 0.05").
DEFAULT_THRESHOLD = 0.05
#: Measures the stopping rule looks at by default (the paper's C_Q, C_V, C_FF).
DEFAULT_RULE_MEASURES = ("C_Q", "C_V", "C_FF")
#: Default measuring interval in optimizer steps (see scripts/bench_measures.py for the overhead).
DEFAULT_EVERY_N_STEPS = 50
#: Overhead above which the callback warns at the end of training.
OVERHEAD_WARNING = 0.02
#: Name of the trace file written to ``args.output_dir`` when no ``trace_path`` is given.
DEFAULT_TRACE_NAME = "sinv_trace.jsonl"


# -- the rule -------------------------------------------------------------------------------


def _flat(values) -> list[float]:
    """Every number in a nested list (``None`` skipped)."""
    if values is None:
        return []
    if isinstance(values, (int, float)):
        return [float(values)]
    out: list[float] = []
    for v in values:
        out.extend(_flat(v))
    return out


def _rule_values(record: dict, measures: Sequence[str]) -> dict[str, list[float]]:
    missing = [m for m in measures if m not in record]
    if missing:
        have = sorted(k for k in record if k.startswith("C_"))
        raise ValueError(f"measurement record lacks {missing}; it has {have}")
    return {m: _flat(record[m]) for m in measures}


def rule_max(record: dict, measures: Sequence[str] = DEFAULT_RULE_MEASURES) -> float | None:
    """The largest value of the chosen measures in ``record`` (the number compared to the
    threshold), ``nan`` if any value is NaN, ``None`` if the record holds no values at all."""
    values = [v for vs in _rule_values(record, measures).values() for v in vs]
    if not values:
        return None
    return math.nan if any(math.isnan(v) for v in values) else max(values)


def stop_rule(
    record: dict, threshold: float = DEFAULT_THRESHOLD, measures: Sequence[str] = DEFAULT_RULE_MEASURES
) -> bool:
    """The paper's stopping rule on one measurement record: every value of every measure in
    ``measures`` is strictly below ``threshold``.

    ``None`` entries (a measure undefined for that layer) are ignored; a NaN counts as not
    converged; a record with no value at all in the chosen measures does not fire. A measure
    name absent from the record raises ``ValueError`` (a typo must not read as "converged").
    """
    top = rule_max(record, measures)
    return top is not None and not math.isnan(top) and top < threshold


# -- summary scalars --------------------------------------------------------------------------


def log_scalars(
    record: dict, *, per_layer: bool = True, measures: Sequence[str] = DEFAULT_RULE_MEASURES, prefix: str = "sinv"
) -> dict[str, float]:
    """Flat ``{name: float}`` summary of a record for Trainer logs (TensorBoard, W&B, ...).

    ``{prefix}/{measure}_max`` and ``_mean`` for every measure in the record,
    ``{prefix}/rule_max`` (the largest value the stopping rule looks at) and, with
    ``per_layer``, ``{prefix}/layer_{i:02d}/C_Q_mean`` and ``.../C_Q_max``.
    """
    out: dict[str, float] = {}
    for key, value in record.items():
        if not key.startswith("C_") or not isinstance(value, list):
            continue
        flat = [v for v in _flat(value) if not math.isnan(v)]
        if flat:
            out[f"{prefix}/{key}_max"] = max(flat)
            out[f"{prefix}/{key}_mean"] = math.fsum(flat) / len(flat)
    present = [m for m in measures if m in record]
    if present:
        top = rule_max(record, present)
        if top is not None:
            out[f"{prefix}/rule_max"] = top
    if per_layer and isinstance(record.get("C_Q"), list):
        for i, heads in enumerate(record["C_Q"]):
            vals = [v for v in _flat(heads) if not math.isnan(v)]
            if vals:
                out[f"{prefix}/layer_{i:02d}/C_Q_mean"] = math.fsum(vals) / len(vals)
                out[f"{prefix}/layer_{i:02d}/C_Q_max"] = max(vals)
    if "frozen" in record:
        out[f"{prefix}/frozen_heads"] = float(sum(len(h) for h in record["frozen"]))
    return out


# -- measuring --------------------------------------------------------------------------------


def track(
    model: nn.Module,
    trace_path: str | os.PathLike | None,
    step: int,
    epoch: float | None = None,
    *,
    keys: Iterable[str] | None = None,
    **fields,
) -> dict:
    """Measure ``model`` now and append the record to ``trace_path`` (skipped when ``None``).

    The record is ``{"step", "epoch", **fields, **head_measures(model, keys)}`` plus
    ``"measure_seconds"``; ``fields`` carries extra numbers for the line (``loss=...``,
    ``eval_loss=...``). For a custom loop::

        for step, batch in enumerate(loader, 1):
            ...; optimizer.step()
            if step % 50 == 0:
                record = track(model, "trace.jsonl", step, loss=loss.item())
                if stop_rule(record):
                    break
    """
    start = time.perf_counter()
    measures = head_measures(model, keys)
    record = {
        "step": int(step),
        "epoch": epoch,
        **fields,
        **measures,
        "measure_seconds": round(time.perf_counter() - start, 6),
    }
    if trace_path is not None:
        append_trace(trace_path, record)
    return record


# -- freezing ---------------------------------------------------------------------------------


class HeadFreezer:
    """Keeps chosen heads' Q, K, V and O slices (weights and biases) fixed during training.

    Two mechanisms together:

    * gradient hooks on the attention parameters zero the frozen rows / columns of each
      gradient, so frozen slices add nothing to gradient norms (clipping) or to optimizer
      moment estimates from the moment they are frozen;
    * :meth:`restore` writes the values saved at freezing time back into the frozen
      slices. Call it after every ``optimizer.step()`` (the callback does, in
      ``on_optimizer_step``; :meth:`attach_optimizer` registers it as an optimizer
      post-step hook for custom loops). Zero gradients alone do not keep a weight fixed:
      AdamW's momentum keeps moving it for a while after its gradient stops, and decoupled
      weight decay shrinks it regardless; restoring makes the freeze exact whatever the
      optimizer.

    Under grouped-query attention a key/value head's slices are frozen only when every
    query head it serves is frozen. The output projection's bias is shared by all heads and
    never frozen. Slices are located through the adapter's ``projections`` views, mapped back
    to storage offsets of the owning parameters, so fused (GPT-2 ``c_attn``) and transposed
    (``Conv1D``) layouts need no special case. Single-device / DDP training only (not
    FSDP / DeepSpeed ZeRO sharded parameters); the model must not be pruned while frozen.
    """

    def __init__(self, model: nn.Module):
        self.model = model
        self.adapter = get_adapter(model)
        self.frozen: list[set[int]] = [set() for _ in range(self.adapter.num_layers)]
        self._masks: dict[nn.Parameter, torch.Tensor] = {}  # param -> bool mask of frozen elements
        self._saved: dict[nn.Parameter, torch.Tensor] = {}  # param -> frozen values (mask order)
        self._handles: list = []
        self._hooked: set[int] = set()

    # public -----------------------------------------------------------------
    def freeze(self, layer: int, heads: Iterable[int]) -> list[int]:
        """Freeze query heads ``heads`` of ``layer`` at their current values; returns the newly frozen ones."""
        num = self.adapter.layout(layer).num_heads
        new = sorted({int(h) for h in heads} - self.frozen[layer])
        bad = [h for h in new if not 0 <= h < num]
        if bad:
            raise ValueError(f"layer {layer} has {num} heads; cannot freeze {bad}")
        if new:
            self.frozen[layer].update(new)
            self._rebuild(layer)
        return new

    def freeze_below(self, record: dict, threshold: float, measure: str = "C_Q") -> dict[int, list[int]]:
        """Freeze every head whose ``record[measure]`` is below ``threshold``; returns the newly frozen heads."""
        newly = {}
        for layer, values in enumerate(record[measure]):
            heads = [h for h, v in enumerate(values) if v is not None and v < threshold]
            added = self.freeze(layer, heads) if heads else []
            if added:
                newly[layer] = added
        return newly

    def frozen_heads(self) -> list[list[int]]:
        return [sorted(s) for s in self.frozen]

    @torch.no_grad()
    def restore(self) -> None:
        """Write the saved values back into every frozen slice."""
        for param, mask in self._masks.items():
            param.masked_scatter_(mask, self._saved[param])

    def attach_optimizer(self, optimizer: torch.optim.Optimizer):
        """Call :meth:`restore` after every ``optimizer.step()``; returns the hook handle."""
        handle = optimizer.register_step_post_hook(lambda *_: self.restore())
        self._handles.append(handle)
        return handle

    def remove(self) -> None:
        """Remove every hook; the heads train normally again."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._hooked.clear()
        self._masks.clear()
        self._saved.clear()
        self.frozen = [set() for _ in range(self.adapter.num_layers)]

    # internals --------------------------------------------------------------
    def _params(self, layer: int) -> list[nn.Parameter]:
        seen, out = set(), []
        for module in (self.adapter.attention(layer), self.adapter.out_proj(layer)):
            for p in module.parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    out.append(p)
        return out

    def _rebuild(self, layer: int) -> None:
        layout = self.adapter.layout(layer)
        d, group = layout.head_dim, layout.group_size
        q_heads = sorted(self.frozen[layer])
        kv_heads = [
            j
            for j in range(layout.num_kv_heads)
            if all(h in self.frozen[layer] for h in range(j * group, (j + 1) * group))
        ]
        proj = self.adapter.projections(layer)
        # (view, dim, heads): rows of q/k/v (and their biases) along dim 0, columns of o along dim 1.
        parts = [
            (proj.q, 0, q_heads),
            (proj.q_bias, 0, q_heads),
            (proj.o, 1, q_heads),
            (proj.k, 0, kv_heads),
            (proj.k_bias, 0, kv_heads),
            (proj.v, 0, kv_heads),
            (proj.v_bias, 0, kv_heads),
        ]
        params = self._params(layer)
        flags: dict[nn.Parameter, torch.Tensor] = {}  # param -> flat bool over its storage
        for view, dim, heads in parts:
            if view is None:
                continue
            param = _owner(view, params)
            if param not in flags:  # flat bool over the storage span of ``param``
                flags[param] = torch.zeros(_extent(param), dtype=torch.bool, device=param.device)
            if heads:
                index = (
                    torch.tensor(heads, device=param.device)[:, None] * d + torch.arange(d, device=param.device)
                ).reshape(-1)
                offset = view.storage_offset() - param.storage_offset()
                marked = torch.as_strided(flags[param], view.shape, view.stride(), offset)
                marked.index_fill_(dim, index, True)
        for param, flat in flags.items():
            mask = torch.as_strided(flat, param.shape, param.stride(), 0).clone()
            if mask.any():
                self._masks[param] = mask
                self._saved[param] = param.detach()[mask].clone()
                if id(param) not in self._hooked and param.requires_grad:
                    self._hooked.add(id(param))
                    self._handles.append(param.register_hook(self._grad_hook(param)))

    def _grad_hook(self, param: nn.Parameter):
        def hook(grad: torch.Tensor) -> torch.Tensor | None:
            mask = self._masks.get(param)
            return None if mask is None else grad.masked_fill(mask, 0)

        return hook


def _extent(t: torch.Tensor) -> int:
    """Number of storage elements spanned by ``t`` from its storage offset on."""
    return 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride(), strict=True) if size > 0)


def _owner(view: torch.Tensor, params: Sequence[nn.Parameter]) -> nn.Parameter:
    """The parameter whose storage span holds the view (views of one parameter share its storage)."""
    ptr, start = view.untyped_storage().data_ptr(), view.storage_offset()
    for p in params:
        if p.untyped_storage().data_ptr() == ptr and 0 <= start - p.storage_offset() < _extent(p):
            return p
    raise ValueError("the adapter's projections are not views of the layer's parameters; cannot freeze heads")


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
        keys: the measures to compute (default: all of ``head_measures``); must include the
            rule's ``measures`` (and ``C_Q`` when freezing).
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


__all__ = [
    "DEFAULT_EVERY_N_STEPS",
    "DEFAULT_RULE_MEASURES",
    "DEFAULT_THRESHOLD",
    "ConvergenceCallback",
    "HeadFreezer",
    "log_scalars",
    "rule_max",
    "stop_rule",
    "track",
]

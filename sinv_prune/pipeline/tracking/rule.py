"""The paper's stopping rule, measuring into a trace, and summary scalars for Trainer logs."""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Iterable, Sequence

from torch import nn

from sinv_prune.scoring.measures import head_measures
from sinv_prune.scoring.trace import append_trace

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

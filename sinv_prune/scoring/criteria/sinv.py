"""S-invariant criteria (paper: NN6, "The S-Invariant Attractor for Transformers").

The paper measures each head by ``C_Q = ||W_Q^h + W_K^h||_F / (||W_Q^h||_F + ||W_K^h||_F)``
(0 at its attractor ``W_Q = -W_K``, see :func:`sinv_prune.scoring.measures.head_measures`) and
prunes "heads that reach C_Q < 0.05 within the first 15 epochs", as having learned trivial
attention patterns. Low C_Q is therefore pruned first: the scores below rise with C_Q.
Both criteria take ``invert=True`` to reverse the order (highest C_Q pruned first), a control
for the paper's claim, and ``measure=`` to use another per-head measure (``"C_QK_gauge"``).
``sinv_gauge`` is ``sinv_static`` on the gauge-invariant ``C_QK_gauge``.

``sinv_static`` and ``sinv_early`` also score ``unit="experts"``: each routed expert is measured
as the paper measures an MLP, by ``C_FF`` of its ``W_down W_up`` (``C_FF_experts``), with the
same order (lowest pruned first) and options.
"""

from __future__ import annotations

import math
import os

from torch import nn

from sinv_prune.scoring.criteria.base import Criterion, Scores, TraceLike, head_counts, unit_counts
from sinv_prune.scoring.criteria.registry import register_criterion
from sinv_prune.scoring.trace import read_trace
from sinv_prune.surgery.record import get_record
from sinv_prune.units import get_unit
from sinv_prune.units.experts import EXPERTS

#: The measure each unit is scored by when ``measure`` is not given.
DEFAULT_MEASURES = {"heads": "C_Q", "experts": "C_FF_experts"}
UNITS = tuple(DEFAULT_MEASURES)


def _measure_key(criterion: Criterion, measure: str | None) -> str:
    """The measure the criterion scores its unit by: the unit's default, or ``measure`` unless it is
    one of another shape (per layer, or per expert for heads; anything but ``C_FF_experts`` for experts)."""
    from sinv_prune.scoring.measures import EXPERT_KEYS, PER_LAYER_KEYS

    if measure is None:
        return DEFAULT_MEASURES[criterion.unit]
    experts = get_unit(criterion.unit) is EXPERTS
    if (measure not in EXPERT_KEYS) if experts else (measure in EXPERT_KEYS + PER_LAYER_KEYS):
        want = "C_FF_experts" if experts else "a per-head measure (C_Q, C_V, C_QK_gauge)"
        raise ValueError(f"{criterion.name}: unit {criterion.unit!r} is scored by {want}, not {measure!r}")
    return measure


def _measure(model: nn.Module, measure: str) -> list[list[float]]:
    from sinv_prune.scoring.measures import head_measures

    return head_measures(model, keys=[measure])[measure]


@register_criterion("sinv_static")
class SinvStaticCriterion(Criterion):
    """Score = ``C_Q`` of the current weights (low C_Q = pruned first, after the paper).

    ``invert=True`` scores ``1 - C_Q`` instead (highest C_Q pruned first, a control).
    Data-free; one pass of :func:`~sinv_prune.scoring.measures.head_measures`.

    ``unit="experts"``: score = ``C_FF`` of the expert's ``W_down W_up`` (``measure`` defaults to
    ``C_FF_experts``); dense layers get ``[]``.

    .. code-block:: yaml

        criterion: sinv_static
        options: {measure: C_Q, invert: false}
    """

    units = UNITS

    def __init__(self, measure: str | None = None, invert: bool = False):
        self.measure = measure
        self.invert = bool(invert)

    def scores(self, model: nn.Module) -> Scores:
        values = _measure(model, _measure_key(self, self.measure))
        return [[1.0 - float(v) if self.invert else float(v) for v in layer] for layer in values]


@register_criterion("sinv_gauge")
class SinvGaugeCriterion(SinvStaticCriterion):
    """Score = ``C_QK_gauge`` of the current weights: ``sinv_static`` made gauge invariant.

    ``C_Q`` changes under ``W_Q -> A W_Q, W_K -> A^-T W_K``, which leaves attention unchanged,
    so it can call two identical heads different. ``C_QK_gauge`` (distance of the QK circuit
    ``W_Q^T W_K`` from the symmetric negative semi-definite matrices, relative to its norm; see
    :mod:`sinv_prune.scoring.measures`) is 0 exactly where the head is equivalent to one at the paper's
    attractor ``W_Q = -W_K``. As with ``C_Q``, the paper's reading is that heads at the attractor
    have converged to trivial patterns, so the lowest values are pruned first; ``invert=True``
    scores ``1 - C_QK_gauge`` (highest pruned first, a control). Data-free.

    .. code-block:: yaml

        criterion: sinv_gauge
        options: {invert: false}
    """

    units = ("heads",)

    def __init__(self, invert: bool = False):
        super().__init__(measure="C_QK_gauge", invert=invert)


@register_criterion("sinv_early")
class SinvEarlyCriterion(Criterion):
    """The paper's rule: heads whose C_Q falls below ``threshold`` within the first ``epochs`` go first.

    Reads a convergence trace (:mod:`sinv_prune.scoring.trace`; a path or its records) and keeps
    the measurements with ``epoch <= epochs`` (``epochs=None``: the whole trace). The
    total order, first pruned first:

    1. heads that crossed (``C_Q < threshold`` in some window record), earliest crossing
       first, ties by the lowest C_Q reached in the window;
    2. every other head, lowest C_Q reached in the window first.

    The paper's threshold is rarely crossed in practice (docs/design-notes.md), so part 2 is what
    orders most heads; ``report()["crossed"]`` (also ``self.crossed``) says how many did.
    Scores encode the order: a crossing head at window record ``t`` of ``T`` with minimum
    ``m`` scores ``(t + m / threshold) / T - 1`` (in ``[-1, 0)``); any other head scores its
    minimum ``m`` (``>= threshold``). ``invert=True`` negates them (reverse order, a control).

    A trace recorded on the unpruned model applies to a pruned one too: its heads are
    mapped through the pruning record in the model's config.

    ``unit="experts"``: the same rule per routed expert on ``C_FF_experts`` (the ``C_FF`` of each
    expert's ``W_down W_up``, recorded by the tracking callback for models with experts); dense
    layers get ``[]``. ``report()["crossed_experts"]`` names the experts that crossed.

    .. code-block:: yaml

        criterion: sinv_early
        options: {threshold: 0.05, epochs: 15}
    """

    needs_trace = True
    units = UNITS

    def __init__(
        self,
        trace: TraceLike | None = None,
        threshold: float = 0.05,
        epochs: float | None = 15,
        invert: bool = False,
        measure: str | None = None,
    ):
        if not threshold > 0:
            raise ValueError(f"sinv_early: threshold must be positive, got {threshold!r}")
        self.trace = trace
        self.threshold = float(threshold)
        self.epochs = epochs
        self.invert = bool(invert)
        self.measure = measure
        self.crossed: int | None = None
        self._report: dict = {}

    def reset(self) -> None:
        self.crossed, self._report = None, {}

    def report(self) -> dict:
        return dict(self._report)

    def scores(self, model: nn.Module) -> Scores:
        if self.trace is None:
            raise ValueError("sinv_early needs a trace (a trace file or its records)")
        key = _measure_key(self, self.measure)
        window = self._window(key)
        series = [_align(r[key], model, key, self.unit) for r in window]
        counts = [len(layer) for layer in series[0]]
        out, crossing, minima, crossed_heads = [], [], [], {}
        for layer, n in enumerate(counts):
            row, row_cross, row_min = [], [], []
            for head in range(n):
                values = [_number(s[layer][head]) for s in series]
                score, first, low = self._score(values, len(series))
                row.append(-score if self.invert else score)
                row_cross.append(None if first is None else _when(window[first]))
                row_min.append(low)
                if first is not None:
                    crossed_heads.setdefault(layer, []).append(head)
            out.append(row)
            crossing.append(row_cross)
            minima.append(row_min)
        self.crossed = sum(len(h) for h in crossed_heads.values())
        self._report = {
            "crossed": self.crossed,
            f"crossed_{self.unit}": crossed_heads,
            "threshold": self.threshold,
            "epochs": self.epochs,
            "measure": key,
            "window_records": len(window),
            "window": [_when(window[0]), _when(window[-1])],
            "crossing": crossing,
            "min_in_window": minima,
        }
        return out

    def _window(self, key: str) -> list[dict]:
        records = read_trace(self.trace) if isinstance(self.trace, (str, os.PathLike)) else list(self.trace)
        records = [r for r in records if key in r]
        if self.epochs is not None:
            if any(r.get("epoch") is None for r in records):
                raise ValueError("sinv_early: trace records without an epoch; pass epochs=None to use the whole trace")
            records = [r for r in records if r["epoch"] <= self.epochs]
        if not records:
            raise ValueError(
                f"sinv_early: the trace has no {key} measurement"
                + (f" within the first {self.epochs} epochs" if self.epochs is not None else "")
            )
        return records

    def _score(self, values: list[float], total: int) -> tuple[float, int | None, float]:
        finite = [v for v in values if not math.isnan(v)]
        low = min(finite) if finite else math.nan
        first = next((t for t, v in enumerate(values) if v < self.threshold), None)
        if first is None:
            return low, None, low
        return (first + low / self.threshold) / total - 1.0, first, low


def _number(value) -> float:
    return math.nan if value is None else float(value)


def _when(record: dict) -> dict:
    return {"step": record.get("step"), "epoch": record.get("epoch")}


def _align(values: list[list[float]], model: nn.Module, measure: str, unit: str = "heads") -> list[list[float]]:
    """A trace record's per-head (or per-expert) values in the model's current numbering."""
    if get_unit(unit) is EXPERTS:
        return _align_experts(values, model, measure)
    counts = head_counts(model)
    shape = [len(layer) for layer in values]
    if shape == counts:
        return values
    record = get_record(model.config)
    if record is not None and shape == [record.num_heads] * record.num_layers:
        return [[layer_values[h] for h in record.kept_heads(i)] for i, layer_values in enumerate(values)]
    raise ValueError(
        f"sinv_early: the trace's {measure} has head counts {shape}, the model has {counts}"
        + (f" (originally {[record.num_heads] * record.num_layers})" if record else "")
    )


def _align_experts(values: list[list[float]], model: nn.Module, measure: str) -> list[list[float]]:
    """Per-expert trace values in the model's current numbering: as recorded, or, for a trace of the
    unpruned model, through the pruning record (kept layers, then each layer's kept experts)."""
    counts = unit_counts(model, "experts")
    shape = [len(layer) for layer in values]
    if shape == counts:
        return values
    record = get_record(model.config)
    if record is not None and record.num_experts is not None and len(values) == record.num_layers:
        layers = record.kept_layers()
        if all(len(values[orig]) in (0, record.num_experts) for orig in layers):
            mapped = [[values[orig][e] for e in record.kept_experts(orig)] if values[orig] else [] for orig in layers]
            if [len(layer) for layer in mapped] == counts:
                return mapped
    raise ValueError(f"sinv_early: the trace's {measure} has expert counts {shape}, the model has {counts}")

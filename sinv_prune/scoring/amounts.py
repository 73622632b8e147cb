"""A part's amount: its bounds (one rule for :class:`~sinv_prune.Part` and the recipe) and whether a model
(meta weights will do) can meet it (one check for ``Part``, the recipe's preflight and the selection's budget)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from torch import nn

from sinv_prune.arch import HeadAdapter
from sinv_prune.scoring.allocation import groups_for, non_embedding_parameters
from sinv_prune.units import get_unit
from sinv_prune.units.common import amount_count
from sinv_prune.units.heads.selection import DEFAULT_LAYOUT

#: The one message for a parameter share out of bounds (0 removes nothing, 1 everything).
PARAMS_SHARE = "amount.params is a fraction in (0, 1) of the non-embedding parameters"


def check_amount(amount):
    """An int count, a float fraction, or ``{"params": share}`` of the non-embedding parameters, the share in
    (0, 1); returns the amount (a share as a float)."""
    if isinstance(amount, Mapping):
        if set(amount) != {"params"}:
            raise ValueError(
                f"an amount mapping takes one key, params (a fraction of the parameters), got {sorted(amount)}"
            )
        value = amount["params"]
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"{PARAMS_SHARE}, got {value!r}")
        if not 0.0 < float(value) < 1.0:
            raise ValueError(f"{PARAMS_SHARE}, got {value:g}")  # 0 and 0.0 alike: the recipe reads floats
        return {"params": float(value)}
    return amount


def check_met(adapter: HeadAdapter, unit: str, amount: Any, *, mode: str = "global", allocation: str = "uniform",
              options: Mapping[str, Any] | None = None) -> None:  # fmt: skip
    """Whether the model behind ``adapter`` (meta weights will do) has the ``amount`` of ``unit`` a part asks for,
    under its ``mode``, ``allocation`` and unit settings ``options`` (``Part`` field names); a one-line
    ``ValueError`` otherwise."""
    kind, options = get_unit(unit), dict(options or {})
    if isinstance(amount, Mapping) or allocation != "uniform":
        amount = _params_count(adapter, unit, amount, allocation, options)
        if amount is None:
            return
    kind.check_amount(adapter, amount, {"mode": mode, **options})


def _params_count(adapter: HeadAdapter, unit: str, amount, allocation: str, options: Mapping[str, Any]) -> int | None:
    """A ``{params: f}`` amount or a non-uniform allocation, checked on the model.

    Returns the unit count the selection's own modes will get (``uniform`` allocation), else None.
    """
    model, layers = adapter.model, list(range(adapter.num_layers))
    budget = _Budget(model)
    kind = get_unit(unit)
    if kind.whole_layers:
        count = budget.units(amount, unit, layers)
        if count >= len(layers):
            raise ValueError(f"{count} layers requested, the model has {len(layers)} (one must stay)")
        if count == 0:
            raise ValueError(f"{amount['params']:g} of the parameters is less than one layer")
        return None
    if allocation == "uniform":
        count = budget.units(amount, unit, layers)
        if count == 0:
            raise ValueError(f"{amount['params']:g} of the parameters is less than one {unit} unit")
        return count
    sizes = kind.sizes(model)
    groups = groups_for(model, unit, [[0.0] * n for n in sizes], layers, min_per_layer=options.get("min_per_layer"),
                        multiple=options.get("multiple", 1), shape=options.get("layout", DEFAULT_LAYOUT))  # fmt: skip
    target = budget.params(amount, unit, layers)
    most = sum(g.allowed[-1] * g.cost for g in groups)
    if target > most:
        raise ValueError(f"{target:,} parameters requested, the constraints let at most {most:,} go")
    return None


class _Budget:
    """Turns a part's amount into units or parameters on ``model`` (as it is before the cut)."""

    def __init__(self, model: nn.Module):
        self.model = model
        self._total: int | None = None

    @property
    def non_embedding(self) -> int:
        if self._total is None:
            self._total = non_embedding_parameters(self.model)
        return self._total

    def _cost(self, unit: str, kept: list[int]) -> int:
        """One item's parameters: a whole layer's those of the first layer kept; else the cheapest layer's."""
        kind = get_unit(unit)
        if kind.whole_layers:
            return max(kind.cost(self.model, kept[0]), 1) if kept else 1
        costs = [kind.cost(self.model, i) for i in kept]
        costs = [c for c in costs if c]
        return min(costs) if costs else 1

    def _target(self, amount) -> int:
        return math.floor(amount["params"] * self.non_embedding)

    def units(self, amount, unit: str, kept: list[int]):
        """A unit count for the selection's own modes: the params target over one unit's parameters, rounded down
        (whole layers: the most layers whose parameters do not exceed the target)."""
        if not isinstance(amount, Mapping):
            return amount
        return self._target(amount) // self._cost(unit, kept)

    def params(self, amount, unit: str, kept: list[int]) -> int:
        """A parameter target for an allocation: ``{"params": f}`` directly, a count / fraction times a unit's cost."""
        if isinstance(amount, Mapping):
            return self._target(amount)
        kind = get_unit(unit)
        sizes = kind.sizes(self.model)
        count = amount_count(amount, sum(sizes[i] for i in kept), kind.plural, f"a {kind.noun} count")
        return count * self._cost(unit, kept)

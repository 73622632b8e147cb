"""The contract every criterion fulfils.

A criterion scores one kind of unit (``Criterion.units`` lists those it can score; an
instance scores ``criterion.unit``, chosen by ``get_criterion(name, unit=...)``, default
``"heads"``). **Higher means keep.** Score formats:

* ``"heads"``: shaped like ``head_measures(model)["C_Q"]``, a list per layer of floats per
  current query head;
* ``"mlp"``: a list per layer of floats per current MLP channel (the down projection's inputs);
* ``"experts"``: a list per layer of floats per current routed expert (``[]`` for a dense layer);
* ``"layers"``: a list with one float per current layer.

A criterion never changes weights. A stateful criterion has one lifecycle the caller drives:

``reset()`` -> ``update(model, batch)`` per batch (only where ``needs_data``) -> ``scores(model)``.

:meth:`Criterion.compute` runs that lifecycle in one call over finished inputs.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any, ClassVar

import torch
from torch import nn

from sinv_prune.arch import get_adapter
from sinv_prune.surgery.block_inputs import preserve_modes
from sinv_prune.units import get_unit

Scores = list[list[float]] | list[float]
#: A trace as accepted by criteria: a JSON-lines file or its records (see :mod:`sinv_prune.scoring.trace`).
TraceLike = str | os.PathLike | list[dict]


class Criterion:
    """Base class of the criteria; register subclasses with ``@register_criterion("name")``.

    Class attributes tell the caller what to supply: ``needs_data`` (``update`` must see
    batches) and ``needs_trace`` (a convergence trace, given as the ``trace`` option or
    to :meth:`compute`); ``units`` are the units the class can score (``unit``, set by
    :func:`~sinv_prune.scoring.criteria.get_criterion`, is the one an instance scores).
    """

    name: ClassVar[str] = ""
    units: ClassVar[tuple[str, ...]] = ("heads",)

    @property
    def unit(self) -> str:
        """The unit this instance scores: the one set by ``get_criterion``, else the class's first."""
        return self.__dict__.get("_unit", self.units[0])

    @unit.setter
    def unit(self, value: str) -> None:
        if value not in self.units:
            raise ValueError(f"criterion {self.name!r} does not score {value!r}; it scores: {', '.join(self.units)}")
        self._unit = value

    needs_data: ClassVar[bool] = False
    needs_trace: ClassVar[bool] = False
    #: Whether :meth:`update_layers` can read the batches one block at a time (see :mod:`.walk`).
    walks_layers: ClassVar[bool] = False
    #: :meth:`compute` walks the blocks one at a time where the criterion can (set per instance).
    layer_by_layer: bool = False

    def reset(self) -> None:
        """Forget everything accumulated from batches."""

    def update(self, model: nn.Module, batch: Mapping[str, Any]) -> None:
        """Accumulate statistics from one batch (a no-op for data-free criteria)."""

    def update_layers(self, model: nn.Module, batches: list[Mapping[str, Any]]) -> None:
        """Accumulate statistics from every batch, one block at a time (where ``walks_layers``)."""
        raise ValueError(f"criterion {self.name!r} cannot read its batches one block at a time")

    def scores(self, model: nn.Module) -> Scores:
        """Scores of ``self.unit`` in the format of the module docstring; higher = keep."""
        raise NotImplementedError

    def report(self) -> dict:
        """JSON-serialisable facts about the last :meth:`scores` call (criterion specific)."""
        return {}

    def compute(
        self,
        model: nn.Module,
        batches: Iterable[Mapping[str, Any]] | None = None,
        trace: TraceLike | None = None,
        *,
        layer_by_layer: bool | None = None,
    ) -> Scores:
        """``reset``, ``update`` over ``batches`` (when data is needed), then ``scores``.

        ``trace`` replaces the criterion's trace where it needs one; inputs the
        criterion does not need are ignored. ``layer_by_layer`` (default: the instance's
        ``layer_by_layer``) reads the batches one block at a time (:meth:`update_layers`,
        :mod:`~sinv_prune.scoring.criteria.walk`) instead of one whole-model forward per batch.
        """
        self.reset()
        if self.needs_trace and trace is not None:
            self.trace = trace
        if self.needs_trace and getattr(self, "trace", None) is None:
            raise ValueError(f"criterion {self.name!r} needs a trace (a trace file or its records)")
        if self.needs_data:
            if batches is None:
                raise ValueError(f"criterion {self.name!r} needs data: pass batches")
            walk = self.layer_by_layer if layer_by_layer is None else layer_by_layer
            if walk:
                batches = list(batches)
                if batches:
                    self.update_layers(model, batches)
                seen = len(batches)
            else:
                seen = 0
                for batch in batches:
                    self.update(model, batch)
                    seen += 1
            if not seen:
                raise ValueError(f"criterion {self.name!r} needs data: batches was empty")
        return self.scores(model)

    def __repr__(self) -> str:
        options = [f"{k}={_short(v)}" for k, v in vars(self).items() if not k.startswith("_")]
        if self.unit != self.units[0]:
            options.append(f"unit={self.unit!r}")
        return f"{type(self).__name__}({', '.join(options)})"


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else f"<{type(value).__name__}>"


def head_counts(model: nn.Module) -> list[int]:
    """Current number of query heads in every layer."""
    adapter = get_adapter(model)
    return [adapter.layout(layer).num_heads for layer in range(adapter.num_layers)]


def channel_counts(model: nn.Module) -> list[int]:
    """Current number of MLP channels in every layer."""
    adapter = get_adapter(model)
    return [adapter.intermediate_size(layer) for layer in range(adapter.num_layers)]


def unit_counts(model: nn.Module, unit: str) -> list[int]:
    """Per layer, the current number of ``unit`` (heads or MLP channels); ``[num_layers]`` for layers."""
    return get_unit(unit).sizes(model)


@contextmanager
def frozen_parameters(model: nn.Module) -> Iterator[None]:
    """Within the block no parameter of ``model`` requires grad (so a backward keeps no weight
    gradients or their buffers, only those of gates); every flag is restored after."""
    flags = [(p, p.requires_grad) for p in model.parameters()]
    try:
        for p, _ in flags:
            p.requires_grad_(False)
        yield
    finally:
        for p, flag in flags:
            p.requires_grad_(flag)


def to_scores(values: Iterable[torch.Tensor]) -> Scores:
    """Per-layer tensors to the plain nested-list score format."""
    return [[float(x) for x in v.detach().double().cpu().reshape(-1)] for v in values]


def model_device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


def batch_to(batch: Mapping[str, Any], device: torch.device) -> dict:
    """A batch with its tensors on ``device``."""
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def observe(model: nn.Module, batch: Mapping[str, Any], hooks: list) -> None:
    """One eval-mode, no-grad forward of ``batch`` for the given hook handles, removed afterwards (also on error)."""
    try:
        with preserve_modes(model), torch.no_grad():
            model(**batch)
    finally:
        for hook in hooks:
            hook.remove()


class StoredScores(Criterion):
    """Scores computed earlier (a recipe's ``scores.json``, a benchmark's cache) as a criterion for a pruner.

    Not registered: it only hands back ``values`` (in the format of ``unit``) and ``report``.
    """

    def __init__(self, name: str, unit: str, values: list, report: dict | None = None):
        self.name = name
        self.units = (unit,)
        self._values = values
        self._report = dict(report or {})

    def scores(self, model) -> list:
        return self._values

    def report(self) -> dict:
        return self._report

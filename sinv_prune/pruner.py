"""One call from a criterion to a smaller model: score, select, remove."""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Mapping
from typing import Any

from torch import nn

from sinv_prune.criteria import Criterion, Scores, TraceLike, criterion_class, get_criterion
from sinv_prune.selection import DEFAULT_LAYOUT, MODES, check_layout, model_layouts, select_heads
from sinv_prune.surgery import PruneSummary, prune_heads


class HeadPruner:
    """Criterion + selection + :func:`~sinv_prune.prune_heads` in one object.

    ``criterion`` is a registered name (built with ``criterion_options``; a criterion
    taking a ``seed`` gets the pruner's ``seed`` unless the options set one) or a
    :class:`~sinv_prune.criteria.Criterion` instance. ``amount``, ``mode``, ``layout``,
    ``min_heads_per_layer``, ``seed`` and ``exact`` mean what they mean in
    :func:`~sinv_prune.selection.select_heads`; ``min_heads_per_layer=0`` lets layers
    lose every head (``prune`` then passes ``allow_empty_layers=True``; a recipe asks for
    that with ``prune.allow_empty_layers: true``). After a call, ``last_scores``,
    ``last_selection`` and ``report()`` tell what was decided.

    >>> pruner = HeadPruner("taylor", 0.25, mode="uniform", layout="q_per_group")
    >>> summary = pruner.prune(model, batches=loader)

    The same as a recipe arm:

    .. code-block:: yaml

        prune:
          arms:
            - criterion: taylor
              amount: 0.25
              mode: uniform
              layout: q_per_group
              min_heads_per_layer: 1
    """

    def __init__(
        self,
        criterion: str | Criterion,
        amount: int | float,
        *,
        mode: str = "global",
        layout: str = DEFAULT_LAYOUT,
        min_heads_per_layer: int = 1,
        seed: int = 0,
        exact: bool = False,
        criterion_options: Mapping[str, Any] | None = None,
    ):
        if mode not in MODES:
            raise ValueError(f"unknown selection mode {mode!r}; choose one of {', '.join(MODES)}")
        check_layout(layout)
        if isinstance(criterion, str):
            options = dict(criterion_options or {})
            if "seed" in inspect.signature(criterion_class(criterion)).parameters:
                options.setdefault("seed", seed)
            criterion = get_criterion(criterion, **options)
        elif criterion_options:
            raise ValueError("criterion_options only apply when criterion is given by name")
        if not isinstance(criterion, Criterion):
            raise TypeError(f"criterion must be a registered name or a Criterion, got {type(criterion).__name__}")
        self.criterion = criterion
        self.amount = amount
        self.mode = mode
        self.layout = layout
        self.min_heads_per_layer = min_heads_per_layer
        self.seed = seed
        self.exact = exact
        self.last_scores: Scores | None = None
        self.last_selection: dict[int, list[int]] | None = None

    def score(
        self, model: nn.Module, batches: Iterable[Mapping[str, Any]] | None = None, trace: TraceLike | None = None
    ) -> Scores:
        """The criterion's scores for ``model`` (higher = keep), shaped like ``C_Q``."""
        self.last_scores = self.criterion.compute(model, batches, trace)
        return self.last_scores

    def select(
        self,
        model: nn.Module,
        scores: Scores | None = None,
        *,
        batches: Iterable[Mapping[str, Any]] | None = None,
        trace: TraceLike | None = None,
    ) -> dict[int, list[int]]:
        """Heads to remove, ``{layer: [heads]}``; scores are computed unless given."""
        if scores is None:
            scores = self.score(model, batches, trace)
        self.last_selection = select_heads(
            scores,
            self.amount,
            layouts=model_layouts(model),
            mode=self.mode,
            layout=self.layout,
            min_heads_per_layer=self.min_heads_per_layer,
            seed=self.seed,
            exact=self.exact,
        )
        return self.last_selection

    def prune(
        self, model: nn.Module, batches: Iterable[Mapping[str, Any]] | None = None, trace: TraceLike | None = None
    ) -> PruneSummary:
        """Score, select and remove the heads from ``model`` in place."""
        heads = self.select(model, batches=batches, trace=trace)
        return prune_heads(model, heads, allow_empty_layers=self.min_heads_per_layer == 0)

    def report(self) -> dict:
        """The criterion's report plus the last selection (JSON-serialisable)."""
        return {
            "criterion": self.criterion.name,
            "criterion_report": self.criterion.report(),
            "amount": self.amount,
            "mode": self.mode,
            "layout": self.layout,
            "min_heads_per_layer": self.min_heads_per_layer,
            "seed": self.seed,
            "selection": {str(k): v for k, v in (self.last_selection or {}).items()},
        }

    def __repr__(self) -> str:
        return (
            f"HeadPruner({self.criterion!r}, amount={self.amount!r}, mode={self.mode!r}, layout={self.layout!r}, "
            f"min_heads_per_layer={self.min_heads_per_layer}, seed={self.seed})"
        )

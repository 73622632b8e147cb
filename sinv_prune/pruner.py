"""One call from a criterion to a smaller model: score, select, remove (in one round or several)."""

from __future__ import annotations

import inspect
import logging
import operator
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from torch import nn

from sinv_prune import compensation
from sinv_prune.arch import get_adapter
from sinv_prune.criteria import Criterion, Scores, TraceLike, criterion_class, get_criterion
from sinv_prune.record import get_record
from sinv_prune.selection import DEFAULT_LAYOUT, MODES, check_layout, model_layouts, select_heads
from sinv_prune.surgery import LayerChange, PruneSummary, count_parameters, prune_heads

logger = logging.getLogger(__name__)

#: ``between_rounds(model, round_index)``: called after round ``round_index`` (0-based) when another follows.
RoundHook = Callable[[nn.Module, int], None]


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

    **Iterative pruning.** ``rounds=k`` reaches the amount in ``k`` rounds, each re-scoring the
    already-pruned model (``batches`` are iterated once per round; a one-shot iterator is read
    into a list first):

    * The total is fixed first, on the model as given: the number of heads one-shot selection
      would remove (a float amount is a fraction of the heads the model has when ``prune`` is
      called, the unpruned count for a fresh model; ``exact`` and the shortfall warning apply
      to this total).
    * Round ``i`` asks for ``ceil(R / (k - i))`` heads, ``R`` the part of the total not yet
      removed, and removes the smallest valid cut of at least that many (at most ``R``). "Valid"
      is what :func:`~sinv_prune.selection.select_heads` allows with the pruner's ``mode``,
      ``layout`` and ``min_heads_per_layer`` on the current model, so in ``uniform`` mode every
      round is itself a uniform cut (all layers alike after each round). Where GQA groups or
      uniform steps make a share unreachable, the round takes the next valid cut and the later
      rounds get less; rounds with nothing left to remove are not run (12 heads in 3 rounds
      where a uniform cut comes in steps of 6: shares 4 -> 6, then 3 -> 6, no third round).
      Should no valid cut fit in what is left, pruning stops there with a warning.
    * ``between_rounds(model, round_index)`` is called after every round that another round
      follows (``k - 1`` times when all ``k`` run), before the re-scoring: the place to
      compensate or fine-tune a few steps. Nothing runs after the last round; compensate or
      fine-tune the result as after a one-shot cut.

    ``rounds=1`` (default) is exactly one-shot pruning. ``prune`` returns one summary of all
    rounds (``removed`` numbered as the model had its heads when ``prune`` was called);
    ``last_selection`` is the same selection, and ``report()["per_round"]`` lists each round's
    selection in the original (unpruned) numbering of the pruning record.

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
        rounds: int = 1,
        between_rounds: RoundHook | None = None,
        compensate: str | None = None,
        compensation_options: Mapping[str, Any] | None = None,
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
        self.rounds = _rounds(rounds)
        if between_rounds is not None and not callable(between_rounds):
            raise ValueError(f"between_rounds must be a callable (model, round_index), got {between_rounds!r}")
        self.between_rounds = between_rounds
        if compensate is not None and compensate not in compensation.METHODS:
            raise ValueError(f"unknown compensation {compensate!r}; choose one of {', '.join(compensation.METHODS)}")
        self.compensate = compensate
        self.compensation_options = dict(compensation_options or {})
        self.last_scores: Scores | None = None
        self.last_selection: dict[int, list[int]] | None = None
        self.last_rounds: list[dict] = []

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
        self.last_selection = self._select(model, scores, self.amount, self.exact)
        return self.last_selection

    def _select(self, model: nn.Module, scores: Scores, amount: int | float, exact: bool) -> dict[int, list[int]]:
        return select_heads(
            scores,
            amount,
            layouts=model_layouts(model),
            mode=self.mode,
            layout=self.layout,
            min_heads_per_layer=self.min_heads_per_layer,
            seed=self.seed,
            exact=exact,
        )

    def prune(
        self,
        model: nn.Module,
        batches: Iterable[Mapping[str, Any]] | None = None,
        trace: TraceLike | None = None,
        calibration: Iterable[Mapping[str, Any]] | None = None,
    ) -> PruneSummary:
        """Score, select and remove the heads from ``model`` in place, in ``rounds`` rounds.

        With ``compensate`` set, every round's removal is compensated from ``calibration``
        (see :func:`~sinv_prune.prune_heads`); a missing ``calibration`` raises before any change.
        """
        if self.compensate is not None and calibration is None:
            raise ValueError(f"compensate={self.compensate!r} needs calibration batches")
        if self.rounds > 1 and batches is not None and iter(batches) is batches:
            batches = list(batches)  # every round iterates them again
        if self.rounds > 1 and calibration is not None and iter(calibration) is calibration:
            calibration = list(calibration)
        removal = {"allow_empty_layers": self.min_heads_per_layer == 0}
        if self.compensate is not None:
            removal.update(calibration=calibration, compensate=self.compensate, **self.compensation_options)
        kept_at_start = _kept_original(model)
        first = self.select(model, batches=batches, trace=trace)  # fixes the total; raises before any change
        total = sum(map(len, first.values()))
        summaries: list[PruneSummary] = []
        self.last_rounds = []
        for index in range(self.rounds):
            remaining = total - sum(s.heads_removed for s in summaries)
            if remaining == 0:
                break
            share = -(-remaining // (self.rounds - index))
            if self.rounds == 1:
                heads = first  # exactly one-shot
            else:
                if index:
                    if self.between_rounds is not None:
                        self.between_rounds(model, index - 1)
                    self.score(model, batches, trace)
                heads = self._round_heads(model, share, remaining)
            if not heads:
                logger.warning("sinv_prune: round %d can remove none of the %d heads left; stopping", index, remaining)
                break
            summaries.append(prune_heads(model, heads, **removal))
            self.last_rounds.append(_round_entry(index, share, summaries[-1], self.criterion.report()))
        summary = _combine(model, summaries, kept_at_start)
        self.last_selection = {c.layer: c.removed for c in summary.layers}
        return summary

    def _round_heads(self, model: nn.Module, share: int, remaining: int) -> dict[int, list[int]]:
        """The smallest valid cut of at least ``share`` heads and at most ``remaining``; ``{}`` if none."""
        self._select(model, self.last_scores, 0, False)  # bad scores (shape, NaN) raise here, not below
        for request in range(share, remaining + 1):
            try:
                return self._select(model, self.last_scores, request, True)
            except ValueError:
                continue
        return {}

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
            "rounds": self.rounds,
            "compensate": self.compensate,
            "selection": {str(k): v for k, v in (self.last_selection or {}).items()},
            "per_round": self.last_rounds,
        }

    def __repr__(self) -> str:
        return (
            f"HeadPruner({self.criterion!r}, amount={self.amount!r}, mode={self.mode!r}, layout={self.layout!r}, "
            f"min_heads_per_layer={self.min_heads_per_layer}, seed={self.seed}, rounds={self.rounds})"
        )


def _rounds(value) -> int:
    if not isinstance(value, bool):
        try:
            value = operator.index(value)
        except TypeError:
            pass
        else:
            if value >= 1:
                return value
    raise ValueError(f"rounds must be a positive integer, got {value!r}")


def _kept_original(model: nn.Module) -> list[list[int]]:
    """Per layer, the original (record) index of each head the model has now."""
    record = get_record(model.config)
    if record is not None:
        return [record.kept_heads(layer) for layer in range(record.num_layers)]
    return [list(range(lay.num_heads)) for lay in model_layouts(model)]


def _round_entry(index: int, share: int, summary: PruneSummary, criterion_report: dict) -> dict:
    """One round for ``report()``: what it asked for, what it removed (original numbering)."""
    return {
        "round": index,
        "requested": share,
        "heads_removed": summary.heads_removed,
        "selection": {str(c.layer): c.removed_original for c in summary.layers},
        "criterion_report": criterion_report,
        "compensation": summary.compensation.to_dict() if summary.compensation is not None else None,
    }


def _combine(model: nn.Module, summaries: list[PruneSummary], kept_at_start: list[list[int]]) -> PruneSummary:
    """One summary of several rounds, ``removed`` numbered as the layers were before the first round."""
    if len(summaries) == 1:
        return summaries[0]
    if not summaries:
        params = count_parameters(model)
        return PruneSummary([], params, params)
    removed: dict[int, set[int]] = {}
    for summary in summaries:
        for change in summary.layers:
            removed.setdefault(change.layer, set()).update(change.removed_original)
    adapter = get_adapter(model)
    changes = []
    for layer in sorted(removed):
        original = sorted(removed[layer])
        now = adapter.layout(layer)
        before = [kept_at_start[layer].index(h) for h in original]
        changes.append(LayerChange(layer, before, original, now.num_heads, now.num_kv_heads))
    return PruneSummary(changes, summaries[0].params_before, summaries[-1].params_after)

"""One call from criteria to a smaller model: score, select, remove (in one round or several).

:class:`Pruner` cuts any mix of attention heads, MLP channels and whole layers (one
:class:`Part` per unit) with ONE call to :func:`sinv_prune.surgery.removal.prune`;
:class:`HeadPruner` is its heads-only signature.
"""

from __future__ import annotations

import inspect
import logging
import operator
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from sinv_prune.arch import get_adapter
from sinv_prune.scoring.allocation import Context, allocate, check_allocation, groups_for, needs_data
from sinv_prune.scoring.amounts import _Budget, check_amount, check_met
from sinv_prune.scoring.criteria import Criterion, Scores, TraceLike, criterion_class, get_criterion
from sinv_prune.scoring.obs_ranks import rank_by_obs
from sinv_prune.surgery import compensation
from sinv_prune.surgery import removal as surgery
from sinv_prune.surgery.record import get_record
from sinv_prune.surgery.removal import PruneSummary, count_parameters
from sinv_prune.surgery.store import PLACES
from sinv_prune.surgery.unit import score_rows
from sinv_prune.units import get_unit, units
from sinv_prune.units.common import MODES
from sinv_prune.units.heads import HEADS
from sinv_prune.units.heads.selection import DEFAULT_LAYOUT, check_layout

logger = logging.getLogger(__name__)

#: ``between_rounds(model, round_index)``: called after round ``round_index`` (0-based) when another follows.
RoundHook = Callable[[nn.Module, int], None]
#: What :meth:`Pruner.select` returns and :func:`sinv_prune.surgery.removal.prune` takes (current numbering):
#: ``{"heads": {layer: [heads]}, "mlp": {layer: [channels]}, "layers": [layers]}``, the units of the parts only.
Plan = dict[str, Any]


@dataclass
class Part:
    """One unit of a :class:`Pruner`: which criterion scores it, how much goes, and how it is selected.

    ``unit`` is a registered unit (:mod:`sinv_prune.units`): ``"heads"``, ``"mlp"`` (MLP channels),
    ``"layers"`` or one added with :func:`~sinv_prune.units.register_unit`. ``criterion`` is a
    registered name (built for ``unit`` with ``criterion_options``; a criterion taking a
    ``seed`` gets the part's ``seed`` unless the options set one) or a
    :class:`~sinv_prune.scoring.criteria.Criterion` instance scoring ``unit``. ``amount`` is an ``int``
    count or a ``float`` fraction of the unit. ``mode`` defaults to the unit's (``global``; experts:
    ``uniform``, the same count in every MoE layer). The rest is passed to the unit's selection:

    * heads: :func:`~sinv_prune.units.heads.selection.select_heads` (``mode``, ``layout``,
      ``min_per_layer`` = ``min_heads_per_layer``; 0 lets layers lose every head);
    * mlp: :func:`~sinv_prune.units.mlp.selection.select_channels` (``mode``, ``multiple``,
      ``min_per_layer`` = ``min_channels_per_layer`` >= 1);
    * layers: :func:`~sinv_prune.units.layers.select_layers` (``min_per_layer`` = ``min_layers``
      >= 1; ``mode`` must stay ``"global"``);
    * experts: :func:`~sinv_prune.units.mlp.selection.select_channels` over the MoE layers' experts
      (``min_per_layer`` >= ``num_experts_per_tok``, its default).

    ``seed`` orders equal scores; ``exact`` raises instead of cutting less than ``amount``.
    """

    unit: str
    criterion: str | Criterion
    amount: int | float | Mapping[str, float]
    mode: str | None = None
    criterion_options: Mapping[str, Any] | None = None
    layout: str = DEFAULT_LAYOUT
    min_per_layer: int | None = None
    multiple: int = 1
    seed: int = 0
    exact: bool = False
    allocation: str | None = None
    allocation_options: Mapping[str, Any] | None = None

    def __post_init__(self):
        kind = get_unit(self.unit)
        if self.mode is None:  # a non-uniform allocation spreads the cut itself, from global scores
            self.mode = kind.default_mode if self.allocation in (None, "uniform") else "global"
        if self.mode not in MODES:
            raise ValueError(f"unknown selection mode {self.mode!r}; choose one of {', '.join(MODES)}")
        check_layout(self.layout)
        self.amount = check_amount(self.amount)
        if self.allocation is not None:
            check_allocation(self.allocation, self.allocation_options)
            self._check_allocation(self.allocation)
        elif self.allocation_options:
            raise ValueError("allocation_options need an allocation")
        for key, default in unit_settings().items():
            if key not in kind.settings and getattr(self, key) != default:
                owners = " or ".join(u.name for u in units() if key in u.settings)
                raise ValueError(f"{key} applies to {owners} parts only, not {self.unit!r}")
        kind.check_part(self)
        if isinstance(self.criterion, str):
            options = dict(self.criterion_options or {})
            if "seed" in inspect.signature(criterion_class(self.criterion)).parameters:
                options.setdefault("seed", self.seed)
            self.criterion = get_criterion(self.criterion, unit=self.unit, **options)
        elif self.criterion_options:
            raise ValueError("criterion_options only apply when criterion is given by name")
        if not isinstance(self.criterion, Criterion):
            raise TypeError(f"criterion must be a registered name or a Criterion, got {type(self.criterion).__name__}")
        if self.criterion.unit != self.unit:
            raise ValueError(
                f"criterion {self.criterion.name!r} scores {self.criterion.unit!r}, not {self.unit!r} "
                f"(build it with get_criterion(name, unit={self.unit!r}))"
            )

    def _check_allocation(self, allocation: str) -> None:
        check_part_allocation(self.unit, self.mode, self.layout, allocation)

    @property
    def kind(self):
        """The part's :class:`~sinv_prune.surgery.unit.Unit`."""
        return get_unit(self.unit)

    def check_met(self, model: nn.Module) -> None:
        """Whether ``model`` (meta weights will do) has the amount this part asks for, under its settings: the
        check a recipe's preflight runs on every arm (:func:`~sinv_prune.scoring.amounts.check_met`)."""
        options = {key: getattr(self, key) for key in self.kind.settings}
        if self.min_per_layer is not None:
            options["min_per_layer"] = self.min_per_layer
        check_met(get_adapter(model), self.unit, self.amount, mode=self.mode, allocation=self.allocation or "uniform",
                  options=options)  # fmt: skip

    def report(self) -> dict:
        """The part's settings and its criterion's report (JSON-serialisable)."""
        out = {
            "unit": self.unit,
            "criterion": self.criterion.name,
            "criterion_report": self.criterion.report(),
            "amount": dict(self.amount) if isinstance(self.amount, Mapping) else self.amount,
            "mode": self.mode,
            "min_per_layer": self.min_per_layer,
            "seed": self.seed,
            "exact": self.exact,
            "allocation": self.allocation,
        }
        if self.allocation_options:
            out["allocation_options"] = dict(self.allocation_options)
        out.update(self.kind.part_settings(self))
        return out


class Pruner:
    """Criteria + selection + surgery for any mix of heads, MLP channels and layers, in one object.

    ``parts``: one :class:`Part` per unit (at most one each). :meth:`prune` scores every part,
    builds one plan and removes it with ONE call to :func:`sinv_prune.surgery.removal.prune`
    (a heads-only plan goes through :func:`~sinv_prune.prune_heads`, the same removal).

    **Mixed cuts.** Layers are selected first; heads and channels are then selected among the
    layers that stay only (their scores in removed layers are left out), so each part removes
    its amount on top of the removed layers. A ``float`` amount of heads or channels is then a
    fraction of those in the remaining layers. Everything is numbered as the model is when
    :meth:`select` is called.

    **Rounds.** ``rounds=k`` reaches the one-shot plan's totals (heads, channels and layers,
    counted by :meth:`select` on the model as given) in ``k`` rounds: each round re-scores the
    pruned model (``between_rounds(model, round_index)`` runs first) and removes about
    ``remaining / rounds_left`` of every unit, layers first; heads and channels count only
    in the layers that stay, so a layer dropped late does not shrink the cut. Channel floors
    (a quarter of a layer's width in ``global`` mode) stay those of the width at the start.
    Non-uniform allocations take ``rounds=1``. ``compensate`` (a method of :mod:`sinv_prune.surgery.compensation`,
    options in ``compensation_options``) is passed to the removal with the ``calibration``
    batches. ``allow_empty_layers`` (default: the heads part's ``min_per_layer == 0``) lets
    layers lose every head. ``store`` (``"cpu"`` or ``"disk"``) is the removal's
    (:func:`sinv_prune.prune`'s ``store=``): where its rollback copies wait until it returns.

    After a call: ``last_scores`` (``{unit: scores}``), ``last_selection`` (after ``select``: the plan;
    after ``prune``: what was removed, which under ``compensate="obs"`` differs from the plan, as
    OBS picks the units itself) and ``report()`` (per part; its ``selection`` and ``per_round`` name
    the removed units too).

    >>> pruner = Pruner([Part("layers", "block_influence", 2), Part("mlp", "activation", 0.25, multiple=8)])
    >>> summary = pruner.prune(model, batches=loader)
    """

    def __init__(
        self,
        parts: Sequence[Part],
        *,
        rounds: int = 1,
        between_rounds: RoundHook | None = None,
        compensate: str | None = None,
        compensation_options: Mapping[str, Any] | None = None,
        allow_empty_layers: bool | None = None,
        allocation: str | None = None,
        quiet: bool = False,
        store: str = "cpu",
    ):
        parts = list(parts) if isinstance(parts, Sequence) and not isinstance(parts, str) else None
        if not parts:
            raise ValueError("a Pruner needs a non-empty list of Part")
        for part in parts:
            if not isinstance(part, Part):
                raise ValueError(f"parts must be Part instances, got {type(part).__name__}")
        named = [p.unit for p in parts]
        if len(set(named)) != len(named):
            raise ValueError(f"one part per unit; got units {named}")
        order = [u.name for u in units()]  # whole layers first
        self.parts = sorted(parts, key=lambda p: order.index(p.unit))
        if allocation is not None:
            check_allocation(allocation)
            for part in parts:
                if part.allocation is None and not part.kind.whole_layers:
                    part._check_allocation(allocation)
        self.allocation = allocation
        self.rounds = _rounds(rounds)
        if self.rounds > 1 and any(self.allocation_of(p) != "uniform" for p in self.parts):
            raise ValueError("rounds > 1 re-select with the part's mode; a non-uniform allocation needs rounds=1")
        if between_rounds is not None and not callable(between_rounds):
            raise ValueError(f"between_rounds must be a callable (model, round_index), got {between_rounds!r}")
        self.between_rounds = between_rounds
        if compensate is not None and compensate not in compensation.METHODS:
            raise ValueError(f"unknown compensation {compensate!r}; choose one of {', '.join(compensation.METHODS)}")
        self.compensate = compensate
        self.compensation_options = dict(compensation_options or {})
        if allow_empty_layers is None:  # a part that lets layers lose every item (heads: min_per_layer 0)
            allow_empty_layers = any(p.min_per_layer == 0 for p in self.parts)
        self.allow_empty_layers = bool(allow_empty_layers)
        self.last_scores: dict[str, Scores] | None = None
        self.last_selection: Plan | None = None
        self.last_rounds: list[dict] = []
        self.last_allocation: list[dict] = []
        self.quiet = bool(quiet)
        if store not in PLACES:
            raise ValueError(f"store must be one of {', '.join(map(repr, PLACES))}, got {store!r}")
        self.store = store

    def allocation_of(self, part: Part) -> str:
        """The part's allocation: its own, else the pruner's, else ``uniform`` (layers: always ``uniform``)."""
        if part.kind.whole_layers:
            return "uniform"
        return part.allocation or self.allocation or "uniform"

    def part(self, unit: str) -> Part | None:
        """The part pruning ``unit``, or ``None``."""
        return next((p for p in self.parts if p.unit == unit), None)

    def score(
        self, model: nn.Module, batches: Iterable[Mapping[str, Any]] | None = None, trace: TraceLike | None = None
    ) -> dict[str, Scores]:
        """Every part's scores for ``model``, ``{unit: scores}`` (higher = keep)."""
        if batches is not None and iter(batches) is batches and sum(p.criterion.needs_data for p in self.parts) > 1:
            batches = list(batches)  # several criteria read them
        self.last_scores = {p.unit: p.criterion.compute(model, batches, trace) for p in self.parts}
        return self.last_scores

    def select(
        self,
        model: nn.Module,
        scores: Mapping[str, Scores] | None = None,
        *,
        batches: Iterable[Mapping[str, Any]] | None = None,
        trace: TraceLike | None = None,
        calibration: Iterable[Mapping[str, Any]] | None = None,
    ) -> Plan:
        """The plan for ``model``: layers first, then heads and channels among the remaining layers.

        ``scores`` (``{unit: scores}``) are computed unless given. Parts with a non-uniform
        allocation get their per-layer counts from :mod:`~sinv_prune.scoring.allocation` (parts
        sharing one allocation pool their parameter targets and the allocation splits them);
        ``sensitivity`` and ``search`` measure on ``calibration`` (else ``batches``).
        """
        data = calibration if calibration is not None else batches
        if data is not None and iter(data) is data:
            data = list(data)
            if calibration is None:
                batches = data
        if scores is None:
            scores = self.score(model, batches, trace)
        missing = [p.unit for p in self.parts if p.unit not in scores]
        if missing:
            raise ValueError(f"scores are missing for unit(s) {missing}")
        plan: Plan = {}
        adapter = get_adapter(model)
        kept = list(range(adapter.num_layers))
        budget = _Budget(model)
        for part in self.parts:  # whole layers first: the other units are selected among the layers that stay
            if part.kind.whole_layers:
                amount = budget.units(part.amount, part.unit, kept)
                plan[part.unit] = part.kind.select(model, part, scores[part.unit], amount, kept, False)
                kept = [layer for layer in kept if layer not in plan[part.unit]]
        pools: dict[str, list[Part]] = {}
        for part in self.parts:
            if not part.kind.whole_layers and self.allocation_of(part) != "uniform":
                pools.setdefault(self.allocation_of(part), []).append(part)
        for part in self.parts:
            if not part.kind.whole_layers and self.allocation_of(part) == "uniform":
                amount = budget.units(part.amount, part.unit, kept)
                plan[part.unit] = part.kind.select(model, part, scores[part.unit], amount, kept, part.exact)
        self.last_allocation = []
        for strategy, parts in pools.items():
            groups, target = [], 0
            for part in parts:
                rows = score_rows(scores[part.unit], adapter.num_layers, part.unit)
                groups += groups_for(model, part.unit, rows, kept, min_per_layer=part.min_per_layer,
                                     multiple=part.multiple, shape=part.layout, seed=part.seed)  # fmt: skip
                target += budget.params(part.amount, part.unit, kept)
            options = {}
            for part in parts:
                options.update(part.allocation_options or {})
            if self.compensate == "obs" and needs_data(strategy) and data:
                rank_by_obs(model, groups, data, quiet=self.quiet)  # measure the cuts OBS will make
            context = Context(model=model, batches=data, seed=parts[0].seed, options=options, quiet=self.quiet)
            decided = allocate(strategy, groups, target, context, exact=any(p.exact for p in parts))
            for g in groups:
                count = decided.counts[g.unit, g.layer]
                if count:
                    plan.setdefault(g.unit, {})[g.layer] = g.pick(count)
            for part in parts:
                plan.setdefault(part.unit, {})
            self.last_allocation.append({"units": [p.unit for p in parts], **decided.to_dict(groups)})
        self.last_selection = {unit.name: plan[unit.name] for unit in units() if unit.name in plan}
        return self.last_selection

    def prune(
        self,
        model: nn.Module,
        batches: Iterable[Mapping[str, Any]] | None = None,
        trace: TraceLike | None = None,
        calibration: Iterable[Mapping[str, Any]] | None = None,
    ) -> PruneSummary:
        """Score, select and remove everything the parts ask for from ``model`` in place.

        One plan, one removal call (per round). With ``compensate`` set
        the removal is compensated from ``calibration``; a missing ``calibration`` and every
        selection error raise before any change.
        """
        if self.compensate is not None and calibration is None:
            raise ValueError(f"compensate={self.compensate!r} needs calibration batches")
        removal: dict[str, Any] = {} if self.store == "cpu" else {"store": self.store}
        if self.allow_empty_layers:
            removal["allow_empty_layers"] = True
        if self.compensate is not None:
            removal.update(calibration=calibration, compensate=self.compensate, **self.compensation_options)
        if self.rounds > 1:
            return self._prune_rounds(model, batches, trace, calibration, removal)
        start = Geometry.of(model, self._units)
        plan = self.select(model, batches=batches, trace=trace, calibration=calibration)  # raises before any change
        if any(plan.values()):
            summary = surgery.prune(model, plan, **removal)
        else:
            params = count_parameters(model)
            summary = PruneSummary([], params, params)
        self.last_selection = _summary_plan(summary, self._units)
        self.last_rounds = [self._round_entry(0, _plan_counts(plan), summary, start)]
        return summary

    def _prune_rounds(self, model, batches, trace, calibration, removal) -> PruneSummary:
        """In ``rounds`` rounds to the one-shot plan's totals (see the class docstring)."""
        if batches is not None and iter(batches) is batches:
            batches = list(batches)  # every round iterates them again
        if "calibration" in removal and iter(calibration) is calibration:
            removal["calibration"] = list(calibration)
        start = Geometry.of(model, self._units)
        first = self.select(model, batches=batches, trace=trace, calibration=calibration)  # raises before any change
        totals = _plan_counts(first)
        summaries: list[PruneSummary] = []
        self.last_rounds = []
        for index in range(self.rounds):
            if index and not self._left(model, start, totals):
                break
            if index:
                if self.between_rounds is not None:
                    self.between_rounds(model, index - 1)
                self.score(model, batches, trace)
            before = Geometry.of(model, self._units)
            plan, requested = self._round_plan(model, start, before, totals, self.rounds - index)
            if not any(requested.values()):
                break
            if not any(plan.values()):
                logger.warning("sinv_prune: round %d can remove none of the %s left; stopping", index, requested)
                break
            summaries.append(surgery.prune(model, plan, **removal))
            self.last_rounds.append(self._round_entry(index, requested, summaries[-1], before))
        short = self._left(model, start, totals)
        if short:
            logger.warning("sinv_prune: %d rounds left %s of the one-shot totals %s uncut (granularity)",
                           self.rounds, short, totals)  # fmt: skip
        summary = _combine(model, summaries, start)
        self.last_selection = _summary_plan(summary, self._units)
        return summary

    def _left(self, model: nn.Module, start: Geometry, totals: dict) -> dict[str, int]:
        """Per unit, how many of the totals the model has not lost yet (heads, channels: in the layers it has)."""
        now = Geometry.of(model, self._units)
        left = {unit: now.left(start, totals, unit, range(len(now.layers))) for unit in totals}
        return {unit: n for unit, n in left.items() if n > 0}

    @property
    def _units(self) -> list[str]:
        """The parts' units, whole layers first."""
        return [p.unit for p in self.parts]

    def _round_plan(
        self, model: nn.Module, start: Geometry, now: Geometry, totals: dict, left: int
    ) -> tuple[Plan, dict]:
        """One round's plan from ``last_scores`` and what it asked for: ``remaining / left`` of each unit.

        ``now`` is the model's geometry as the round starts."""
        scores = self.last_scores
        kept, plan, requested = list(range(len(now.layers))), {}, {}
        for part in self.parts:  # whole layers first
            remaining = now.left(start, totals, part.unit, kept)
            requested[part.unit] = share = -(-remaining // left)
            if part.kind.whole_layers:
                plan[part.unit] = chosen = part.kind.select_round(model, part, scores[part.unit], share, remaining,
                                                                  kept, [])  # fmt: skip
                kept = [i for i in kept if i not in chosen]
            elif share <= 0:
                plan[part.unit] = {}
            else:
                start_sizes = [len(start.kept[part.unit][now.layers[i]]) for i in kept]
                plan[part.unit] = part.kind.select_round(model, part, scores[part.unit], share, remaining, kept,
                                                         start_sizes)  # fmt: skip
        return plan, requested

    def _round_entry(self, index: int, requested: dict, summary: PruneSummary, before: Geometry) -> dict:
        """One round for ``report()``: what it asked for and removed, layers and units in original numbering.

        The selection is read from ``summary`` (what the removal took), not from the round's plan:
        OBS compensation chooses its own units."""
        entry = {
            "round": index,
            "requested": dict(requested),
            "heads_removed": summary.heads_removed,
            "channels_removed": summary.channels_removed,
            "layers_removed": summary.layers_removed,
        }
        orig, selection = before.layers, {}
        for unit, removed in _summary_plan(summary, self._units).items():
            if get_unit(unit).whole_layers:
                selection[unit] = [orig[i] for i in removed]
            else:
                items = before.kept[unit]
                selection[unit] = {str(orig[i]): [items[orig[i]][x] for x in xs] for i, xs in removed.items()}
        entry["selection"] = selection
        entry["criterion_report"] = {p.unit: p.criterion.report() for p in self.parts}
        entry["compensation"] = summary.compensation.to_dict() if summary.compensation is not None else None
        return entry

    def report(self) -> dict:
        """Per part its settings and criterion report, plus the last plan and rounds (JSON-serialisable)."""
        return {
            "parts": [p.report() for p in self.parts],
            "rounds": self.rounds,
            "compensate": self.compensate,
            "allow_empty_layers": self.allow_empty_layers,
            "allocation": self.allocation,
            "allocations": self.last_allocation,
            "selection": _plan_json(self.last_selection or {}),
            "per_round": self.last_rounds,
        }

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.parts!r}, rounds={self.rounds})"


class HeadPruner(Pruner):
    """Criterion + selection + :func:`~sinv_prune.prune_heads` in one object (a :class:`Pruner` with one heads part).

    ``criterion`` is a registered name (built with ``criterion_options``; a criterion
    taking a ``seed`` gets the pruner's ``seed`` unless the options set one) or a
    :class:`~sinv_prune.scoring.criteria.Criterion` instance. ``amount``, ``mode``, ``layout``,
    ``min_heads_per_layer``, ``seed`` and ``exact`` mean what they mean in
    :func:`~sinv_prune.units.heads.selection.select_heads`; ``min_heads_per_layer=0`` lets layers
    lose every head (``prune`` then passes ``allow_empty_layers=True``; a recipe asks for
    that with ``prune.allow_empty_layers: true``). It is a :class:`Pruner` (one ``Part("heads", ...)``)
    in everything but its signature: ``score``, ``select``, ``last_scores``, ``last_selection`` and
    ``report()`` are keyed by unit (``{"heads": ...}``), in the one report shape of every pruner.

    **Iterative pruning.** ``rounds=k`` reaches the amount in ``k`` rounds, each re-scoring the
    already-pruned model (``batches`` are iterated once per round; a one-shot iterator is read
    into a list first):

    * The total is fixed first, on the model as given: the number of heads one-shot selection
      would remove (a float amount is a fraction of the heads the model has when ``prune`` is
      called, the unpruned count for a fresh model; ``exact`` and the shortfall warning apply
      to this total).
    * Round ``i`` asks for ``ceil(R / (k - i))`` heads, ``R`` the part of the total not yet
      removed, and removes the smallest valid cut of at least that many (at most ``R``). "Valid"
      is what :func:`~sinv_prune.units.heads.selection.select_heads` allows with the pruner's ``mode``,
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
    ``last_selection["heads"]`` is the same selection, and ``report()["per_round"]`` lists each round's
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
        quiet: bool = False,
    ):
        part = Part(HEADS.name, criterion, amount, mode=mode, criterion_options=criterion_options, layout=layout,
                    min_per_layer=min_heads_per_layer, seed=seed, exact=exact)  # fmt: skip
        super().__init__([part], rounds=rounds, between_rounds=between_rounds, compensate=compensate,
                         compensation_options=compensation_options, quiet=quiet)  # fmt: skip


def _plan_json(plan: Plan) -> dict:
    """A plan with string layer keys (JSON objects)."""
    return {unit: get_unit(unit).to_json(value) for unit, value in plan.items()}


def unit_settings() -> dict[str, Any]:
    """Every unit-specific :class:`Part` setting and its default (``layout``, ``multiple``, ...)."""
    return {key: default for unit in units() for key, default in unit.settings.items()}


def check_part_allocation(unit: str, mode: str, layout: str | None, allocation: str) -> None:
    """A non-uniform allocation decides per-layer amounts itself: per-layer units only, mode left at
    'global', heads under layout 'q_per_group' (one rule for ``Part`` and the recipe schema)."""
    if allocation == "uniform":
        return
    get_unit(unit).check_allocation(mode, layout, allocation)


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


@dataclass
class Geometry:
    """What a model holds now, in original numbering: its layers and, per unit and original layer, the items."""

    layers: list[int]
    kept: dict[str, dict[int, list[int]]]

    @classmethod
    def of(cls, model: nn.Module, units: Sequence[str] = ()) -> Geometry:
        """From the model's pruning record (an unpruned model: everything, numbered as it is), for the
        per-layer units among ``units`` (an adapter may not know MLPs)."""
        adapter, record = get_adapter(model), get_record(model.config)
        layers = record.kept_layers() if record is not None else list(range(adapter.num_layers))
        kept = {}
        for name in units:
            kind = get_unit(name)
            if not kind.whole_layers:
                kept[name] = {orig: kind.original_items(record, adapter, i, orig) for i, orig in enumerate(layers)}
        return cls(layers, kept)

    def left(self, start: Geometry, totals: Mapping[str, int], unit: str, kept: Sequence[int]) -> int:
        """How many of ``totals[unit]`` are still to go: layers since ``start``; heads or channels
        removed since ``start`` count only in the current layers ``kept`` (a dropped layer's do not)."""
        if get_unit(unit).whole_layers:
            return totals[unit] - (len(start.layers) - len(self.layers))
        now, then = self.kept[unit], start.kept[unit]
        return totals[unit] - sum(len(then[self.layers[i]]) - len(now[self.layers[i]]) for i in kept)


def _plan_counts(plan: Plan) -> dict[str, int]:
    """``{unit: how many}`` of a plan."""
    return {unit: get_unit(unit).count(value) for unit, value in plan.items()}


def _gone(then: list[int], now: list[int]) -> tuple[list[int], list[int]]:
    """The entries of ``then`` missing from ``now``: (their positions in ``then``, the entries)."""
    kept = set(now)
    where = [k for k, unit in enumerate(then) if unit not in kept]
    return where, [then[k] for k in where]


def _summary_plan(summary: PruneSummary, names: Sequence[str]) -> Plan:
    """What a summary removed of the units ``names``, numbered as the model was before it."""
    return {name: summary.removed(name) for name in names}


def _combine(model: nn.Module, summaries: list[PruneSummary], start: Geometry) -> PruneSummary:
    """One summary of several rounds: what the model lost since ``start``, numbered as it was then."""
    if len(summaries) == 1:
        return summaries[0]
    if not summaries:
        params = count_parameters(model)
        return PruneSummary([], params, params)
    adapter, end = get_adapter(model), Geometry.of(model, list(start.kept))
    position = {orig: i for i, orig in enumerate(end.layers)}
    dropped = [before for before, orig in enumerate(start.layers) if orig not in position]
    combined = PruneSummary([], summaries[0].params_before, summaries[-1].params_after, removed_layers=dropped,
                            removed_layers_original=[start.layers[i] for i in dropped])  # fmt: skip
    for name, items in start.kept.items():
        kind, changes = get_unit(name), []
        for before, orig in enumerate(start.layers):
            if orig not in position:
                continue
            where, gone = _gone(items[orig], end.kept[name][orig])
            if gone:
                changes.append(kind.change(adapter, before, where, gone, position[orig], end.kept[name][orig]))
        setattr(combined, kind.summary_field, changes)
    return combined

"""The contract every prunable unit fulfils (attention heads, MLP channels, whole layers, ...).

A unit is one kind of thing a plan removes. Its module says everything the rest of the code asks
of it, so that the plan, the selection, the allocation and the part checks iterate over the
registered units (:func:`units`, the registry below) instead of naming them:

* ``sizes(model)``: how many items each current layer holds (a whole-layer unit: ``[num_layers]``);
* ``cost(model, layer)``: the parameters one item of ``layer`` holds;
* ``gates(model)``: one multiplicative gate per item, for gradient criteria and allocation;
* ``settings`` / ``recipe_keys`` / ``check_part`` / ``check_allocation`` / ``allowed`` / ``check_amount``:
  how a selection is constrained (``Part``, the recipe, allocation groups, preflight);
* ``select`` / ``select_round``: the items a part removes (layers first, the rest among the layers that stay);
* ``validate``: a plan entry checked on the model (one-line ``ValueError``), nothing changed;
* ``cut`` / ``touched`` / ``rechoose`` / ``compensation_cuts``: the cut through the adapter, what the
  rollback snapshots, what OBS may re-choose and what compensation refits;
* ``record_cut`` / ``record_field`` / ``recorded`` / ``summary_field`` / ``removed`` / ``change`` /
  ``original_items``: the unit's entry in the pruning record and the summary, and its items in original
  numbering (rounds);
* ``info`` / ``card_label`` / ``card_text``: its words in ``sinv-prune info`` and the Hub card.

Whole-layer units (``whole_layers``) are dropped by the removal itself after the per-layer cuts. Here, in
``surgery/``, because the removal and reload iterate over the units, which use the surgery's record and cuts.
"""

from __future__ import annotations

import operator
import random
import re
from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any, ClassVar

from torch import nn

from sinv_prune.arch import HeadAdapter


class Unit(ABC):
    """One kind of prunable unit; register an instance with :func:`register_unit`.

    ``name`` is the key in plans, parts, recipes and scores; ``noun`` names one item in messages and
    ``plural`` its count (``f"{plural}_removed"`` in summaries). ``whole_layers``: the plan entry is a
    list of layers and is selected before the per-layer units. ``settings`` are the :class:`Part`
    fields only this unit takes (with the default every other unit must leave them at).
    ``min_floor`` is the smallest ``min_per_layer`` a part may ask for.
    """

    name: ClassVar[str]
    noun: ClassVar[str]
    plural: ClassVar[str]
    whole_layers: ClassVar[bool] = False
    settings: ClassVar[Mapping[str, Any]] = {}
    min_floor: ClassVar[int] = 1
    #: The selection ``mode`` a part of this unit gets when it names none.
    default_mode: ClassVar[str] = "global"
    #: Recipe keys only this unit's parts take -> the :class:`Part` field each fills.
    recipe_keys: ClassVar[Mapping[str, str]] = {}

    # -- what the model holds -------------------------------------------------------------

    @abstractmethod
    def sizes(self, model: nn.Module) -> list[int]:
        """Per current layer, how many items it holds."""

    @abstractmethod
    def cost(self, model: nn.Module, layer: int) -> int:
        """Parameters one item of (current) ``layer`` holds."""

    def gates(self, model: nn.Module, *, requires_grad: bool = True) -> AbstractContextManager[list]:
        """A context with one gate tensor per layer, one entry per item (gradient criteria, allocation)."""
        raise ValueError(f"unit {self.name!r} has no gates")

    # -- how a part is selected -----------------------------------------------------------

    def check_part(self, part) -> None:
        """The part's selection settings are ones this unit takes (one-line ``ValueError`` otherwise)."""
        if self.whole_layers and part.mode != "global":
            raise ValueError(
                f"a {self.name} part has one score per layer; its mode must be 'global', got {part.mode!r}"
            )
        least = 1 if part.min_per_layer is None else nonnegative(part.min_per_layer, "min_per_layer")
        if least < self.min_floor:
            raise ValueError(
                f"min_per_layer must be at least {self.min_floor} for {self.name!r} (0 would empty the model or an MLP)"
            )

    def part_settings(self, part) -> dict[str, Any]:
        """The part's unit-specific settings, for its report."""
        return {key: getattr(part, key) for key in self.settings}

    def check_allocation(self, mode: str, layout: str | None, allocation: str) -> None:
        """A non-uniform ``allocation`` decides per-layer amounts itself: refuse what contradicts it."""
        if self.whole_layers:
            raise ValueError(f"allocation {allocation!r} spreads heads or channels; a {self.name} part takes 'uniform'")
        if mode != "global":
            raise ValueError(f"allocation {allocation!r} decides how layers share the cut; leave mode at global")

    def allowed(self, model: nn.Module, layer: int, row: Sequence[float], min_per_layer: int | None,
                multiple: int, shape: str) -> tuple[list[int], Any]:  # fmt: skip
        """The removal counts a layer may take under the part's constraints (ascending, 0 first), and the
        layer's layout where picking needs it (an allocation's ``Group``)."""
        raise ValueError(f"unit {self.name!r} cannot be allocated per layer")

    def pick(self, scores: Sequence[float], count: int, layer: int, seed: int, layout: Any, shape: str) -> list[int]:
        """The ``count`` items of one layer that go: the lowest scores, ties broken by ``seed + layer``."""
        tie = list(range(len(scores)))
        random.Random(seed + layer).shuffle(tie)
        return sorted(sorted(range(len(scores)), key=lambda j: (scores[j], tie[j]))[:count])

    @abstractmethod
    def select(self, model: nn.Module, part, scores, amount, kept: list[int], exact: bool) -> Any:
        """The plan entry of ``part`` (current numbering): ``amount`` items among the layers ``kept``
        (a whole-layer unit: among all layers), lowest ``scores`` first under the part's constraints."""

    def check_amount(self, adapter: HeadAdapter, amount: Any, options: Mapping[str, Any]) -> None:  # noqa: B027
        """Whether a model (meta weights will do) has the ``amount`` a part asks for, under the part's
        ``options`` (``mode`` and its :class:`Part` settings); a one-line ``ValueError`` otherwise."""

    def select_round(self, model: nn.Module, part, scores, share: int, remaining: int, kept: list[int],
                     start_sizes: list[int]) -> Any:  # fmt: skip
        """One round's entry: ``share`` items (or the nearest achievable), else up to ``remaining``; ``{}`` if
        none. ``start_sizes``: per layer in ``kept``, the items it held when the rounds began."""
        for request in (share, remaining):
            try:
                return self.select(model, part, scores, request, kept, False)
            except ValueError:
                continue
        return {}

    # -- the model's geometry in original numbering ------------------------------------------

    def original_items(self, record, adapter: HeadAdapter, layer: int, orig: int) -> list[int]:
        """The items current ``layer`` (original ``orig``) still holds, in original numbering (``record``
        None: an unpruned model, numbered as it is)."""
        raise ValueError(f"unit {self.name!r} has no items per layer")

    def change(self, adapter: HeadAdapter, layer: int, where: list[int], gone: list[int], now: int, kept: list[int]):
        """The summary change of ``layer`` (numbering before) that lost ``where`` (``gone`` in original numbering);
        it is current layer ``now`` and keeps ``kept``."""
        raise ValueError(f"unit {self.name!r} has no changes per layer")

    # -- the pruning record (original numbering) ------------------------------------------------

    #: The :class:`~sinv_prune.surgery.record.PruningRecord` field (and JSON key) this unit's cuts are saved under.
    record_field: ClassVar[str] = ""

    def recorded(self, record) -> Any:
        """What the pruning ``record`` says this unit lost, original numbering: ``{layer: [items]}`` (a
        whole-layer unit: ``[layers]``)."""
        if not self.record_field:
            raise ValueError(f"unit {self.name!r} names no pruning record field")
        return getattr(record, self.record_field)

    def info(self, record, layer: int) -> str:
        """This unit's part of ``sinv-prune info``'s line for original ``layer`` (``""``: nothing to say); a
        whole-layer unit's non-empty text is the whole line."""
        return ""

    #: The word the Hub card's summary line gives this unit (``""``: the unit is not in that line).
    card_label: ClassVar[str] = ""

    def applies(self, record) -> bool:
        """Whether the recorded model has this unit at all (a dense model has no experts)."""
        return True

    def card_text(self, record) -> str:
        """This unit's phrase in the Hub card's summary line (when ``card_label`` is set)."""
        return ""

    def removed(self, summary) -> Any:
        """What a :class:`~sinv_prune.surgery.removal.PruneSummary` says this unit lost, as a plan entry."""
        if self.whole_layers:
            return list(summary.removed_layers)
        return {c.layer: sorted(c.removed) for c in getattr(summary, self.summary_field)}

    # -- the plan -------------------------------------------------------------------------

    @abstractmethod
    def validate(self, model: nn.Module, adapter: HeadAdapter, entry: Any, *, allow_empty_layers: bool = False) -> Any:
        """The plan entry checked on the model (current numbering): ``{layer: checked}`` for a per-layer
        unit, a sorted list of layers for a whole-layer one; a one-line ``ValueError`` otherwise."""

    # -- the cut (per-layer units; whole-layer units are dropped by the removal itself) ------

    #: The :class:`~sinv_prune.surgery.removal.PruneSummary` field this unit's changes go to.
    summary_field: ClassVar[str] = ""
    #: The items in messages about a plan ("layers [3] ... also have MLP channels named").
    described: ClassVar[str] = ""

    def check_compensation(  # noqa: B027  (most units accept every method)
        self, model: nn.Module, adapter: HeadAdapter, checked: Mapping, compensate: str | None
    ) -> None:
        """Refuse a compensation method that cannot refit after this unit's cut (one-line ``ValueError``)."""

    def touched(self, adapter: HeadAdapter, layer: int) -> list[nn.Module]:
        """The modules a cut of ``layer`` replaces weights or sizes of (the removal snapshots them)."""
        return []

    def cut(self, adapter: HeadAdapter, layer: int, checked: Any) -> None:
        """Slice one layer's checked entry out of the model, through the adapter."""
        raise ValueError(f"unit {self.name!r} is not cut per layer")

    def rechoose(self, adapter: HeadAdapter, layer: int, checked: Any, removed: list[int]) -> Any:
        """The checked entry of ``layer`` with ``removed`` in place of the planned items (OBS picks its own)."""
        raise ValueError(f"unit {self.name!r} cannot be re-chosen by compensation")

    def compensation_cuts(self, adapter: HeadAdapter, checked: Mapping, apply, choose) -> dict[int, list]:
        """Per layer the :class:`~sinv_prune.surgery.cuts.Cut` s compensation refits after this unit's cut."""
        return {}

    def rebuild(self, adapter: HeadAdapter, layer: int, orig: int, record) -> None:  # noqa: B027
        """Slice current ``layer`` (original ``orig``) of a freshly built model to the ``record``'s shapes."""

    def stock_refusal(self, adapter: HeadAdapter, record) -> str | None:
        """Why the stock class cannot describe this unit's cuts (None: it can)."""
        return None

    def state_config(self, model: nn.Module, adapter: HeadAdapter, record, stock: bool) -> None:  # noqa: B027
        """Write this unit's sizes into the config for the chosen reload route (``stock``: the pruned sizes)."""

    def record_cut(self, record, origin: list[int], checked: Mapping) -> list:
        """Write the checked entry into the pruning ``record`` (original numbering); the per-layer changes."""
        raise ValueError(f"unit {self.name!r} has no record entry")

    def count(self, entry: Any) -> int:
        """How many items a plan entry removes."""
        return len(entry) if self.whole_layers else sum(map(len, entry.values()))

    def to_json(self, entry: Any) -> Any:
        """A plan entry with string layer keys (JSON objects)."""
        return list(entry) if self.whole_layers else {str(k): list(v) for k, v in entry.items()}

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


# -- checks shared by the units' plan entries ---------------------------------------------


def score_rows(scores, layers: int, unit: str) -> list:
    """``scores`` checked to have one row per layer (the selection checks the rows)."""
    if isinstance(scores, str) or not isinstance(scores, Sequence) or len(scores) != layers:
        got = len(scores) if isinstance(scores, Sequence) else type(scores).__name__
        raise ValueError(f"{unit} scores must be a list per layer of the {layers} layers, got {got}")
    return list(scores)


def per_layer(adapter: HeadAdapter, request: Mapping, unit: str, noun: str) -> Iterator[tuple[int, list[int]]]:
    """``(layer, indices)`` of a ``{layer: [indices]}`` request, in layer order; layers in range, named once,
    indices integers without repeats (``unit`` prefixes the messages: ``""`` for heads, ``"mlp "``)."""
    num_layers, seen = adapter.num_layers, {}
    where = f"{unit.strip()}: " if unit else ""
    for raw_layer, raw in sorted(request.items(), key=lambda kv: index(kv[0], "layer")):
        layer = index(raw_layer, "layer")
        if not 0 <= layer < num_layers:
            raise ValueError(f"{where}unknown layer {layer}: the model has layers 0..{num_layers - 1}")
        if layer in seen:
            raise ValueError(f"{where}layer {layer} is named more than once (keys {raw_layer!r} and {seen[layer]!r})")
        seen[layer] = raw_layer
        items = index_list(raw, f"{unit}layer {layer}: {noun}s", f"{noun} indices" if not unit else "indices")
        removed = [index(i, f"{noun} in layer {layer}") for i in items]
        if len(set(removed)) != len(removed):
            dupes = sorted({i for i in removed if removed.count(i) > 1})
            raise ValueError(f"{unit}layer {layer}: duplicate {noun} indices {dupes}")
        yield layer, removed


def index_list(value, what: str, items: str = "indices") -> list:
    """A collection of indices as a list; a bare index, a string or a mapping is refused, not iterated."""
    if not isinstance(value, (str, bytes, Mapping)):
        try:
            return list(value)
        except TypeError:
            pass
    raise ValueError(f"{what} must be a collection of {items}, got {value!r}")


def index(value, what: str) -> int:
    if isinstance(value, (bool, float)):
        raise ValueError(f"{what} index must be an integer, got {value!r}")
    if isinstance(value, str) and value.lstrip("-").isdigit():
        return int(value)
    try:
        return operator.index(value)
    except TypeError:
        raise ValueError(f"{what} index must be an integer, got {value!r}") from None


def nonnegative(value, what: str) -> int:
    if isinstance(value, bool):
        raise ValueError(f"{what} must be a non-negative integer, got {value!r}")
    try:
        value = operator.index(value)
    except TypeError:
        raise ValueError(f"{what} must be a non-negative integer, got {value!r}") from None
    if value < 0:
        raise ValueError(f"{what} must be a non-negative integer, got {value!r}")
    return value


# -- the registry: name -> Unit instance ------------------------------------------------

_UNITS: dict[str, Unit] = {}
_NAME = re.compile(r"^[a-z][a-z0-9_]*$")


def register_unit(unit: Unit) -> Unit:
    """Add ``unit`` under ``unit.name`` (lower snake case); refuses a taken name. Returns ``unit``."""
    if not isinstance(unit, Unit):
        raise TypeError(f"register_unit takes a Unit instance, got {type(unit).__name__}")
    name = getattr(unit, "name", None)
    if not isinstance(name, str) or not _NAME.match(name):
        raise ValueError(f"unit name must be lower snake case, got {name!r}")
    if name in _UNITS:
        raise ValueError(f"unit {name!r} is already registered ({type(_UNITS[name]).__name__})")
    _UNITS[name] = unit
    return unit


def unregister_unit(name: str) -> None:
    """Remove a unit :func:`register_unit` added; an unknown name raises."""
    if _UNITS.pop(name, None) is None:
        raise ValueError(f"unit {name!r} is not registered")


def unit_names() -> tuple[str, ...]:
    """The registered units' names for messages and schemas: per-layer units in registration order, then
    whole-layer ones (``heads``, ``mlp``, ..., ``layers``)."""
    return tuple(sorted(_UNITS, key=lambda name: _UNITS[name].whole_layers))


def units() -> list[Unit]:
    """The registered units, whole-layer units first (they are selected and cut first)."""
    return sorted(_UNITS.values(), key=lambda u: not u.whole_layers)


def get_unit(name: str) -> Unit:
    """The unit registered as ``name``; an unknown name raises a one-line ``ValueError`` listing the known."""
    unit = _UNITS.get(name) if isinstance(name, str) else None
    if unit is None:
        raise ValueError(f"unknown unit {name!r}; choose one of {', '.join(unit_names())}")
    return unit

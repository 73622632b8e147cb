"""Whole layers: transformer blocks dropped from the stack (block output = block input); the removal drops
them (:func:`sinv_prune.surgery.shapes.drop_layers`) after the per-layer cuts."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

from torch import nn

from sinv_prune.arch import HeadAdapter, get_adapter
from sinv_prune.surgery.unit import Unit, index, index_list, nonnegative, register_unit
from sinv_prune.units.common import amount_count, distinct_ranks


class LayersUnit(Unit):
    """Whole blocks, ``[layers]``; selected first (the other units then among the layers that stay);
    ``min_per_layer`` is the number of layers that stay (at least 1)."""

    name = "layers"
    noun = "layer"
    plural = "layers"
    whole_layers = True

    def sizes(self, model: nn.Module) -> list[int]:
        return [get_adapter(model).num_layers]

    def cost(self, model: nn.Module, layer: int) -> int:
        return sum(p.numel() for p in get_adapter(model).layers()[layer].parameters())

    def select(self, model, part, scores, amount, kept, exact):
        rows = layer_scores(scores, len(kept))
        return select_layers(rows, amount, min_layers=part.min_per_layer or 1, seed=part.seed)

    def select_round(self, model, part, scores, share, remaining, kept, start_sizes):
        return self.select(model, part, scores, share, kept, False) if share else []

    def check_amount(self, adapter, amount, options) -> None:
        layers = adapter.num_layers
        if isinstance(amount, int) and amount >= layers:
            raise ValueError(f"{amount} layers requested, the model has {layers} (one must stay)")

    def validate(self, model, adapter, entry, *, allow_empty_layers=False):
        return plan_layers(model, adapter, entry or [])

    record_field = "removed_layers"
    card_label = "Depth"

    def info(self, record, layer):
        return "removed (the whole block)" if layer in self.recorded(record) else ""

    def card_text(self, record):
        removed = self.recorded(record)
        return f"{len(removed)} whole blocks removed (original layers {removed or 'none'})"


def layer_scores(scores, layers: int) -> list:
    """Layer scores checked to have one entry per layer."""
    if isinstance(scores, str) or not isinstance(scores, Sequence) or len(scores) != layers:
        got = len(scores) if isinstance(scores, Sequence) else type(scores).__name__
        raise ValueError(f"layer scores must have one float for each of the {layers} layers, got {got}")
    return list(scores)


def plan_layers(model: nn.Module, adapter: HeadAdapter, layers: Iterable[int]) -> list[int]:
    """Validate the ``"layers"`` part of a plan: sorted block indices to drop, current numbering."""
    removed = [index(i, "layer") for i in index_list(layers, "plan['layers']")]
    if not removed:
        return []
    num_layers = adapter.num_layers
    bad = [i for i in removed if not 0 <= i < num_layers]
    if bad:
        raise ValueError(f"layers {bad} out of range: the model has layers 0..{num_layers - 1}")
    if len(set(removed)) != len(removed):
        raise ValueError(f"duplicate layer indices {sorted({i for i in removed if removed.count(i) > 1})}")
    if len(removed) == num_layers:
        raise ValueError(f"removing all {num_layers} layers is refused: at least one must stay")
    config = model.config
    if getattr(config, "scale_attn_by_inverse_layer_idx", False):
        raise ValueError("layers cannot be removed while scale_attn_by_inverse_layer_idx ties attention to depth")
    if getattr(config, "is_heterogeneous", False):
        raise ValueError("layers cannot be removed from a heterogeneous (per_layer_config) model")
    return sorted(removed)


def select_layers(scores: Sequence[float], amount: int | float, *, min_layers: int = 1, seed: int = 0) -> list[int]:
    """Layers to remove (current numbering, ascending): the ``amount`` lowest-scored ones.

    ``scores``: one float per current layer, higher = keep; ``amount``: an ``int`` number of
    layers or a ``float`` fraction of them (rounded half up); at least ``min_layers`` (>= 1)
    stay. Equal scores are ordered by a permutation drawn from ``seed``.
    """
    values = []
    for layer, value in enumerate(scores):
        if isinstance(value, Sequence | nn.Module | bool):
            raise ValueError(f"layer scores are one float per layer; layer {layer} has {type(value).__name__}")
        value = float(value)
        if math.isnan(value):
            raise ValueError(f"layer {layer}: a NaN score cannot be ranked")
        values.append(value)
    keep = nonnegative(min_layers, "min_layers")
    if keep < 1:
        raise ValueError("min_layers must be at least 1 (a model cannot lose every layer)")
    wanted = amount_count(amount, len(values), "layers", "a count")
    if wanted and len(values) - wanted < keep:
        raise ValueError(f"removing {wanted} of {len(values)} layers would leave fewer than min_layers={keep}")
    ranks = distinct_ranks([values], "global", seed)[0]
    return sorted(sorted(range(len(values)), key=ranks.__getitem__)[:wanted])


LAYERS = register_unit(LayersUnit())

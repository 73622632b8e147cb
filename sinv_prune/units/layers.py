"""Whole layers: transformer blocks dropped from the stack (block output = block input)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from torch import nn

from sinv_prune.arch import HeadAdapter, get_adapter
from sinv_prune.scoring.selection_units import select_layers
from sinv_prune.units.base import Unit, index, index_list
from sinv_prune.units.registry import register_unit


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


LAYERS = register_unit(LayersUnit())

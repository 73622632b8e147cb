"""MLP channels: the intermediate channels of each layer's MLP (up / gate rows, down columns)."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass

from torch import nn

from sinv_prune.arch import HeadAdapter, get_adapter
from sinv_prune.log_level import log_level
from sinv_prune.scoring.gates import channel_gates
from sinv_prune.scoring.selection import _nonnegative
from sinv_prune.scoring.selection_units import _removals, quarter, select_channels
from sinv_prune.surgery.cuts import mlp_cuts
from sinv_prune.surgery.record import PruningRecord
from sinv_prune.surgery.shapes import apply_mlp
from sinv_prune.units.base import Unit, per_layer, score_rows
from sinv_prune.units.registry import register_unit


class MlpUnit(Unit):
    """MLP channels, ``{layer: [channels]}``; a layer keeps at least one; ``multiple`` keeps widths a multiple of m."""

    name = "mlp"
    noun = "channel"
    plural = "channels"
    settings = {"multiple": 1}
    recipe_keys = {"multiple": "multiple", "min_channels_per_layer": "min_per_layer"}

    def sizes(self, model: nn.Module) -> list[int]:
        adapter = get_adapter(model)
        return [adapter.intermediate_size(layer) for layer in range(adapter.num_layers)]

    def cost(self, model: nn.Module, layer: int) -> int:
        return channel_cost(model, layer)

    def gates(self, model: nn.Module, *, requires_grad: bool = True) -> AbstractContextManager[list]:
        return channel_gates(model, requires_grad=requires_grad)

    def check_part(self, part) -> None:
        super().check_part(part)
        if isinstance(part.multiple, bool) or _nonnegative(part.multiple, "multiple") < 1:
            raise ValueError(f"multiple must be a positive integer, got {part.multiple!r}")

    def allowed(self, model, layer, row, min_per_layer, multiple, shape):
        width = get_adapter(model).intermediate_size(layer)
        if len(row) != width:
            raise ValueError(f"layer {layer}: {len(row)} scores for {width} channels")
        least = quarter(width) if min_per_layer is None else min_per_layer
        return _removals(width, least, multiple), None

    def validate(self, model, adapter, entry, *, allow_empty_layers=False):
        return plan_channels(adapter, {} if entry is None else entry)

    def select(self, model, part, scores, amount, kept, exact):
        sizes = self.sizes(model)
        rows = score_rows(scores, len(sizes), self.name)
        kept = [layer for layer in kept if sizes[layer]]  # mixture-of-experts layers have no dense channels
        chosen = select_channels(
            [sizes[layer] for layer in kept],
            [rows[layer] for layer in kept],
            amount,
            mode=part.mode,
            min_channels_per_layer=part.min_per_layer,
            multiple=part.multiple,
            seed=part.seed,
            exact=exact,
        )
        return {kept[i]: channels for i, channels in chosen.items()}

    def check_amount(self, adapter, amount, options) -> None:
        widths = [w for w in (adapter.intermediate_size(layer) for layer in range(adapter.num_layers)) if w]
        if not widths:
            raise ValueError("every layer is a mixture of experts: there are no dense MLP channels (prune experts)")
        layers, total = len(widths), sum(widths)
        keep = options.get("min_per_layer", 1)
        most = total - keep * layers
        if isinstance(amount, int) and amount > most:
            raise ValueError(
                f"{amount} MLP channels requested, at most {most} can go "
                f"({total} in {layers} layers, {keep} kept per layer)"
            )

    def select_round(self, model, part, scores, share, remaining, kept, start_sizes):
        """``share`` channels (or the nearest achievable below; else up to ``remaining``); ``{}`` if none.

        Floors are those of the widths at the start: a quarter of each in ``global`` mode unless the
        part sets ``min_per_layer``, so rounds do not starve a layer one quarter at a time.
        """
        sizes = self.sizes(model)
        rows = score_rows(scores, len(sizes), self.name)
        keep = [i for i, layer in enumerate(kept) if sizes[layer]]  # mixture-of-experts layers have no dense channels
        kept, start_sizes = [kept[i] for i in keep], [start_sizes[i] for i in keep]
        floor = part.min_per_layer
        if floor is None and part.mode == "global":
            floor = [quarter(n) for n in start_sizes]
        for request in (share, remaining):
            try:
                with log_level(select_channels.__module__, logging.ERROR):  # a share the multiple misses: ours
                    chosen = select_channels([sizes[i] for i in kept], [rows[i] for i in kept], request,
                                             mode=part.mode, min_channels_per_layer=floor, multiple=part.multiple,
                                             seed=part.seed)  # fmt: skip
            except ValueError:
                continue
            return {kept[i]: channels for i, channels in chosen.items()}
        return {}

    def original_items(self, record, adapter, layer, orig):
        known = record is not None and record.intermediate_size  # older records: unpruned MLPs
        return record.kept_channels(orig) if known else list(range(adapter.intermediate_size(layer)))

    def change(self, adapter, layer, where, gone, now, kept):
        return MlpChange(layer, where, gone, len(kept))

    summary_field = "mlp"
    described = "MLP channels"
    record_field = "pruned_mlp"
    card_label = "MLP"

    def info(self, record, layer):
        if not self.recorded(record):
            return ""
        return f"  MLP channels kept {len(record.kept_channels(layer))}/{record.intermediate_size}"

    def card_text(self, record):
        widths = sorted({len(record.kept_channels(i)) for i in record.kept_layers()})
        width = f"{widths[0]}" if len(widths) == 1 else f"{widths[0]} to {widths[-1]}"
        return f"{width} of {record.intermediate_size} MLP channels kept per remaining layer"

    def check_compensation(self, model, adapter, checked, compensate) -> None:
        if compensate != "bias":
            return
        no_bias = [i for i in checked if getattr(adapter.mlp_out(i), "bias", None) is None]
        if no_bias:
            raise ValueError(
                f"compensate='bias' needs an MLP down-projection bias, which {model.config.model_type} lacks "
                f"(layers {no_bias[:5]}); use compensate='lsq' for MLP channels"
            )

    def touched(self, adapter: HeadAdapter, layer: int) -> list[nn.Module]:
        return adapter.mlp_modules(layer)

    def rebuild(self, adapter: HeadAdapter, layer: int, orig: int, record: PruningRecord) -> None:
        if record.pruned_mlp.get(orig):
            apply_mlp(adapter, layer, record.kept_channels(orig))

    def cut(self, adapter: HeadAdapter, layer: int, checked) -> None:
        apply_mlp(adapter, layer, checked[1])

    def rechoose(self, adapter: HeadAdapter, layer: int, checked, removed: list[int]):
        width = len(checked[0]) + len(checked[1])
        return (removed, [c for c in range(width) if c not in set(removed)])

    def compensation_cuts(self, adapter: HeadAdapter, checked, apply, choose) -> dict[int, list]:
        return mlp_cuts(adapter, checked, apply, choose)

    def record_cut(self, record: PruningRecord, origin: list[int], checked) -> list[MlpChange]:
        changes = []
        for layer, (removed, keep) in checked.items():
            kept_original = record.kept_channels(origin[layer])
            removed_original = [kept_original[c] for c in removed]
            record.pruned_mlp[origin[layer]] = sorted(
                set(record.pruned_mlp.get(origin[layer], [])) | set(removed_original)
            )
            changes.append(MlpChange(layer, removed, removed_original, len(keep)))
        return changes


@dataclass
class MlpChange:
    """What happened to one layer's MLP channels: numbering before this call and the original one."""

    layer: int
    removed: list[int]
    removed_original: list[int]
    kept: int


def channel_cost(model: nn.Module, layer: int) -> int:
    """Parameters one MLP channel of ``layer`` holds: its rows (and biases) in gate / up, its down column."""
    adapter = get_adapter(model)
    width = adapter.intermediate_size(layer)
    rows = sum(p.numel() for m in adapter.mlp_in(layer) for p in m.parameters())
    out = adapter.mlp_out(layer).weight.numel()
    return (rows + out) // width if width else 0


def plan_channels(adapter: HeadAdapter, mlp: Mapping[int, Iterable[int]]) -> dict[int, tuple[list[int], list[int]]]:
    """Validate the ``"mlp"`` part of a plan; per layer: (removed, kept channels), current numbering."""
    if not isinstance(mlp, Mapping):
        raise ValueError(f"plan['mlp'] must map layer index -> channel indices, got {type(mlp).__name__}")
    out = {}
    for layer, removed in per_layer(adapter, mlp, "mlp ", "channel"):
        width = adapter.intermediate_size(layer)
        if removed and not width and adapter.num_experts(layer):
            raise ValueError(f"mlp layer {layer}: a mixture-of-experts layer has no dense MLP channels (prune experts)")
        bad = [c for c in removed if not 0 <= c < width]
        if bad:
            raise ValueError(f"mlp layer {layer}: channel indices {bad} out of range 0..{width - 1}")
        if not removed:
            continue
        if len(removed) == width:
            raise ValueError(f"mlp layer {layer}: removing all {width} channels is refused; remove the layer instead")
        gone = set(removed)
        out[layer] = (sorted(removed), [c for c in range(width) if c not in gone])
    return out


MLP = register_unit(MlpUnit())

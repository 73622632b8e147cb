"""Attention heads: the query heads of each layer (a KV head goes when all of its query heads go)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass

from torch import nn

from sinv_prune.arch import HeadAdapter, HeadLayout, get_adapter
from sinv_prune.surgery.record import PruningRecord
from sinv_prune.surgery.unit import Unit, per_layer, register_unit, score_rows
from sinv_prune.units.heads.cuts import apply_layer, head_cuts
from sinv_prune.units.heads.gates import head_gates
from sinv_prune.units.heads.selection import DEFAULT_LAYOUT, layer_configs, model_layouts, select_heads


class HeadsUnit(Unit):
    """Query heads, ``{layer: [heads]}``; selection under a GQA ``layout``; ``min_per_layer`` may be 0
    (``allow_empty_layers``)."""

    name = "heads"
    noun = "head"
    plural = "heads"
    settings = {"layout": DEFAULT_LAYOUT}
    min_floor = 0
    recipe_keys = {"layout": "layout", "min_heads_per_layer": "min_per_layer"}

    def sizes(self, model: nn.Module) -> list[int]:
        adapter = get_adapter(model)
        return [adapter.layout(layer).num_heads for layer in range(adapter.num_layers)]

    def cost(self, model: nn.Module, layer: int) -> int:
        return head_cost(model, layer)

    def gates(self, model: nn.Module, *, requires_grad: bool = True) -> AbstractContextManager[list]:
        return head_gates(model, requires_grad=requires_grad)

    def check_allocation(self, mode: str, layout: str | None, allocation: str) -> None:
        super().check_allocation(mode, layout, allocation)
        if layout != "q_per_group":
            raise ValueError(f"allocation {allocation!r} needs layout 'q_per_group' for heads, got {layout!r}")

    def allowed(self, model, layer, row, min_per_layer, multiple, shape):
        lay = get_adapter(model).layout(layer)
        if len(row) != lay.num_heads:
            raise ValueError(f"layer {layer}: {len(row)} scores for {lay.num_heads} heads")
        if shape != "q_per_group" and lay.group_size > 1:
            raise ValueError(f"a non-uniform allocation needs layout 'q_per_group' for heads, got {shape!r}")
        least = 1 if min_per_layer is None else min_per_layer
        return head_removals(lay, least, shape), lay

    def pick(self, scores: Sequence[float], count: int, layer: int, seed: int, layout, shape: str) -> list[int]:
        chosen = select_heads([list(scores)], count, layouts=[layout], layout=shape, min_heads_per_layer=0,
                              seed=seed + layer, exact=True)  # fmt: skip
        return chosen.get(0, [])

    def validate(self, model, adapter, entry, *, allow_empty_layers=False):
        return plan_removal(adapter, entry or {}, allow_empty_layers=allow_empty_layers)

    def select(self, model, part, scores, amount, kept, exact):
        layouts = model_layouts(model)
        least = 1 if part.min_per_layer is None else part.min_per_layer
        options = dict(mode=part.mode, layout=part.layout, min_heads_per_layer=least, seed=part.seed)
        if kept is None or len(kept) == len(layouts):
            return select_heads(scores, amount, layouts=layouts, exact=exact, **options)
        rows = score_rows(scores, len(layouts), self.name)
        chosen = select_heads(
            [rows[layer] for layer in kept], amount, layouts=[layouts[layer] for layer in kept], exact=exact, **options
        )
        return {kept[i]: h for i, h in chosen.items()}

    def check_amount(self, adapter, amount, options) -> None:
        if adapter.heads_refusal:
            raise ValueError(f"heads cannot be removed: {adapter.heads_refusal}")
        layouts = [adapter.layout(i) for i in range(adapter.num_layers)]
        total = sum(lay.num_heads for lay in layouts)
        if isinstance(amount, int) and amount > total:
            raise ValueError(f"{amount} heads requested, the model has {total}")
        dummy = [[0.0] * lay.num_heads for lay in layouts]
        select_heads(dummy, amount, layouts=layouts, mode=options["mode"], layout=options.get("layout", DEFAULT_LAYOUT),
                     min_heads_per_layer=options.get("min_per_layer", 1))  # fmt: skip

    def select_round(self, model, part, scores, share, remaining, kept, start_sizes):
        """The smallest valid cut of at least ``share`` heads and at most ``remaining``; ``{}`` if none."""
        self.select(model, part, scores, 0, kept, False)  # bad scores (shape, NaN) raise here, not below
        for request in range(share, remaining + 1):
            try:
                return self.select(model, part, scores, request, kept, True)
            except ValueError:
                continue
        return {}

    def original_items(self, record, adapter, layer, orig):
        return record.kept_heads(orig) if record is not None else list(range(adapter.layout(layer).num_heads))

    def change(self, adapter, layer, where, gone, now, kept):
        lay = adapter.layout(now)
        return LayerChange(layer, where, gone, lay.num_heads, lay.num_kv_heads)

    summary_field = "layers"
    described = "heads"
    record_field = "pruned_heads"

    def info(self, record, layer):
        removed = sorted(self.recorded(record).get(layer, []))
        return f"kept {record.num_heads - len(removed):>3}  removed {removed}"

    def touched(self, adapter: HeadAdapter, layer: int) -> list[nn.Module]:
        return adapter.touched_modules(layer)

    def cut(self, adapter: HeadAdapter, layer: int, checked) -> None:
        apply_layer(adapter, layer, *checked[1:])

    def rebuild(self, adapter: HeadAdapter, layer: int, orig: int, record: PruningRecord) -> None:
        if record.pruned_heads.get(orig):
            apply_layer(adapter, layer, record.kept_heads(orig), record.kept_kv_heads(orig))

    def rechoose(self, adapter: HeadAdapter, layer: int, checked, removed: list[int]):
        return plan_removal(adapter, {layer: removed}, allow_empty_layers=True)[layer]

    def compensation_cuts(self, adapter: HeadAdapter, checked, apply, choose) -> dict[int, list]:
        return head_cuts(adapter, checked, apply, choose)

    def record_cut(self, record: PruningRecord, origin: list[int], checked) -> list[LayerChange]:
        changes = []
        for layer, (removed, keep_q, keep_kv) in checked.items():
            kept_original = record.kept_heads(origin[layer])
            removed_original = [kept_original[h] for h in removed]
            record.pruned_heads[origin[layer]] = sorted(
                set(record.pruned_heads.get(origin[layer], [])) | set(removed_original)
            )
            changes.append(LayerChange(layer, removed, removed_original, len(keep_q), len(keep_kv)))
        return changes


@dataclass
class LayerChange:
    """What happened to one layer's heads: indices in the numbering before this call and the original one."""

    layer: int
    removed: list[int]
    removed_original: list[int]
    kept: int
    kept_kv: int


def head_cost(model: nn.Module, layer: int) -> int:
    """Parameters one query head of ``layer`` holds with its KV head kept: its q rows (+ bias) and o columns."""
    adapter = get_adapter(model)
    lay = adapter.layout(layer)
    if not lay.num_heads:
        return 0
    proj = adapter.projections(layer)
    bias = proj.q_bias.numel() if proj.q_bias is not None else 0
    return (proj.q.numel() + proj.o.numel() + bias) // lay.num_heads


def head_removals(layout: HeadLayout, min_heads: int, shape: str) -> list[int]:
    """Head counts a layer may lose under ``shape`` (q_per_group keeps every KV head, so cost per head is fixed)."""
    configs = layer_configs(list(range(layout.num_heads)), layout, min_heads, shape)
    return sorted({layout.num_heads - s * c for s, c in configs})


def plan_removal(
    adapter: HeadAdapter, heads: Mapping[int, Iterable[int]], *, allow_empty_layers: bool = False
) -> dict[int, tuple[list[int], list[int], list[int]]]:
    """Validate a request; per layer: (removed, kept query heads, kept KV heads), current numbering."""
    if not isinstance(heads, Mapping):
        raise ValueError(f"heads must map layer index -> head indices, got {type(heads).__name__}")
    plan = {}
    for layer, removed in per_layer(adapter, heads, "", "head"):
        refusal = getattr(adapter, "heads_refusal", None)  # adapters only; plain layouts (tests) have none
        if removed and refusal:
            raise ValueError(f"layer {layer}: heads cannot be removed: {refusal}")
        layout = adapter.layout(layer)
        bad = [h for h in removed if not 0 <= h < layout.num_heads]
        if bad:
            raise ValueError(f"layer {layer}: head indices {bad} out of range 0..{layout.num_heads - 1}")
        if not removed:
            continue
        keep_q = [h for h in range(layout.num_heads) if h not in set(removed)]
        if not keep_q and not allow_empty_layers:
            raise ValueError(f"layer {layer}: removing all {layout.num_heads} heads needs allow_empty_layers=True")
        group = layout.group_size
        sizes = {kv: sum(1 for h in keep_q if h // group == kv) for kv in range(layout.num_kv_heads)}
        if len({s for s in sizes.values() if s}) > 1:
            raise ValueError(
                f"layer {layer}: GQA query groups would become unequal (heads kept per KV head: {list(sizes.values())})"
            )
        plan[layer] = (sorted(removed), keep_q, [kv for kv, s in sizes.items() if s])
    return plan


HEADS = register_unit(HeadsUnit())

"""A head plan's cuts: the slicing of a layer's heads and the :class:`~sinv_prune.surgery.cuts.Cut` of its
output projection that compensation refits (and OBS may re-choose within)."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from sinv_prune.arch import HeadAdapter
from sinv_prune.arch.base import head_rows
from sinv_prune.surgery.cuts import Cut
from sinv_prune.surgery.offload import compute_device


def head_cuts(
    adapter: HeadAdapter,
    plan: Mapping[int, tuple],
    apply: Callable[[int], None],
    choose: Callable[[int, list[int]], None] | None = None,
) -> dict[int, list[Cut]]:
    """One :class:`Cut` per layer of a head plan (``layer -> (removed, keep_q, keep_kv)``); ``apply(layer)`` slices.

    OBS may re-choose heads within each KV group (each group keeps as many as planned), or among
    all heads where every head has its own KV head. Where a layer's plan removes whole KV groups
    only (each group untouched or emptied), the unit is one KV group (its query heads
    ``g * group .. (g + 1) * group - 1`` are ``group x head_dim`` adjacent output projection columns)
    and OBS chooses which groups go, as many as planned; ``choose`` gets their query heads, and the
    KV heads go with them. Removing a KV group also drops its k/v rows, which only zeroes those
    heads' outputs: the output projection's input is still the whole objective. Mixed plans (some
    groups emptied, the others losing as many heads each) keep the per-group quotas, so the emptied
    groups stay as planned.
    """
    cuts = {}
    for layer, (removed, keep_q, _) in plan.items():
        consumer, layout = adapter.out_proj(layer), adapter.layout(layer)
        device, head_dim = compute_device(consumer), layout.head_dim
        columns = [head_rows(torch.tensor(h, dtype=torch.long, device=device), head_dim) for h in (keep_q, removed)]
        group = layout.group_size
        lost = [sum(1 for h in removed if h // group == kv) for kv in range(layout.num_kv_heads)]
        width, expand = head_dim, None
        if group == 1:
            quotas = [(list(range(layout.num_heads)), len(removed))]
        elif set(lost) <= {0, group}:  # whole KV groups: OBS chooses among the groups
            quotas = [(list(range(layout.num_kv_heads)), len(removed) // group)]
            width, expand = group * head_dim, group
        else:
            quotas = [(list(range(kv * group, (kv + 1) * group)), n) for kv, n in enumerate(lost)]
        pick = None if choose is None else _chooser(choose, layer, expand)
        norm = adapter.attention_residual_norm(layer)
        cuts[layer] = [Cut("heads", consumer, *columns, lambda layer=layer: apply(layer), width, quotas, pick, norm)]
    return cuts


def _chooser(choose: Callable[[int, list[int]], None], layer: int, group: int | None) -> Callable[[list[int]], None]:
    """``choose`` for one layer's cut: units are heads, or (``group``) KV groups handed on as their query heads."""
    if group is None:
        return lambda units: choose(layer, units)
    return lambda groups: choose(layer, [g * group + i for g in groups for i in range(group)])


def apply_layer(adapter: HeadAdapter, layer: int, keep_q: list[int], keep_kv: list[int]) -> None:
    """Slice one layer to the given heads; an empty layer gets a forward that needs no heads."""
    device = adapter.out_proj(layer).weight.device
    adapter.slice_heads(
        layer,
        torch.tensor(keep_q, dtype=torch.long, device=device),
        torch.tensor(keep_kv, dtype=torch.long, device=device),
    )
    if not keep_q:
        adapter.attention(layer).forward = adapter.empty_forward(layer)

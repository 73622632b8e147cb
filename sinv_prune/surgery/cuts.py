"""The consumers a plan cuts: one :class:`Cut` per consumer linear (output projection, MLP down projection).

Compensation (:mod:`sinv_prune.surgery.compensation`) refits each cut's consumer; OBS may re-choose
which units go, within the quotas a cut carries (per KV group for heads under GQA).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch
from torch import nn

from sinv_prune.arch import HeadAdapter
from sinv_prune.arch.base import head_rows
from sinv_prune.surgery.offload import compute_device


@dataclass
class Cut:
    """One consumer of a block losing input columns: ``apply()`` slices the block, ``kept`` columns stay.

    ``kept`` and ``removed`` index the unpruned consumer's input. A unit is ``width`` columns;
    ``quotas`` lists groups of units and how many each loses, and ``choose(units)`` makes the
    plan remove those units instead (OBS). A block's cuts are in forward order.
    """

    unit: str
    consumer: nn.Module
    kept: torch.Tensor
    removed: torch.Tensor
    apply: Callable[[], None]
    width: int = 1
    quotas: list[tuple[list[int], int]] = field(default_factory=list)
    choose: Callable[[list[int]], None] | None = None

    def reselect(self, removed_units: list[int]) -> None:
        """Remove ``removed_units`` instead of the planned ones."""
        units = self.consumer_width // self.width
        keep = [u for u in range(units) if u not in set(removed_units)]
        device = self.kept.device
        self.kept, self.removed = (_columns(torch.tensor(u, dtype=torch.long, device=device), self.width)
                                   for u in (keep, removed_units))  # fmt: skip
        if self.choose is not None:
            self.choose(sorted(removed_units))

    @property
    def consumer_width(self) -> int:
        return self.kept.numel() + self.removed.numel()


def _columns(units: torch.Tensor, width: int) -> torch.Tensor:
    return units if width == 1 else head_rows(units, width)


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
        cuts[layer] = [Cut("heads", consumer, *columns, lambda layer=layer: apply(layer), width, quotas, pick)]
    return cuts


def _chooser(choose: Callable[[int, list[int]], None], layer: int, group: int | None) -> Callable[[list[int]], None]:
    """``choose`` for one layer's cut: units are heads, or (``group``) KV groups handed on as their query heads."""
    if group is None:
        return lambda units: choose(layer, units)
    return lambda groups: choose(layer, [g * group + i for g in groups for i in range(group)])


def mlp_cuts(
    adapter: HeadAdapter,
    plan: Mapping[int, tuple[list[int], list[int]]],
    apply: Callable[[int], None],
    choose: Callable[[int, list[int]], None] | None = None,
) -> dict[int, list[Cut]]:
    """One :class:`Cut` of the down projection per layer of a channel plan (``layer -> (removed, kept)``)."""
    cuts = {}
    for layer, (removed, keep) in plan.items():
        consumer = adapter.mlp_out(layer)
        device = compute_device(consumer)
        columns = [torch.tensor(c, dtype=torch.long, device=device) for c in (keep, removed)]
        quotas = [(list(range(len(keep) + len(removed))), len(removed))]
        pick = None if choose is None else (lambda units, layer=layer: choose(layer, units))
        cuts[layer] = [Cut("mlp", consumer, *columns, lambda layer=layer: apply(layer), 1, quotas, pick)]
    return cuts

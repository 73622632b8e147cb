"""Selection: head scores + an amount + constraints -> the heads to remove, per layer.

:func:`select_heads` turns a criterion's scores (higher = keep) into a request for
:func:`sinv_prune.prune_heads`. How it works:

1. **Order.** Every head gets a distinct rank: by score (``global``, ``uniform``) or by
   its rank within its own layer divided by the layer's head count (``per_layer``: the
   weakest head of every layer comes first, so layers lose heads in proportion to their
   size and scores are never compared across layers). Equal keys are ordered by a
   permutation drawn from ``seed``. Only the order of the scores matters, never their scale.
2. **What a layer may keep.** With ``G`` KV groups of ``g`` query heads, a valid layer keeps
   ``c`` heads in each of ``s`` groups and none in the others (``1 <= c <= g``,
   ``0 <= s <= G``; without GQA ``g = 1``). For each ``(s, c)`` the best heads are exact:
   every group keeps its ``c`` highest-ranked heads and the ``s`` groups with the largest
   sum of those ranks survive. The cost of a configuration is the sum of the ranks it
   removes; for each number of removed heads the layer keeps its cheapest configuration.
   ``min_heads_per_layer`` drops configurations keeping fewer heads (0 allows emptying a
   layer, which ``prune_heads`` then needs ``allow_empty_layers=True`` for).
   ``layout`` restricts the configurations (in layers with GQA, ``g > 1``):

   * ``"q_per_group"`` (default): every KV group stays (``s == G``) and loses the same number
     of query heads; the KV heads, K/V weights and KV cache are untouched.
   * ``"kv_groups"``: whole KV groups go (``c == g``), with their K/V weights and cache.
   * ``"auto"``: any valid ``(s, c)``, the cheapest by rank.

   Without GQA (``g = 1``) a query head is its own KV group and the three are the same thing.
3. **Amount.** ``global`` / ``per_layer``: a knapsack over layers (dynamic programming)
   picks one configuration per layer removing exactly the requested number of heads at the
   least total cost. Without GQA this is exactly "the lowest-ranked heads, skipping layers
   at their minimum". ``uniform``: one ``(s, c)`` for every layer, so all layers end with the
   same head and KV-head counts (LLaMA-family checkpoints then reload on stock classes).

When the exact amount cannot be met (GQA granularity, the layout, or ``uniform`` needing a
multiple of the layer count), the largest achievable number **not exceeding** the amount is
removed and a warning is logged; ``exact=True`` raises instead. A ``ValueError`` (naming the
layout) is raised for an amount beyond the heads that may be removed, or when nothing at all
can be removed within it.

Why ``q_per_group`` is the default in every mode: under ``auto`` the criterion decides the
shape as well as the heads. Criteria that score a group's heads alike (``magnitude`` sums
weights that include the shared K/V) make a whole group the cheapest cut, others make one query
head per group the cheapest, so two arms with the same amount and mode would differ in
parameters, KV cache and kind of damage (SmolLM2, uniform 90: 30 KV heads removed for
magnitude, none for taylor). That confound is as real for ``global`` / ``per_layer`` as for
``uniform``, and a default that changed with the mode would change an arm's shape when only its
distribution over layers was meant to change; so the default is the same everywhere, and the
one that keeps every KV head (what weight compensation within a group needs). ``auto`` (finest
granularity: a SmolLM2 layer may lose 3, 5, 6, 7 or 8 heads instead of 3 or 6) and
``kv_groups`` (a smaller KV cache) are explicit choices.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import NamedTuple

from torch import nn

from sinv_prune.arch import HeadLayout, get_adapter
from sinv_prune.surgery.unit import nonnegative
from sinv_prune.units.common import MODES, amount_count, distinct_ranks, knapsack_layers

logger = logging.getLogger(__name__)

LAYOUTS = ("q_per_group", "kv_groups", "auto")
DEFAULT_LAYOUT = "q_per_group"


class _Config(NamedTuple):
    cost: int
    groups: int  # s: KV groups kept
    per_group: int  # c: query heads kept in each of them


def model_layouts(model: nn.Module) -> list[HeadLayout]:
    """The current head layout of every layer of ``model``."""
    adapter = get_adapter(model)
    return [adapter.layout(layer) for layer in range(adapter.num_layers)]


def select_heads(
    scores: Sequence[Sequence[float]],
    amount: int | float,
    *,
    layouts: Sequence[HeadLayout] | nn.Module,
    mode: str = "global",
    layout: str = DEFAULT_LAYOUT,
    min_heads_per_layer: int = 1,
    seed: int = 0,
    exact: bool = False,
) -> dict[int, list[int]]:
    """Heads to remove, ``{layer: [heads]}`` in current numbering (layers losing none are left out).

    Args:
        scores: per layer, one score per current query head; higher = keep.
        amount: an ``int`` number of heads, or a ``float`` fraction in ``[0, 1]`` of all heads
            (rounded half up).
        layouts: each layer's :class:`~sinv_prune.arch.HeadLayout`, or the model itself.
        mode: ``"global"``, ``"per_layer"`` or ``"uniform"`` (see the module docstring).
        layout: ``"q_per_group"``, ``"kv_groups"`` or ``"auto"``: which GQA cuts are allowed (see above).
        min_heads_per_layer: heads every layer keeps at least (layers already below keep theirs).
        seed: orders equal scores; the same inputs and seed give the same result.
        exact: raise instead of removing fewer heads when the amount cannot be met exactly.
    """
    if isinstance(layouts, nn.Module):
        layouts = model_layouts(layouts)
    if mode not in MODES:
        raise ValueError(f"unknown selection mode {mode!r}; choose one of {', '.join(MODES)}")
    check_layout(layout)
    min_heads = nonnegative(min_heads_per_layer, "min_heads_per_layer")
    rows = _check_scores(scores, layouts)
    total = sum(len(r) for r in rows)
    wanted = amount_count(amount, total)
    if wanted == 0:
        return {}
    ranks = distinct_ranks(rows, mode, seed)
    configs = [layer_configs(r, lay, min_heads, layout) for r, lay in zip(ranks, layouts, strict=True)]
    where = _where(layouts, layout, min_heads)
    if mode == "uniform":
        chosen = _uniform(configs, layouts, wanted, where)
    else:
        options = [_by_removed(c, lay.num_heads) for c, lay in zip(configs, layouts, strict=True)]
        chosen = knapsack_layers(options, wanted, where)
    got = sum(lay.num_heads - cfg.groups * cfg.per_group for cfg, lay in zip(chosen, layouts, strict=True))
    if got != wanted:
        if exact or got == 0:
            raise ValueError(
                f"cannot remove exactly {wanted} heads in mode {mode!r} {where}"
                + (f"; the nearest achievable below is {got}" if got else "; no smaller removal is possible either")
            )
        logger.warning(
            "sinv_prune: %d heads requested, %d removed (nearest achievable not exceeding, layout %r)",
            wanted,
            got,
            layout,
        )
    out = {}
    for layer, (r, lay, cfg) in enumerate(zip(ranks, layouts, chosen, strict=True)):
        removed = _removed(r, lay, cfg)
        if removed:
            out[layer] = removed
    return out


# -- inputs -------------------------------------------------------------------------------


def check_layout(layout: str) -> str:
    """``layout`` if it is one of :data:`LAYOUTS`, else a ``ValueError`` listing them."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown selection layout {layout!r}; choose one of {', '.join(LAYOUTS)}")
    return layout


def _check_scores(scores, layouts) -> list[list[float]]:
    if len(scores) != len(layouts):
        raise ValueError(f"scores cover {len(scores)} layers, layouts {len(layouts)}")
    rows = []
    for layer, (row, lay) in enumerate(zip(scores, layouts, strict=True)):
        row = [float(x) for x in row]
        if len(row) != lay.num_heads:
            raise ValueError(f"layer {layer}: {len(row)} scores for {lay.num_heads} heads")
        if lay.num_heads and (not lay.num_kv_heads or lay.num_heads % lay.num_kv_heads):
            raise ValueError(f"layer {layer}: {lay.num_heads} heads do not split into {lay.num_kv_heads} KV groups")
        if any(math.isnan(x) for x in row):
            raise ValueError(f"layer {layer}: NaN scores cannot be ranked")
        rows.append(row)
    return rows


def _describe(layouts) -> str:
    """``KV groups x group size`` per layer, once when every layer is alike."""
    shapes = [f"{lay.num_kv_heads}x{lay.group_size}" for lay in layouts]
    return f"{len(shapes)} layers of {shapes[0]}" if len(set(shapes)) == 1 and len(shapes) > 1 else ", ".join(shapes)


def _where(layouts, layout: str, min_heads: int) -> str:
    """The constraints an amount failed against, for error messages (the layout only matters with GQA)."""
    if any(lay.group_size > 1 for lay in layouts):
        return f"with layout {layout!r} and min_heads_per_layer={min_heads} (GQA groups: {_describe(layouts)})"
    return f"with min_heads_per_layer={min_heads}"


# -- ranking ------------------------------------------------------------------------------


# -- per layer ----------------------------------------------------------------------------


def _groups(ranks: list[int], layout: HeadLayout) -> list[list[int]]:
    """Per KV group, its query heads from highest rank (keep first) to lowest."""
    g = layout.group_size
    return [sorted(range(k * g, (k + 1) * g), key=lambda h: -ranks[h]) for k in range(layout.num_kv_heads)]


def _survivors(ranks: list[int], groups: list[list[int]], c: int) -> list[int]:
    """KV groups ordered by the rank sum of their ``c`` best heads, best first (ties: lower index)."""
    top = [sum(ranks[h] for h in group[:c]) for group in groups]
    return sorted(range(len(groups)), key=lambda k: (-top[k], k))


def layer_configs(ranks: list[int], layout: HeadLayout, min_heads: int, shape: str) -> dict[tuple[int, int], _Config]:
    """Every kept configuration ``(s, c)`` of one layer valid in ``shape``, with its cost (sum of removed ranks)."""
    heads, total = layout.num_heads, sum(ranks)
    keep_all = (layout.num_kv_heads, layout.group_size)
    out = {keep_all: _Config(0, *keep_all)}
    if heads == 0:
        return out
    gqa = layout.group_size > 1
    groups = _groups(ranks, layout)
    for c in range(1, layout.group_size + 1):
        if shape == "kv_groups" and c != layout.group_size:
            continue
        kept = 0
        for s, k in enumerate(_survivors(ranks, groups, c), start=1):
            kept += sum(ranks[h] for h in groups[k][:c])
            if shape == "q_per_group" and gqa and s != layout.num_kv_heads:
                continue
            if s * c >= min_heads:
                out[s, c] = _Config(total - kept, s, c)
    if min_heads == 0 and not (shape == "q_per_group" and gqa):
        out[0, 0] = _Config(total, 0, 0)
    return out


def _by_removed(configs: dict[tuple[int, int], _Config], heads: int) -> dict[int, _Config]:
    """The cheapest configuration for each number of removed heads."""
    out: dict[int, _Config] = {}
    for (s, c), cfg in sorted(configs.items()):
        removed = heads - s * c
        if removed not in out or cfg.cost < out[removed].cost:
            out[removed] = cfg
    return out


def _removed(ranks: list[int], layout: HeadLayout, cfg: _Config) -> list[int]:
    if cfg.groups * cfg.per_group == layout.num_heads:
        return []
    groups = _groups(ranks, layout)
    kept = set()
    if cfg.groups:
        for k in _survivors(ranks, groups, cfg.per_group)[: cfg.groups]:
            kept.update(groups[k][: cfg.per_group])
    return [h for h in range(layout.num_heads) if h not in kept]


# -- across layers ------------------------------------------------------------------------


def _uniform(configs: list[dict], layouts: Sequence[HeadLayout], wanted: int, where: str) -> list[_Config]:
    """The same ``(s, c)`` in every layer: the largest removal ``<= wanted``, then the least cost."""
    common = set.intersection(*(set(c) for c in configs))
    if not common:
        raise ValueError(f"uniform: no head configuration is valid in every layer {where}")
    heads = sum(lay.num_heads for lay in layouts)
    scored = []
    for key in sorted(common):
        removed = heads - len(layouts) * key[0] * key[1]
        cost = sum(c[key].cost for c in configs)
        scored.append((removed, cost, key))
    most = max(r for r, _, _ in scored)
    if most < wanted:
        raise ValueError(f"uniform: amount {wanted} is larger than the {most} heads that may be removed {where}")
    fitting = [s for s in scored if s[0] <= wanted]
    if not fitting:
        raise ValueError(f"uniform: no removal of at most {wanted} heads leaves every layer alike {where}")
    removed, _, key = max(fitting, key=lambda s: (s[0], -s[1]))
    return [c[key] for c in configs]

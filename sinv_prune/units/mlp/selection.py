"""Selection of MLP channels: scores + an amount + constraints -> the channels to remove.

The counterpart of :func:`sinv_prune.units.heads.selection.select_heads` for channels (and, with
``items="experts"``, the experts unit's experts) a criterion scores (higher = keep), ordered the
same way: by score (``global``, ``uniform``) or by rank within the layer over the layer's size
(``per_layer``), equal keys by a permutation drawn from ``seed``; only the order of the scores matters.

:func:`select_channels`: in ``global`` mode the scores are first standardised within each layer
(``(s - mean) / std``, FLAP), because criteria's raw scales differ from layer to layer (ranking raw
Wanda scores across SmolLM2's layers left one layer 141 of 1536 channels and an 11x worse model),
and by default every layer keeps at least a quarter of its width. A layer keeps ``k`` channels with
``k >= min_channels_per_layer`` and ``k`` a multiple of ``multiple`` (unless it loses none), so kept
widths stay friendly to matrix kernels (8, 64...). Within a layer the lowest-ranked channels go. ``global`` /
``per_layer`` remove the requested number at the least total rank over layers (the globally
lowest ranks, skipping layers at their minimum, when ``multiple == 1``; a knapsack over layers
otherwise); ``uniform`` leaves every layer with the same channel count. As for heads, when the
amount cannot be met exactly the largest achievable number not exceeding it is removed with a
warning (``exact=True`` raises).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from functools import reduce
from itertools import accumulate
from typing import NamedTuple

from torch import nn

from sinv_prune.arch import get_adapter
from sinv_prune.surgery.unit import nonnegative
from sinv_prune.units.common import MODES, amount_count, distinct_ranks, knapsack_layers


def standardize(scores: Sequence[float]) -> list[float]:
    """``(s - mean) / std`` within one layer (all zero when the scores are constant): FLAP's scale."""
    n = len(scores)
    if not n:
        return []
    mean = math.fsum(scores) / n
    std = math.sqrt(math.fsum((x - mean) ** 2 for x in scores) / n)
    return [(x - mean) / std for x in scores] if std > 0 else [0.0] * n


def _widths(model: nn.Module) -> list[int]:
    """Current number of MLP channels in every layer."""
    adapter = get_adapter(model)
    return [adapter.intermediate_size(layer) for layer in range(adapter.num_layers)]


def quarter(width: int) -> int:
    """The least width a layer keeps by default when layers share the cut unevenly: a quarter (at least 1)."""
    return max(1, math.ceil(width / 4))


logger = logging.getLogger(__name__)


class _Option(NamedTuple):
    cost: int
    removed: int


def select_channels(
    model_or_sizes: nn.Module | Sequence[int],
    scores: Sequence[Sequence[float]],
    amount: int | float,
    *,
    mode: str = "global",
    min_channels_per_layer: int | Sequence[int] | None = None,
    multiple: int = 1,
    seed: int = 0,
    exact: bool = False,
    items: str = "channels",
) -> dict[int, list[int]]:
    """MLP channels to remove, ``{layer: [channels]}`` in current numbering (untouched layers left out).

    Args:
        model_or_sizes: the model, or its current MLP width per layer.
        scores: per layer, one score per current channel; higher = keep.
        amount: an ``int`` number of channels, or a ``float`` fraction in ``[0, 1]`` of all
            channels (rounded half up).
        mode: ``"global"``, ``"per_layer"`` or ``"uniform"`` (see the module docstring).
        min_channels_per_layer: channels every layer keeps at least (>= 1: an MLP cannot lose
            them all; layers already below keep theirs), or one such floor per layer. Default: a
            quarter of each layer's width in ``global`` mode (so no layer is starved), 1 otherwise.
        multiple: every layer that loses channels keeps a multiple of this many.
        seed: orders equal scores; the same inputs and seed give the same result.
        exact: raise instead of removing fewer channels when the amount cannot be met exactly.
        items: what the messages call the items (the experts unit selects experts here too).
    """
    sizes = _widths(model_or_sizes) if isinstance(model_or_sizes, nn.Module) else _sizes(model_or_sizes)
    if mode not in MODES:
        raise ValueError(f"unknown selection mode {mode!r}; choose one of {', '.join(MODES)}")
    floors = None
    if isinstance(min_channels_per_layer, Sequence):
        floors = [_floor(v) for v in min_channels_per_layer]
        if len(floors) != len(sizes):
            raise ValueError(f"min_channels_per_layer has {len(floors)} floors for {len(sizes)} layers")
        if mode == "uniform":
            raise ValueError("mode 'uniform' takes one min_channels_per_layer for every layer, not one per layer")
        min_keep = None
    else:
        min_keep = None if min_channels_per_layer is None else _floor(min_channels_per_layer)
    step = nonnegative(multiple, "multiple")
    if step < 1:
        raise ValueError(f"multiple must be a positive integer, got {multiple!r}")
    rows = _check_rows(scores, sizes)
    wanted = amount_count(amount, sum(sizes), items, "a count")
    if wanted == 0:
        return {}
    # global: scores standardised within each layer first (FLAP), so no layer's scale decides for it.
    ranks = distinct_ranks([standardize(r) for r in rows] if mode == "global" else rows, mode, seed)
    order = [sorted(range(len(r)), key=r.__getitem__) for r in ranks]  # lowest rank (remove first) first
    if floors is not None:
        keeps, shown = floors, "per-layer floors"
    else:
        keeps = [(quarter(n) if mode == "global" else 1) if min_keep is None else min_keep for n in sizes]
        shown = "a quarter of each layer" if min_keep is None and mode == "global" else (min_keep or 1)
    allowed = [removal_counts(n, keep, step) for n, keep in zip(sizes, keeps, strict=True)]
    floor = "min_channels_per_layer" if items == "channels" else f"min_{items}_per_layer"
    where = f"with {floor}={shown} and multiple={step}" if step != 1 or items == "channels" else f"with {floor}={shown}"
    if mode == "uniform":
        counts = _uniform(sizes, min_keep or 1, step, wanted, where, items)
    else:
        most = sum(a[-1] for a in allowed)
        if most < wanted:
            raise ValueError(f"amount {wanted} is larger than the {most} {items} that may be removed {where}")
        if step == 1:
            counts = _lowest(ranks, [a[-1] for a in allowed], wanted)
        else:
            counts = _fewest_cost(ranks, order, allowed, wanted, where)
    got = sum(counts)
    if got != wanted:
        if exact or got == 0:
            raise ValueError(
                f"cannot remove exactly {wanted} {items} in mode {mode!r} {where}"
                + (f"; the nearest achievable below is {got}" if got else "; no smaller removal is possible either")
            )
        logger.warning("sinv_prune: %d %s requested, %d removed (nearest achievable not exceeding)", wanted, items, got)
    return {layer: sorted(order[layer][:c]) for layer, c in enumerate(counts) if c}


def _floor(value) -> int:
    floor = nonnegative(value, "min_channels_per_layer")
    if floor < 1:
        raise ValueError("min_channels_per_layer must be at least 1 (an MLP cannot lose every channel)")
    return floor


# -- inputs -------------------------------------------------------------------------------


def _sizes(sizes: Sequence[int]) -> list[int]:
    if isinstance(sizes, str | bytes) or not isinstance(sizes, Sequence):
        raise ValueError(f"channel sizes must be a model or a list of ints per layer, got {type(sizes).__name__}")
    return [nonnegative(n, f"channel count of layer {layer}") for layer, n in enumerate(sizes)]


def _check_rows(scores, sizes: list[int]) -> list[list[float]]:
    if len(scores) != len(sizes):
        raise ValueError(f"channel scores cover {len(scores)} layers, the model has {len(sizes)}")
    rows = []
    for layer, (row, n) in enumerate(zip(scores, sizes, strict=True)):
        if not isinstance(row, Sequence) or isinstance(row, str):
            raise ValueError(f"channel scores are a list per layer; layer {layer} has {type(row).__name__}")
        row = [float(x) for x in row]
        if len(row) != n:
            raise ValueError(f"layer {layer}: {len(row)} scores for {n} channels")
        if any(math.isnan(x) for x in row):
            raise ValueError(f"layer {layer}: NaN scores cannot be ranked")
        rows.append(row)
    return rows


# -- per layer and across layers ----------------------------------------------------------


def removal_counts(n: int, min_keep: int, step: int) -> list[int]:
    """Numbers of channels a layer of ``n`` may lose, ascending (0 first)."""
    kept = [k for k in range(step, n, step) if k >= min_keep]
    return [0] + [n - k for k in reversed(kept)]


def _lowest(ranks: list[list[int]], caps: list[int], wanted: int) -> list[int]:
    """Per layer, how many of the globally lowest-ranked channels go, no layer beyond its cap."""
    counts = [0] * len(ranks)
    for _, layer in sorted((rank, layer) for layer, row in enumerate(ranks) for rank in row):
        if counts[layer] < caps[layer]:
            counts[layer] += 1
            wanted -= 1
            if not wanted:
                break
    return counts


def _fewest_cost(ranks, order, allowed: list[list[int]], wanted: int, where: str) -> list[int]:
    """Per layer, channels removed: the most ``<= wanted`` in allowed steps, at the least total rank."""
    unit = reduce(math.gcd, (r for a in allowed for r in a), 0) or 1  # every achievable total is a multiple
    options = []
    for row, lowest, removals in zip(ranks, order, allowed, strict=True):
        prefix = [0, *accumulate(row[c] for c in lowest)]
        options.append({r // unit: _Option(prefix[r], r) for r in removals})
    return [opt.removed for opt in knapsack_layers(options, wanted // unit, where)]


def _uniform(sizes: list[int], min_keep: int, step: int, wanted: int, where: str, items: str = "channels") -> list[int]:
    """Every layer keeps the same count ``k``: the largest removal ``<= wanted``."""
    smallest = min(sizes)
    candidates = [k for k in range(step, smallest + 1, step) if k >= min_keep]
    if len(set(sizes)) == 1 and smallest not in candidates:
        candidates.append(smallest)  # every layer as it is
    if not candidates:
        raise ValueError(f"uniform: no count is valid in every layer {where} (smallest layer: {smallest})")
    removal = {k: sum(n - k for n in sizes) for k in candidates}
    most = max(removal.values())
    if most < wanted:
        raise ValueError(f"uniform: amount {wanted} is larger than the {most} {items} that may be removed {where}")
    fitting = [k for k in candidates if removal[k] <= wanted]
    if not fitting:
        raise ValueError(f"uniform: no removal of at most {wanted} {items} leaves every layer alike {where}")
    k = min(fitting)
    return [n - k for n in sizes]

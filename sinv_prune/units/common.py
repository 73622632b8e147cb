"""What several units share: the selections' modes, amounts, ranks and knapsack over layers; the gate hook."""

from __future__ import annotations

import math
import random
from fractions import Fraction

import numpy as np
import torch

from sinv_prune.surgery.unit import nonnegative

MODES = ("global", "per_layer", "uniform")
INF = np.int64(2**62)


def amount_count(amount, total: int, noun: str = "heads", count_of: str = "a head count") -> int:
    """An int amount, or a float fraction of ``total`` rounded half up, checked against ``total`` ``noun``
    (``count_of`` names an int amount in the message refusing a float outside [0, 1])."""
    if isinstance(amount, float):
        if not 0.0 <= amount <= 1.0:
            raise ValueError(f"a float amount is a fraction in [0, 1], got {amount!r} (pass an int for {count_of})")
        return math.floor(amount * total + 0.5)
    count = nonnegative(amount, "amount")
    if count > total:
        raise ValueError(f"amount {count} is larger than the {total} {noun} of the model")
    return count


def distinct_ranks(rows: list[list[float]], mode: str, seed: int) -> list[list[int]]:
    """A distinct integer rank per head (0 = first to remove)."""
    heads = [(layer, h) for layer, row in enumerate(rows) for h in range(len(row))]
    order = list(range(len(heads)))
    random.Random(seed).shuffle(order)
    tie = dict(zip(heads, order, strict=True))
    if mode == "per_layer":
        key = {}
        for layer, row in enumerate(rows):
            local = sorted(range(len(row)), key=lambda h, layer=layer, row=row: (row[h], tie[layer, h]))
            for position, h in enumerate(local):
                key[layer, h] = (Fraction(position, len(row)), tie[layer, h])
    else:
        key = {(layer, h): (rows[layer][h], tie[layer, h]) for layer, h in heads}
    ranks = [[0] * len(row) for row in rows]
    for rank, (layer, h) in enumerate(sorted(heads, key=key.__getitem__)):
        ranks[layer][h] = rank
    return ranks


def knapsack_layers(options: list[dict], wanted: int, where: str) -> list:
    """One configuration per layer removing the most heads ``<= wanted``, at the least cost."""
    most = sum(max(opts) for opts in options)
    if most < wanted:
        raise ValueError(f"amount {wanted} is larger than the {most} heads that may be removed {where}")
    best = np.full(wanted + 1, INF, dtype=np.int64)
    best[0] = 0
    picks = []
    for opts in options:
        new = np.full(wanted + 1, INF, dtype=np.int64)
        pick = np.full(wanted + 1, -1, dtype=np.int64)
        for removed in sorted(r for r in opts if r <= wanted):
            candidate = best[: wanted + 1 - removed] + opts[removed].cost
            better = candidate < new[removed:]
            new[removed:][better] = candidate[better]
            pick[removed:][better] = removed
        best = new
        picks.append(pick)
    n = int(np.flatnonzero(best < INF).max())
    chosen = []
    for opts, pick in zip(reversed(options), reversed(picks), strict=True):
        removed = int(pick[n])
        chosen.append(opts[removed])
        n -= removed
    return chosen[::-1]


def gate_hook(gate: torch.Tensor, head_dim: int):
    def hook(module, args):
        (x, *rest) = args
        heads = x.unflatten(-1, (gate.numel(), head_dim))
        gated = (heads * gate.to(x.dtype)[:, None]).flatten(-2)
        return (gated, *rest)

    return hook

"""Optimal Brain Surgeon selection of the units a consumer loses (structured OBS, as in ZipLM and SlimGPT).

With ``H = X^T X`` the Gram matrix of the consumer's inputs and ``W`` its ``[out, in]`` weights,
removing the columns ``S`` of one unit and letting the others absorb it optimally costs
``tr(W_S (H^-1_SS)^-1 W_S^T)`` in squared output error; the others then move by
``-W_S (H^-1_SS)^-1 H^-1_S:`` and the inverse loses ``S`` by the same Schur step. Greedy: remove the
cheapest unit, update ``W`` and ``H^-1``, repeat until every group has lost its quota. A unit is
``width`` consecutive columns (a head: ``head_dim``; a whole KV group: ``group_size x head_dim``; a
channel: 1). Memory: two ``in x in`` float64 matrices plus ``W``; time: one inverse plus ``in^2`` per
removed unit.

The constrained optima are nested, so the running sum of the chosen saliencies after ``k`` removals
is exactly the error of the best refit of the kept columns on the damped Gram ``H + lambda I``:
``min_V ||X (W - V)^T||^2 + lambda ||W - V||^2`` with ``V`` zero on the removed columns
(:func:`obs_order` returns it, a damage measure).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

#: Dampening added to H's diagonal, relative to its mean (SparseGPT uses 1%; 0.1% lets exactly dependent units
#: cost next to nothing in float64): H is singular when inputs are dependent.
DAMP = 0.001


def damped(gram: torch.Tensor) -> torch.Tensor:
    """``gram`` in float64 plus the dampening OBS uses (:data:`DAMP` x its mean diagonal) on the diagonal."""
    h = gram.double().clone()
    h.diagonal().add_(DAMP * h.diagonal().mean().clamp_min(1e-12))
    return h


def obs_order(
    gram: torch.Tensor,
    weight: torch.Tensor,
    width: int,
    quotas: Sequence[tuple[Sequence[int], int]] | None,
    count: int,
) -> tuple[list[int], list[float]]:
    """The first ``count`` units greedy OBS removes, in order, and the cumulative squared output error after each.

    ``gram`` is ``[in, in]`` over the consumer's inputs (``in = units x width``), ``weight`` ``[out, in]``.
    ``quotas`` lists groups ``(units, most)``: a group loses at most ``most`` units and units in no group
    are never removed; None: any unit may go. ``costs[k]`` is the squared error (on the damped Gram,
    see the module docstring) of the best refit after removing ``units[: k + 1]``.
    """
    units = gram.shape[0] // width
    device = gram.device
    if quotas is None:
        quotas = [(range(units), units)]
    group_of = torch.full((units,), -1, dtype=torch.long, device=device)
    left = []
    for g, (members, most) in enumerate(quotas):
        group_of[list(members)] = g
        left.append(most)
    if not 0 <= count <= sum(left):
        raise ValueError(f"cannot remove {count} units: the quotas allow {sum(left)} of {units}")
    hinv = torch.cholesky_inverse(torch.linalg.cholesky(damped(gram)))
    w = weight.detach().double().clone()
    alive = torch.ones(units, dtype=torch.bool, device=device)
    removed: list[int] = []
    costs: list[float] = []
    total = 0.0
    for _ in range(count):
        open_groups = torch.tensor([n > 0 for n in left] + [False], device=device)
        allowed = alive & open_groups[group_of]  # group -1 (no quota) indexes the final False
        cost = _costs(hinv, w, width, alive)
        cost[~allowed] = float("inf")
        unit = int(cost.argmin())
        total += float(cost[unit])
        s = slice(unit * width, (unit + 1) * width)
        block_inv = torch.linalg.pinv(hinv[s, s], hermitian=True)
        step = block_inv @ hinv[s, :]
        w -= w[:, s] @ step
        hinv -= hinv[:, s] @ step
        w[:, s] = 0
        alive[unit] = False
        left[int(group_of[unit])] -= 1
        removed.append(unit)
        costs.append(total)
    return removed, costs


def obs_channel_order(gram: torch.Tensor, weight: torch.Tensor, count: int, chunk: int = 1) -> list[list[int]]:
    """Greedy OBS over single columns, ``chunk`` at a time: the column sets removed step by step (``count`` in all).

    Each step removes the ``chunk`` columns of lowest saliency together (one joint Schur update of ``W`` and
    ``H^-1``), so removing ``k`` chunks is the prefix of the first ``k`` steps: one pass serves every width a
    layer may take. ``chunk = 1`` is :func:`obs_order` without quotas; MLP channels taken ``multiple`` at a time
    cost ``multiple`` times fewer updates.
    """
    units = gram.shape[0]
    if not 0 <= count <= units or chunk < 1:
        raise ValueError(f"cannot remove {count} of {units} columns in chunks of {chunk}")
    hinv = torch.cholesky_inverse(torch.linalg.cholesky(damped(gram)))
    w = weight.detach().double().clone()
    alive = torch.ones(units, dtype=torch.bool, device=gram.device)
    steps: list[list[int]] = []
    left = count
    while left > 0:
        cost = _costs(hinv, w, 1, alive)
        cost[~alive] = float("inf")
        take = min(chunk, left)
        s = torch.topk(cost, take, largest=False).indices
        step = torch.linalg.pinv(hinv[s][:, s], hermitian=True) @ hinv[s, :]
        w -= w[:, s] @ step
        hinv -= hinv[:, s] @ step
        w[:, s] = 0
        alive[s] = False
        steps.append(sorted(int(i) for i in s))
        left -= take
    return steps


def obs_select(
    gram: torch.Tensor, weight: torch.Tensor, width: int, quotas: Sequence[tuple[Sequence[int], int]]
) -> list[int]:
    """The units to remove, cheapest first by OBS: from each group ``(units, count)`` exactly ``count`` (sorted).

    ``gram`` is ``[in, in]`` over the consumer's inputs (``in = units x width``), ``weight`` ``[out, in]``.
    """
    return sorted(obs_order(gram, weight, width, quotas, sum(count for _, count in quotas))[0])


def _costs(hinv: torch.Tensor, w: torch.Tensor, width: int, alive: torch.Tensor) -> torch.Tensor:
    """Per unit, the squared output error of removing it now (OBS saliency); removed units get 0."""
    if width == 1:
        return w.square().sum(0) / hinv.diagonal().clamp_min(1e-30)
    units = alive.numel()
    blocks = hinv.reshape(units, width, units, width).diagonal(dim1=0, dim2=2).permute(2, 0, 1).contiguous()
    blocks[~alive] = torch.eye(width, dtype=blocks.dtype, device=blocks.device)  # removed: H^-1_SS = 0
    wb = w.reshape(w.shape[0], units, width).permute(1, 2, 0).contiguous()  # [units, w, out]
    # The blocks of an SPD inverse are SPD: Cholesky (MKL's batched LU solve fails on some block sizes: 192)
    factor, info = torch.linalg.cholesky_ex(blocks)
    solved = torch.cholesky_solve(wb, factor)
    bad = info != 0
    if bad.any():
        solved[bad] = torch.linalg.pinv(blocks[bad], hermitian=True) @ wb[bad]
    return (wb * solved).sum((1, 2))

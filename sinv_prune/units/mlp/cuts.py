"""A channel plan's cuts: the slicing of a layer's MLP (dense, or the channels inside its experts) and the
:class:`~sinv_prune.surgery.cuts.Cut` of its down projection that compensation refits."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from sinv_prune.arch import HeadAdapter
from sinv_prune.surgery.cuts import Cut
from sinv_prune.surgery.offload import compute_device


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
        norm = adapter.mlp_residual_norm(layer)
        cuts[layer] = [Cut("mlp", consumer, *columns, lambda layer=layer: apply(layer), 1, quotas, pick, norm)]
    return cuts


def apply_mlp(adapter: HeadAdapter, layer: int, keep: list[int]) -> None:
    """Slice one layer's MLP to the channels ``keep`` (current numbering)."""
    device = adapter.mlp_out(layer).weight.device
    adapter.slice_mlp(layer, torch.tensor(keep, dtype=torch.long, device=device))


def apply_expert_channels(adapter: HeadAdapter, layer: int, routed: list[list[int]], shared: list[int]) -> None:
    """Slice one mixture-of-experts layer's experts: routed expert ``e`` to channels ``routed[e]`` (every
    expert keeps as many), the shared expert to ``shared`` (current numbering); full widths stay as they are."""
    device = adapter.experts(layer).down_proj.device
    if len(routed[0]) < adapter.expert_width(layer):
        adapter.slice_expert_channels(layer, torch.tensor(routed, dtype=torch.long, device=device))
    if 0 < len(shared) < adapter.shared_width(layer):
        adapter.slice_shared_channels(layer, torch.tensor(shared, dtype=torch.long, device=device))

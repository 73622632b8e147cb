"""OBS picks inside data-driven allocations: rank each group's units in the order greedy OBS removes them.

With ``compensate="obs"`` the units that go inside a layer are chosen by OBS at removal time, not by
the criterion's scores. ``sensitivity`` and ``search`` measure trial cuts of each layer, so they must
measure the cuts OBS will make: :func:`rank_by_obs` replaces a group's scores by its units' greedy OBS
removal position on the unpruned model's calibration statistics (first removed: lowest score), so that
``Group.pick(k)`` is OBS's first ``k`` (MLP channels: exactly, a ``multiple`` at a time; query heads:
per KV group as the layout allows).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from functools import reduce

from torch import nn

from sinv_prune.arch import get_adapter
from sinv_prune.scoring.consumer_statistics import Statistics
from sinv_prune.surgery.obs import obs_channel_order, obs_order
from sinv_prune.surgery.refit import consumer_weights
from sinv_prune.units.heads import HEADS
from sinv_prune.units.mlp import MLP


def rank_by_obs(model: nn.Module, groups: Sequence, batches: Sequence[Mapping], *, quiet: bool = True) -> int:
    """Give every heads / MLP group of a dense model its OBS removal order as scores; the groups re-ranked.

    Mixture-of-experts models and other units keep their scores (returns 0 then).
    """
    adapter = get_adapter(model)
    wanted = [g for g in groups if g.unit in (HEADS.name, MLP.name)]
    if not wanted or adapter.expert_counts():
        return 0
    seqs = []
    for b in batches:
        ids = b["input_ids"].reshape(-1, b["input_ids"].shape[-1])
        mask = b.get("attention_mask")
        masks = mask.reshape(ids.shape).bool() if mask is not None else [None] * len(ids)
        seqs += [row if m is None else row[m] for row, m in zip(ids, masks, strict=True)]
    stats = Statistics(model, adapter, seqs, [False] * len(seqs), quiet=quiet)
    for g in wanted:
        module = adapter.out_proj(g.layer) if g.unit == HEADS.name else adapter.mlp_out(g.layer)
        weight, _ = consumer_weights(module)
        width = weight.shape[1]
        gram = stats.fits[g.unit, g.layer][0].gram[:width, :width]
        most = max(g.allowed)
        if not most:
            continue
        if g.unit == MLP.name:
            chunk = reduce(math.gcd, (k for k in g.allowed if k), 0) or 1
            order = [c for step in obs_channel_order(gram, weight, most, chunk) for c in step]
        else:
            lay = adapter.layout(g.layer)
            group = lay.group_size
            quotas = None if group == 1 else [(list(range(k * group, (k + 1) * group)), group - 1)
                                              for k in range(lay.num_kv_heads)]  # fmt: skip
            count = most if group == 1 else min(most, (group - 1) * lay.num_kv_heads)
            order = obs_order(gram, weight, lay.head_dim, quotas, count)[0]
        position = {unit: i for i, unit in enumerate(order)}
        g.scores = [float(position.get(u, len(g.scores))) for u in range(len(g.scores))]
    del stats
    return len(wanted)


__all__ = ["rank_by_obs"]

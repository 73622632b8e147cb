"""What the search needs from the unpruned model, measured once: OBS orders and refits of every option.

From the consumers' statistics (:class:`~sinv_prune.scoring.consumer_statistics.Statistics`, one pass, one block
at a time, kept on the host and brought to the device one consumer at a time), per layer:

* heads: for every :class:`~sinv_prune.shrink.space.HeadOption`, which KV groups go (group OBS, a unit
  is a whole group's ``o_proj`` columns), then which query heads in each kept group (OBS with equal
  quotas per group);
* MLP channels: one greedy OBS pass, ``multiple`` channels a step (:func:`~sinv_prune.surgery.obs.obs_channel_order`),
  whose prefixes are every width's removal (computed while the statistics pass has the layer's sums on the
  device: :func:`mlp_order`);
* experts (MoE layers): the lowest REAP scores first (the statistics' ``expert_scores``); removing them
  needs no refit (the router renormalises over the kept experts);
* the refit of the kept columns (ridge walked on the held-out statistics, plain weights kept where the
  refit does not generalise: :func:`~sinv_prune.surgery.compensation.guarded_refit`), cached.

Every layer is fitted on the unpruned model's inputs (not sequentially), so a candidate costs a few
small solves and one forward.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Sequence

import torch

from sinv_prune.arch.base import head_rows
from sinv_prune.progress import bar
from sinv_prune.scoring.consumer_statistics import Statistics, consumer_modules
from sinv_prune.shrink.space import HeadOption, LayerSpace, Space
from sinv_prune.surgery.compensation import guarded_refit
from sinv_prune.surgery.obs import obs_channel_order, obs_order
from sinv_prune.surgery.refit import ConsumerFit, consumer_weights
from sinv_prune.units.heads import HEADS
from sinv_prune.units.mlp import MLP

logger = logging.getLogger(__name__)

#: Bytes of refits :class:`Picks` keeps for later candidates beyond the newest (an 8B shape's down projection
#: refit is ~90 MB in bfloat16: a count bound alone would keep tens of GB).
REFIT_CACHE_BYTES = 2 << 30


class Picks:
    """Which units each option removes (OBS on the unpruned statistics) and the refit kept weights, cached."""

    def __init__(self, stats: Statistics, space: Space, adapter, *, cache: int = 256,
                 cache_bytes: int = REFIT_CACHE_BYTES, quiet: bool = False,
                 orders: dict[int, list[list[int]]] | None = None):  # fmt: skip
        """``orders``: MLP OBS orders already computed (:func:`mlp_order`, while the statistics were measured);
        ``cache`` / ``cache_bytes``: at most that many refits, and bytes of them, are kept for later candidates
        (the newest always): in host memory, or, where the statistics' store is on disk, in that store (host
        memory then holds a refit only while it is used; at least twice the consumers' weights are kept there)."""
        self.stats, self.space, self.adapter = stats, space, adapter  # the model being cut (stats may be reused)
        self.mlp_steps: dict[int, list[list[int]]] = dict(orders or {})
        self._heads: dict[tuple[int, int], list[int]] = {}
        self._refits: OrderedDict[tuple, tuple] = OrderedDict()  # (kept, weight, bias); on disk (bytes, device)
        self._fell_back: set[tuple] = set()  # refits (unit, layer, removed) whose solve was not finite
        self._warned: set[tuple[str, int]] = set()
        self._cap, self._cap_bytes, self._bytes = cache, cache_bytes, 0
        self._disk = stats.store if stats.store.where == "disk" else None
        n = self.adapter.num_layers
        # the unpruned weights, held now: candidates replace the live consumers' forwards (never their weights);
        # offloaded ones are on ``meta`` here (their shapes), read from their offload map when used (:meth:`unpruned`)
        self._consumers = consumer_modules(self.adapter)
        self.weights = {key: consumer_weights(module) for key, module in self._consumers.items()}
        self.expert_order = [sorted(range(len(row)), key=lambda e, row=row: (row[e], e)) for row in stats.expert_scores]
        if self._disk is not None:  # room for a candidate's refits and the best's besides (disk, not memory)
            self._cap_bytes = max(cache_bytes, 2 * sum(_nbytes(w) for w in self.weights.values()))
        for key, (weight, _) in self.weights.items():
            measured = stats.shapes[key][0] if key in stats.shapes else None
            if measured != weight.shape[1]:
                raise ValueError(f"statistics of another model: layer {key[1]} {key[0]} consumer has "
                                 f"{weight.shape[1]} inputs, the statistics {measured}")  # fmt: skip
        if [len(row) for row in stats.expert_scores] != [self.adapter.num_experts(i) for i in range(n)]:
            raise ValueError("statistics of another model: its expert counts differ")
        missing = [s for s in space.layers if s.max_steps and s.layer not in self.mlp_steps]
        for s in bar(missing, desc="OBS orders", unit="layer", disable=quiet or not missing):
            fit = self.stats.pair((MLP.name, s.layer))[0]
            self.mlp_steps[s.layer] = mlp_order(s, fit, self.unpruned(MLP.name, s.layer)[0])

    def unpruned(self, unit: str, layer: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``([out, in] weight, bias)`` of ``layer``'s ``unit`` consumer in the unpruned model (offloaded ones read
        from their offload map, on the host)."""
        weight, bias = self.weights[unit, layer]
        if weight.device.type != "meta":
            return weight, bias
        return consumer_weights(self._consumers[unit, layer], self.adapter.model)

    def heads(self, layer: int, option: int) -> list[int]:
        """Query heads (current numbering) that head option ``option`` of ``layer`` removes."""
        if option == 0:
            return []
        if (layer, option) not in self._heads:
            self._heads[layer, option] = self._choose_heads(layer, self.space.layers[layer].heads[option])
        return self._heads[layer, option]

    def _choose_heads(self, layer: int, option: HeadOption) -> list[int]:
        lay = self.adapter.layout(layer)
        group, d = lay.group_size, lay.head_dim
        fit = self.stats.fits[HEADS.name, layer][0]
        weight, _ = self.unpruned(HEADS.name, layer)
        width = weight.shape[1]
        gram = fit.gram[:width, :width]
        gone_groups: list[int] = []
        if option.groups < lay.num_kv_heads:
            gone_groups = obs_order(gram, weight, group * d, None, lay.num_kv_heads - option.groups)[0]
        kept_groups = [g for g in range(lay.num_kv_heads) if g not in gone_groups]
        removed = [h for g in gone_groups for h in range(g * group, (g + 1) * group)]
        if option.per_group < group:
            kept_heads = [h for g in kept_groups for h in range(g * group, (g + 1) * group)]
            cols = head_rows(torch.tensor(kept_heads, device=gram.device), d)
            sub = gram.index_select(0, cols).index_select(1, cols)
            quotas = [(list(range(j * group, (j + 1) * group)), group - option.per_group)
                      for j in range(len(kept_groups))]  # fmt: skip
            order = obs_order(sub, weight.index_select(1, cols), d, quotas, sum(q for _, q in quotas))[0]
            removed += [kept_heads[u] for u in order]
        return sorted(removed)

    def experts(self, layer: int, count: int) -> list[int]:
        """The ``count`` experts of ``layer`` with the lowest REAP scores (current numbering)."""
        return sorted(self.expert_order[layer][:count])

    def channels(self, layer: int, steps: int) -> list[int]:
        """MLP channels (current numbering) removed by taking ``steps`` OBS steps in ``layer``."""
        return sorted(c for step in self.mlp_steps.get(layer, [])[:steps] for c in step)

    def refit(self, unit: str, layer: int, removed_units: Sequence[int]) -> tuple:
        """``(kept columns, weight over them, bias)``: the guarded refit of ``layer``'s ``unit`` consumer."""
        key = (unit, layer, tuple(removed_units))
        if key in self._refits:
            self._refits.move_to_end(key)
            return self._refits[key] if self._disk is None else self._read(key)
        weight, bias = self.unpruned(unit, layer)
        width = weight.shape[1]
        if unit == HEADS.name:
            d = self.adapter.layout(layer).head_dim
            gone = set(head_rows(torch.tensor(list(removed_units), dtype=torch.long), d).tolist())
        else:
            gone = set(removed_units)
        kept = torch.tensor([c for c in range(width) if c not in gone], dtype=torch.long, device=weight.device)
        fit, held = (f.restrict(kept) for f in self.stats.fits[unit, layer])
        plain = (weight.index_select(1, kept), bias)
        _, (w, b), _, _ = guarded_refit(fit, held if held.tokens else None, plain)
        if not torch.isfinite(w).all() or (b is not None and not torch.isfinite(b).all()):
            w, b = plain  # an ill-conditioned solve: plain pruning instead
            self._fell_back.add(key)
            if (unit, layer) not in self._warned:
                self._warned.add((unit, layer))
                logger.warning("shrink: layer %d %s consumer: the refit is not finite (an ill-conditioned solve); "
                               "plain pruning there instead", layer, unit)  # fmt: skip
        value = (kept, w.to(weight.dtype), None if b is None else b.to(weight.dtype))
        self._refits[key] = value if self._disk is None else (_nbytes(value), value[1].device)
        if self._disk is not None:
            self._disk.put(("refit", *key), dict(zip(("kept", "weight", "bias"), value, strict=True)))
        self._bytes += _nbytes(value)
        while len(self._refits) > 1 and (len(self._refits) > self._cap or self._bytes > self._cap_bytes):
            old, held = self._refits.popitem(last=False)
            self._bytes -= held[0] if self._disk is not None else _nbytes(held)
            if self._disk is not None:
                self._disk.drop(("refit", *old))
        return value

    def _read(self, key: tuple) -> tuple:
        t = self._disk.get(("refit", *key), self._refits[key][1])
        return t["kept"], t["weight"], t["bias"]

    @property
    def on_disk(self) -> bool:
        """Whether refits wait on disk between uses (the statistics' store is on disk)."""
        return self._disk is not None

    def fell_back(self, unit: str, layer: int, removed_units: Sequence[int]) -> bool:
        """Whether the refit of ``layer``'s ``unit`` consumer without ``removed_units`` fell back to plain pruning
        (its solve was not finite)."""
        return (unit, layer, tuple(removed_units)) in self._fell_back


def _nbytes(tensors: tuple) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def mlp_order(s: LayerSpace, fit: ConsumerFit, weight: torch.Tensor) -> list[list[int]]:
    """Layer ``s.layer``'s MLP channels in the order greedy OBS removes them, ``s.step`` a step, ``s.max_steps``
    steps, on the fit statistics of its down projection (``weight``: its unpruned ``[out, in]`` weights)."""
    width = weight.shape[1]
    return obs_channel_order(fit.gram[:width, :width], weight.to(fit.gram.device), s.max_steps * s.step, s.step)

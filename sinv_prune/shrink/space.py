"""What ``shrink`` searches over: per layer, drop the block, or keep it with some heads and MLP channels
(a dense layer) or routed experts (a mixture-of-experts layer).

A :class:`Genome` is one plan: the dropped blocks, per kept layer one :class:`HeadOption` (KV groups
kept x query heads kept per group) and a number of *fill* steps removed: MLP steps (``multiple``
channels each) in a dense layer, experts in a MoE layer (the channels inside experts are not searched).
Its parameter count is exact (each option's cost is counted from the layer's own tensors), so a
genome is :func:`repair` ed to remove at least the target and overshoot by less than one fill step
(:meth:`Space.slack`); one that cannot (whole blocks or head options alone past the target, nothing to give
back) is no plan.
``stock`` genomes keep the same head option, MLP width and expert count in every kept layer (the stock
class, vLLM and llama.cpp load those).
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, replace

from torch import nn

from sinv_prune.arch import HeadAdapter
from sinv_prune.units.experts import EXPERTS
from sinv_prune.units.heads import HEADS, head_cost
from sinv_prune.units.layers import LAYERS
from sinv_prune.units.mlp import MLP, channel_cost


@dataclass(frozen=True)
class HeadOption:
    """A layer's heads after the cut: ``groups`` KV heads kept, ``per_group`` query heads kept in each."""

    groups: int
    per_group: int
    removed: int  # parameters removed

    @property
    def heads(self) -> int:
        return self.groups * self.per_group


@dataclass
class LayerSpace:
    """One layer's choices and what each costs in parameters."""

    layer: int
    block: int  # parameters of the whole block
    heads: list[HeadOption]  # index 0: every head kept
    channel: int  # parameters of one MLP channel
    step: int  # channels per MLP step
    max_steps: int  # MLP steps the layer may lose
    expert: int = 0  # parameters of one routed expert (with its router row); 0: a dense layer
    max_experts: int = 0  # experts the layer may lose

    @property
    def fill_cost(self) -> int:
        """Parameters one fill step removes: an expert in a MoE layer, ``step`` channels in a dense one."""
        return self.expert if self.expert else self.step * self.channel

    @property
    def fill_max(self) -> int:
        return self.max_experts if self.expert else self.max_steps


@dataclass(frozen=True)
class Genome:
    """A plan in search form: dropped layers, per layer a head option index, MLP steps and experts removed
    (``experts`` empty: none anywhere)."""

    dropped: tuple[int, ...]
    heads: tuple[int, ...]
    mlp: tuple[int, ...]
    experts: tuple[int, ...] = ()

    def expert_cut(self, layer: int) -> int:
        return self.experts[layer] if self.experts else 0

    def fill(self, s: LayerSpace) -> int:
        """Fill steps ``s``'s layer takes: experts removed in a MoE layer, MLP steps in a dense one."""
        return self.expert_cut(s.layer) if s.expert else self.mlp[s.layer]

    def with_fill(self, space: Space, fill: list[int]) -> Genome:
        """This genome with per-layer fill steps ``fill`` (experts in MoE layers, MLP steps elsewhere)."""
        mlp = tuple(0 if s.expert else fill[s.layer] for s in space.layers)
        experts = tuple(fill[s.layer] if s.expert else 0 for s in space.layers) if space.moe else ()
        return replace(self, mlp=mlp, experts=experts)

    def key(self) -> tuple:
        kept = [i for i in range(len(self.heads)) if i not in self.dropped]
        return (self.dropped, tuple(self.heads[i] for i in kept), tuple(self.mlp[i] for i in kept),
                tuple(self.expert_cut(i) for i in kept))  # fmt: skip


@dataclass
class Space:
    """Every layer's :class:`LayerSpace`, the parameter target and the constraints."""

    layers: list[LayerSpace]
    target: int
    stock: bool = False
    units: tuple[str, ...] = (LAYERS.name, HEADS.name, MLP.name)
    min_layers: int = 1

    @property
    def moe(self) -> bool:
        return any(s.expert for s in self.layers)

    def removed(self, g: Genome) -> int:
        return sum(self.shares(g).values())

    def slack(self, g: Genome) -> int:
        """How far past the target a repaired ``g`` may go: less than one fill step (the largest a kept layer
        can take; under ``stock`` one step in every kept layer, the stock repair's unit)."""
        kept = [s for s in self.layers if s.layer not in g.dropped]
        if self.stock:
            return sum(s.fill_cost for s in kept)
        return max((s.fill_cost for s in kept if s.fill_max), default=0)

    def meets(self, g: Genome) -> bool:
        """Whether ``g`` removes at least the target and overshoots it by less than :meth:`slack`."""
        return 0 <= self.removed(g) - self.target < self.slack(g)

    def empty(self) -> Genome:
        n = len(self.layers)
        return Genome((), (0,) * n, (0,) * n, (0,) * n if self.moe else ())

    def shares(self, g: Genome) -> dict[str, int]:
        """Parameters each unit removes under ``g`` (``experts`` only on a model that has them)."""
        out = {LAYERS.name: 0, HEADS.name: 0, MLP.name: 0} | ({EXPERTS.name: 0} if self.moe else {})
        for s in self.layers:
            if s.layer in g.dropped:
                out[LAYERS.name] += s.block
            else:
                out[HEADS.name] += s.heads[g.heads[s.layer]].removed
                out[MLP.name] += g.mlp[s.layer] * s.step * s.channel
                if s.expert:
                    out[EXPERTS.name] += g.expert_cut(s.layer) * s.expert
        return out

    # -- making a genome meet the target ---------------------------------------------------------

    def repair(self, g: Genome, rng: random.Random) -> Genome | None:
        """``g`` with fill steps (MLP steps; experts in MoE layers) added or given back until it removes at
        least the target by less than one step more than needed (:meth:`meets`); None if no fill gets there
        (too little room, or dropped blocks and head options alone already past the target by a step)."""
        out = self._repair(g, rng)
        return out if out is not None and self.meets(out) else None

    def _repair(self, g: Genome, rng: random.Random) -> Genome | None:
        kept = [s for s in self.layers if s.layer not in g.dropped]
        if len(kept) < self.min_layers:
            return None
        fill = [0 if s.layer in g.dropped else g.fill(s) for s in self.layers]
        if self.stock:
            return self._repair_stock(g, kept)
        g = g.with_fill(self, fill)
        removed = self.removed(g)
        order = list(kept)
        rng.shuffle(order)  # ties broken by the seed, not by layer number
        while removed < self.target:  # take a step where the fewest have gone (towards even widths)
            room = [s for s in order if fill[s.layer] < s.fill_max]
            if not room:
                return None
            s = min(room, key=lambda s: fill[s.layer] / s.fill_max)
            fill[s.layer] += 1
            removed += s.fill_cost
        while True:  # give back a step where the most have gone, while the target still holds
            back = [s for s in order if fill[s.layer] > 0 and removed - s.fill_cost >= self.target]
            if not back:
                break
            s = max(back, key=lambda s: fill[s.layer] / s.fill_max)
            fill[s.layer] -= 1
            removed -= s.fill_cost
        return g.with_fill(self, fill)

    def _repair_stock(self, g: Genome, kept: list[LayerSpace]) -> Genome | None:
        """The same head option and the same fill steps in every kept layer (so one width per unit)."""
        option = g.heads[kept[0].layer]
        heads = tuple(0 if i in g.dropped else option for i in range(len(self.layers)))
        base = replace(g, heads=heads).with_fill(self, [0] * len(self.layers))
        need = self.target - self.removed(base)
        per_step = sum(s.fill_cost for s in kept)
        steps = max(0, -(-need // per_step))
        if steps > min(s.fill_max for s in kept):
            return None
        return base.with_fill(self, [0 if s.layer in g.dropped else steps for s in self.layers])

    # -- moves of the search ---------------------------------------------------------------------

    def mutate(self, g: Genome, rng: random.Random, bypass: Sequence[int]) -> Genome | None:
        """One to three random moves from ``g``, repaired; None when the result is not allowed.

        Moves: MLP steps from one layer to another, a layer's head option to a neighbouring one, a dropped
        block swapped for a kept one, one block more or fewer dropped (MLP steps pay for it). ``bypass``
        ranks the layers by how little they change their input (first: the cheapest to drop).
        """
        moves = [m for m, unit in ((self._move_fill, MLP.name), (self._move_fill, EXPERTS.name),
                                   (self._move_heads, HEADS.name), (self._swap_layer, LAYERS.name),
                                   (self._count_layers, LAYERS.name))
                 if unit in self.units and not (self.stock and m == self._move_fill)]  # fmt: skip
        if not moves:
            return None
        child = g
        for _ in range(rng.randint(1, 3)):
            child = rng.choice(moves)(child, rng, bypass) or child
        return self.repair(child, rng)

    def _move_fill(self, g: Genome, rng: random.Random, bypass) -> Genome | None:
        """Fill steps from one kept layer to another of the same kind (dense or MoE); repair evens the count."""
        kept = [s for s in self.layers if s.layer not in g.dropped]
        if len(kept) < 2:
            return None
        a, b = rng.sample(kept, 2)
        if bool(a.expert) != bool(b.expert) or g.fill(a) >= a.fill_max or g.fill(b) == 0:
            return None
        fill = [g.fill(s) for s in self.layers]
        size = min(rng.choice((1, 1, 2, 4)), a.fill_max - fill[a.layer], fill[b.layer])
        fill[a.layer] += size
        fill[b.layer] -= size
        return g.with_fill(self, fill)

    def _move_heads(self, g: Genome, rng: random.Random, bypass) -> Genome | None:
        kept = [s for s in self.layers if s.layer not in g.dropped and len(s.heads) > 1]
        if not kept:
            return None
        s = rng.choice(kept)
        now = g.heads[s.layer]
        # neighbours: the options closest in parameters removed
        ranked = sorted(range(len(s.heads)), key=lambda j: abs(s.heads[j].removed - s.heads[now].removed))
        new = rng.choice(ranked[1:4])
        if self.stock:
            return replace(g, heads=tuple(new if i not in g.dropped else 0 for i in range(len(g.heads))))
        heads = list(g.heads)
        heads[s.layer] = new
        return replace(g, heads=tuple(heads))

    def _swap_layer(self, g: Genome, rng: random.Random, bypass) -> Genome | None:
        if not g.dropped:
            return None
        out = rng.choice(g.dropped)
        candidates = [i for i in bypass[: max(2 * len(g.dropped) + 4, 8)] if i not in g.dropped]
        if not candidates:
            return None
        new = rng.choice(candidates)
        return self._with_dropped(g, sorted((set(g.dropped) - {out}) | {new}))

    def _count_layers(self, g: Genome, rng: random.Random, bypass) -> Genome | None:
        if g.dropped and rng.random() < 0.5:
            return self._with_dropped(g, sorted(set(g.dropped) - {rng.choice(g.dropped)}))
        candidates = [i for i in bypass[: max(2 * len(g.dropped) + 4, 8)] if i not in g.dropped]
        if not candidates or len(self.layers) - len(g.dropped) - 1 < self.min_layers:
            return None
        return self._with_dropped(g, sorted(set(g.dropped) | {rng.choice(candidates[:3])}))

    def _with_dropped(self, g: Genome, dropped: list[int]) -> Genome:
        """``g`` with these blocks dropped; a restored block takes the head option the others have most."""
        heads, fill = list(g.heads), [g.fill(s) for s in self.layers]
        common = max(set(heads), key=heads.count)
        for i in range(len(heads)):
            if i in dropped:
                heads[i], fill[i] = 0, 0
            elif i in g.dropped:
                heads[i] = common if self.stock else 0
        return Genome(tuple(dropped), tuple(heads), g.mlp).with_fill(self, fill)


# -- building the space of a model -----------------------------------------------------------


def build_space(model: nn.Module, adapter: HeadAdapter, target: int, *, stock: bool, units: Sequence[str],
                multiple: int, min_mlp: float, min_layers: int = 1) -> Space:  # fmt: skip
    """The :class:`Space` of ``model`` for removing at least ``target`` parameters.

    ``multiple``: MLP channels per step; ``min_mlp``: the share of each layer's channels (and of a MoE
    layer's experts, at least ``num_experts_per_tok``) that stays. Head options keep at least one KV group
    and one query head per group (q_per_group and whole groups); under ``stock`` only options whose head
    count the config can state (``hidden % heads == 0``).
    """
    hidden = int(getattr(model.config, "hidden_size", 0) or 0)
    layers = []
    for i in range(adapter.num_layers):
        block = sum(p.numel() for p in adapter.layers()[i].parameters())
        lay = adapter.layout(i)
        per_q = head_cost(model, i)
        proj = adapter.projections(i)
        kv_bias = sum(b.numel() for b in (proj.k_bias, proj.v_bias) if b is not None)
        per_kv = (proj.k.numel() + proj.v.numel() + kv_bias) // max(lay.num_kv_heads, 1)
        options = [HeadOption(lay.num_kv_heads, lay.group_size, 0)]
        if HEADS.name in units and not adapter.heads_refusal and lay.num_heads:
            for groups in range(lay.num_kv_heads, 0, -1):
                for per_group in range(lay.group_size, 0, -1):
                    if (groups, per_group) == (lay.num_kv_heads, lay.group_size):
                        continue
                    if stock and hidden and hidden % (groups * per_group):
                        continue
                    removed = (lay.num_heads - groups * per_group) * per_q + (lay.num_kv_heads - groups) * per_kv
                    options.append(HeadOption(groups, per_group, removed))
        width = adapter.intermediate_size(i)
        step = multiple if MLP.name in units else max(width, 1)
        max_steps = int(width * (1 - min_mlp)) // step if MLP.name in units else 0
        count = adapter.num_experts(i)
        floor = max(EXPERTS._floor(adapter, None), math.ceil(min_mlp * count)) if count else 0
        max_experts = count - floor if EXPERTS.name in units and count else 0
        expert = EXPERTS.cost(model, i) if count else 0
        channel = 0 if count else channel_cost(model, i)
        layers.append(LayerSpace(i, block, options, channel, step, max_steps, expert, max_experts))
    return Space(layers, target, stock, tuple(units), min_layers)

"""What ``shrink`` searches over: per layer, drop the block, or keep it with some heads and MLP channels.

A :class:`Genome` is one plan: the dropped blocks, per kept layer one :class:`HeadOption` (KV groups
kept x query heads kept per group) and a number of MLP steps (``multiple`` channels each) removed.
Its parameter count is exact (each option's cost is counted from the layer's own tensors), so a
genome is :func:`repair` ed to remove at least the target and overshoot by less than one MLP step.
``stock`` genomes keep the same head option and MLP width in every kept layer (the stock class and
vLLM load those).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, replace

from torch import nn

from sinv_prune.arch import HeadAdapter
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


@dataclass(frozen=True)
class Genome:
    """A plan in search form: dropped layers, per layer a head option index and MLP steps removed."""

    dropped: tuple[int, ...]
    heads: tuple[int, ...]
    mlp: tuple[int, ...]

    def key(self) -> tuple:
        kept = [i for i in range(len(self.heads)) if i not in self.dropped]
        return self.dropped, tuple(self.heads[i] for i in kept), tuple(self.mlp[i] for i in kept)


@dataclass
class Space:
    """Every layer's :class:`LayerSpace`, the parameter target and the constraints."""

    layers: list[LayerSpace]
    target: int
    stock: bool = False
    units: tuple[str, ...] = (LAYERS.name, HEADS.name, MLP.name)
    min_layers: int = 1

    def removed(self, g: Genome) -> int:
        total = 0
        for s in self.layers:
            if s.layer in g.dropped:
                total += s.block
            else:
                total += s.heads[g.heads[s.layer]].removed + g.mlp[s.layer] * s.step * s.channel
        return total

    def empty(self) -> Genome:
        n = len(self.layers)
        return Genome((), (0,) * n, (0,) * n)

    def shares(self, g: Genome) -> dict[str, int]:
        """Parameters each unit removes under ``g``."""
        out = {"layers": 0, "heads": 0, "mlp": 0}
        for s in self.layers:
            if s.layer in g.dropped:
                out[LAYERS.name] += s.block
            else:
                out[HEADS.name] += s.heads[g.heads[s.layer]].removed
                out[MLP.name] += g.mlp[s.layer] * s.step * s.channel
        return out

    # -- making a genome meet the target ---------------------------------------------------------

    def repair(self, g: Genome, rng: random.Random) -> Genome | None:
        """``g`` with MLP steps added or given back until it removes at least the target by less than one step
        more than needed; None if no MLP width gets there."""
        kept = [s for s in self.layers if s.layer not in g.dropped]
        if len(kept) < self.min_layers:
            return None
        mlp = list(g.mlp)
        for layer in g.dropped:
            mlp[layer] = 0
        if self.stock:
            return self._repair_stock(g, kept, mlp)
        g = replace(g, mlp=tuple(mlp))
        removed = self.removed(g)
        order = list(kept)
        rng.shuffle(order)  # ties broken by the seed, not by layer number
        while removed < self.target:  # take a step where the fewest have gone (towards even widths)
            room = [s for s in order if mlp[s.layer] < s.max_steps]
            if not room:
                return None
            s = min(room, key=lambda s: mlp[s.layer])
            mlp[s.layer] += 1
            removed += s.step * s.channel
        while True:  # give back a step where the most have gone, while the target still holds
            back = [s for s in order if mlp[s.layer] > 0 and removed - s.step * s.channel >= self.target]
            if not back:
                break
            s = max(back, key=lambda s: mlp[s.layer])
            mlp[s.layer] -= 1
            removed -= s.step * s.channel
        return replace(g, mlp=tuple(mlp))

    def _repair_stock(self, g: Genome, kept: list[LayerSpace], mlp: list[int]) -> Genome | None:
        option = g.heads[kept[0].layer]
        heads = tuple(0 if i in g.dropped else option for i in range(len(self.layers)))
        base = replace(g, heads=heads, mlp=tuple(0 for _ in mlp))
        need = self.target - self.removed(base)
        per_step = sum(s.step * s.channel for s in kept)
        steps = max(0, -(-need // per_step))
        if steps > min(s.max_steps for s in kept):
            return None
        return replace(base, mlp=tuple(0 if i in g.dropped else steps for i in range(len(self.layers))))

    # -- moves of the search ---------------------------------------------------------------------

    def mutate(self, g: Genome, rng: random.Random, bypass: Sequence[int]) -> Genome | None:
        """One to three random moves from ``g``, repaired; None when the result is not allowed.

        Moves: MLP steps from one layer to another, a layer's head option to a neighbouring one, a dropped
        block swapped for a kept one, one block more or fewer dropped (MLP steps pay for it). ``bypass``
        ranks the layers by how little they change their input (first: the cheapest to drop).
        """
        moves = [m for m, unit in ((self._move_mlp, MLP.name), (self._move_heads, HEADS.name),
                                   (self._swap_layer, LAYERS.name), (self._count_layers, LAYERS.name))
                 if unit in self.units and not (self.stock and m == self._move_mlp)]  # fmt: skip
        if not moves:
            return None
        child = g
        for _ in range(rng.randint(1, 3)):
            child = rng.choice(moves)(child, rng, bypass) or child
        return self.repair(child, rng)

    def _move_mlp(self, g: Genome, rng: random.Random, bypass) -> Genome | None:
        kept = [s for s in self.layers if s.layer not in g.dropped]
        if len(kept) < 2:
            return None
        a, b = rng.sample(kept, 2)
        if g.mlp[a.layer] >= a.max_steps or g.mlp[b.layer] == 0:
            return None
        mlp = list(g.mlp)
        size = max(1, rng.choice((1, 1, 2, 4)))
        size = min(size, a.max_steps - mlp[a.layer], mlp[b.layer])
        mlp[a.layer] += size
        mlp[b.layer] -= size
        return replace(g, mlp=tuple(mlp))

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
        heads, mlp = list(g.heads), list(g.mlp)
        common = max(set(heads), key=heads.count)
        for i in range(len(heads)):
            if i in dropped:
                heads[i], mlp[i] = 0, 0
            elif i in g.dropped:
                heads[i] = common if self.stock else 0
        return Genome(tuple(dropped), tuple(heads), tuple(mlp))


# -- building the space of a model -----------------------------------------------------------


def build_space(model: nn.Module, adapter: HeadAdapter, target: int, *, stock: bool, units: Sequence[str],
                multiple: int, min_mlp: float, min_layers: int = 1) -> Space:  # fmt: skip
    """The :class:`Space` of ``model`` for removing at least ``target`` parameters.

    ``multiple``: MLP channels per step; ``min_mlp``: the share of each layer's channels that stays.
    Head options keep at least one KV group and one query head per group (q_per_group and whole groups);
    under ``stock`` only options whose head count the config can state (``hidden % heads == 0``).
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
        step = multiple if MLP.name in units else width
        max_steps = int(width * (1 - min_mlp)) // step if MLP.name in units else 0
        layers.append(LayerSpace(i, block, options, channel_cost(model, i), step, max_steps))
    return Space(layers, target, stock, tuple(units), min_layers)

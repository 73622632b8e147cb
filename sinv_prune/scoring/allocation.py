"""Allocation: how many heads / MLP channels each layer loses, for a target in parameters.

The step between scoring and selection. A criterion scores units (higher = keep); an
allocation decides the per-layer counts; within a layer the lowest-scored units go (heads:
under the part's GQA ``layout``). Every strategy sees the same :class:`Group` s (one per layer
and unit kind: its scores, the parameters one unit holds, the removal counts the constraints
allow: ``min_per_layer``, ``multiple``, GQA layout) and returns one allowed count per group.
The strategies (registry :data:`STRATEGIES`, one function each, added with :func:`register`):

* ``uniform``: not handled here; the part's ``mode`` decides (today's selection).
* ``standardized`` (FLAP, An et al. 2024): scores standardised within each layer and unit kind
  (``(s - mean) / std``), then ranked globally; a unit weighs its standardised score times its
  parameters, so heads and channels share one scale by parameter cost (FLAP repeats a head's
  score once per parameter-equivalent channel). A knapsack on parameters picks the counts.
* ``sensitivity``: per layer, a few trial cuts (the lowest-scored units masked by gates) are
  measured one block at a time on the block's cached calibration inputs (unpruned model): the
  squared error of the block's output over its squared norm (the residual stream's relative
  perturbation, a proxy for the loss increase that needs no pass through the later blocks);
  linear between trials; a knapsack on parameters turns it into per-layer counts.
* ``search`` (EvoPress-style, Sieberling et al. 2024): a (1 + lambda) evolutionary search over
  per-layer counts seeded with ``standardized``; a mutation moves one level (``step`` units) from
  one layer to another of the same unit kind and cost, so the parameters stay the same; fitness is
  the KL divergence of the masked model's next-token distribution from the unpruned one on a few
  calibration sequences; the best plan is kept only when its fitness is lower, so the result is
  never worse (by fitness) than the seed. Deterministic per ``seed``; ``budget`` evaluations.

The target: ``target`` parameters. Each strategy removes the most parameters not above it that
the constraints allow, at the least cost; :func:`allocate` warns when that is below the target
rounded down to the finest unit (``exact=True`` raises instead).
"""

from __future__ import annotations

import contextlib
import logging
import math
import random
import re
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import reduce
from typing import Any

import numpy as np
import torch
from torch import nn

from sinv_prune.arch import get_adapter
from sinv_prune.progress import bar
from sinv_prune.units import get_unit
from sinv_prune.units.heads import head_cost  # noqa: F401  (re-exported: callers import the costs from here)
from sinv_prune.units.mlp import channel_cost  # noqa: F401
from sinv_prune.units.mlp.selection import standardize

logger = logging.getLogger(__name__)


@dataclass
class Group:
    """One unit kind (a per-layer unit: ``heads``, ``mlp``, ...) of one layer (current numbering)."""

    unit: str
    layer: int
    scores: list[float]
    cost: int  # parameters one unit holds
    allowed: list[int]  # removal counts the constraints allow, ascending, 0 first
    layout: Any = None  # what the unit's pick needs of the layer (heads: its HeadLayout)
    shape: str = "q_per_group"  # heads: the part's GQA layout
    seed: int = 0

    def pick(self, count: int, scores: Sequence[float] | None = None) -> list[int]:
        """The ``count`` units this group loses (lowest ``scores``, default its own; heads under ``shape``)."""
        scores = list(self.scores if scores is None else scores)
        if count == 0:
            return []
        return get_unit(self.unit).pick(scores, count, self.layer, self.seed, self.layout, self.shape)


@dataclass
class Allocation:
    """What an allocation decided: per group the count, and the parameters targeted and removed."""

    strategy: str
    counts: dict[tuple[str, int], int]
    target: int
    removed: int
    seconds: float = 0.0
    details: dict[str, Any] = field(default_factory=dict)

    def widths(self, groups: Sequence[Group]) -> dict[str, list[int]]:
        """Per unit kind, the count each layer keeps."""
        out: dict[str, list[int]] = {}
        for g in groups:
            out.setdefault(g.unit, []).append(len(g.scores) - self.counts[g.unit, g.layer])
        return out

    def to_dict(self, groups: Sequence[Group]) -> dict:
        widths = self.widths(groups)
        return {
            "strategy": self.strategy,
            "target_params": self.target,
            "removed_params": self.removed,
            "seconds": round(self.seconds, 2),
            "kept": {u: {"min": min(w), "max": max(w), "per_layer": w} for u, w in widths.items()},
            **self.details,
        }


@dataclass
class Context:
    """What data-driven strategies need: the model (unpruned, as scored), calibration batches, options."""

    model: nn.Module | None = None
    batches: Sequence[Mapping[str, Any]] | None = None
    seed: int = 0
    options: Mapping[str, Any] = field(default_factory=dict)
    quiet: bool = False
    details: dict[str, Any] = field(default_factory=dict)  # what a strategy reports (search history...)


Strategy = Callable[[list[Group], int, Context], list[int]]


@dataclass(frozen=True)
class Registered:
    """A registered strategy: its function, the options it takes (``Part(..., allocation_options=...)``,
    recipe ``allocation_options``) and whether it measures the model on calibration batches."""

    fn: Strategy
    options: tuple[str, ...] = ()
    needs_data: bool = False


#: The one list of strategies: ``Part``, ``Pruner``, the recipe schema and :func:`allocate` read it.
STRATEGIES: dict[str, Registered] = {}
_NAME = re.compile(r"^[a-z][a-z0-9_]*$")


def register(name: str, *, options: Iterable[str] = (), needs_data: bool = False) -> Callable[[Strategy], Strategy]:
    """Decorator: register ``fn(groups, target, context) -> counts`` as allocation ``name`` (lower snake case,
    not ``uniform``, not taken), taking ``options``; ``needs_data``: it needs the model and calibration batches.

    Example::

        @register("first_layers_first", options=("skip",))
        def first(groups, target, context): ...
    """
    if not isinstance(name, str) or not _NAME.match(name):
        raise ValueError(f"allocation name must be lower snake case, got {name!r}")
    if name == "uniform" or name in STRATEGIES:
        raise ValueError(f"allocation {name!r} is already registered")

    def add(fn: Strategy) -> Strategy:
        if name in STRATEGIES:
            raise ValueError(f"allocation {name!r} is already registered")
        STRATEGIES[name] = Registered(fn, tuple(options), needs_data)
        return fn

    return add


def unregister(name: str) -> None:
    """Remove a strategy :func:`register` added (built-in ones included); an unknown name raises."""
    if STRATEGIES.pop(name, None) is None:
        raise ValueError(f"allocation {name!r} is not registered")


def allocations() -> tuple[str, ...]:
    """Every allocation a part may name: ``uniform`` (the selection's own mode) and each registered strategy."""
    return ("uniform", *STRATEGIES)


def needs_data(name: str) -> bool:
    """Whether allocation ``name`` measures the model on calibration batches (``uniform``: no)."""
    return name in STRATEGIES and STRATEGIES[name].needs_data


def check_allocation(name: str, options: Mapping[str, Any] | None = None) -> str:
    """``name`` if it is one of :func:`allocations` and ``options`` are its own, else a one-line ``ValueError``."""
    if name not in allocations():
        raise ValueError(f"unknown allocation {name!r}; choose one of {', '.join(allocations())}")
    own = STRATEGIES[name].options if name in STRATEGIES else ()
    unknown = sorted(set(options or {}) - set(own))
    if unknown:
        raise ValueError(f"allocation {name!r} takes no option(s) {unknown} (its options: {', '.join(own) or 'none'})")
    return name


# -- parameters ---------------------------------------------------------------------------


def non_embedding_parameters(model: nn.Module) -> int:
    """Parameters outside the token / position embeddings and a tied or untied output embedding."""
    seen: dict[int, int] = {}
    for module in model.modules():
        if isinstance(module, nn.Embedding):
            seen[id(module.weight)] = module.weight.numel()
    out = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if out is not None:
        for p in out.parameters():
            seen[id(p)] = p.numel()
    total = {id(p): p.numel() for p in model.parameters()}
    return sum(total.values()) - sum(n for k, n in seen.items() if k in total)


# -- the entry point ----------------------------------------------------------------------


def allocate(strategy: str, groups: list[Group], target: int, context: Context | None = None,
             *, exact: bool = False) -> Allocation:  # fmt: skip
    """Per group the number of units it loses under ``strategy``, removing at most ``target`` parameters.

    Warns (``exact=True``: raises) when the removal falls short of ``target`` rounded down to the
    finest unit, i.e. when the constraints make the exact target unreachable.
    """
    check_allocation(strategy, (context or Context()).options)
    if strategy == "uniform":
        raise ValueError("allocation 'uniform' is the selection's own mode; allocate() takes the other strategies")
    if not groups:
        raise ValueError("nothing to allocate: no layer has heads or channels to remove")
    if target < 0:
        raise ValueError(f"a parameter target must be non-negative, got {target}")
    most = sum(g.allowed[-1] * g.cost for g in groups)
    if target > most:
        raise ValueError(f"target of {target:,} parameters is more than the {most:,} the constraints let go")
    context = context or Context()
    start = time.perf_counter()
    counts = STRATEGIES[strategy].fn(groups, target, context)
    removed = sum(c * g.cost for c, g in zip(counts, groups, strict=True))
    assert removed <= target and all(c in g.allowed for c, g in zip(counts, groups, strict=True))
    finest = reduce(math.gcd, (g.cost for g in groups if g.cost), 0) or 1
    reachable = target - target % finest
    if removed < reachable:
        message = (f"allocation {strategy!r}: {target:,} parameters targeted, {removed:,} removed "
                   "(nearest achievable not exceeding, under min_per_layer / multiple / layout)")  # fmt: skip
        if exact or removed == 0:
            raise ValueError(message)
        logger.warning("sinv_prune: %s", message)
    result = Allocation(strategy, {(g.unit, g.layer): c for g, c in zip(groups, counts, strict=True)}, target, removed)
    result.details.update(context.details)
    result.seconds = time.perf_counter() - start
    return result


# -- knapsack on parameters ---------------------------------------------------------------


def knapsack(groups: Sequence[Group], curves: Sequence[Sequence[float]], target: int) -> list[int]:
    """One allowed count per group: the most parameters ``<= target``, then the least summed curve value.

    ``curves[i][j]``: the cost of group ``i`` losing ``groups[i].allowed[j]`` units.
    """
    unit = reduce(math.gcd, (k * g.cost for g in groups for k in g.allowed), 0) or 1
    cap = target // unit
    best = np.full(cap + 1, np.inf)
    best[0] = 0.0
    picks = []
    for g, curve in zip(groups, curves, strict=True):
        new = np.full(cap + 1, np.inf)
        pick = np.full(cap + 1, -1, dtype=np.int64)
        for j, k in enumerate(g.allowed):
            w = k * g.cost // unit
            if w > cap:
                break
            candidate = best[: cap + 1 - w] + float(curve[j])
            better = candidate < new[w:]
            new[w:][better] = candidate[better]
            pick[w:][better] = j
        best, _ = new, picks.append(pick)
    n = int(np.flatnonzero(np.isfinite(best)).max())
    chosen = []
    for g, pick in zip(reversed(groups), reversed(picks), strict=True):
        j = int(pick[n])
        chosen.append(g.allowed[j])
        n -= g.allowed[j] * g.cost // unit
    return chosen[::-1]


def standardized_curves(groups: Sequence[Group]) -> list[list[float]]:
    """Per group and allowed count: the summed standardised scores of the units it loses, times their cost."""
    curves = []
    for g in groups:
        z = standardize(g.scores)
        curves.append([sum(z[i] for i in g.pick(k, z)) * g.cost for k in g.allowed])
    return curves


@register("standardized")
def _standardized(groups: list[Group], target: int, context: Context) -> list[int]:
    return knapsack(groups, standardized_curves(groups), target)


# -- sensitivity --------------------------------------------------------------------------


@register("sensitivity", options=("trials", "batches"), needs_data=True)
def _sensitivity(groups: list[Group], target: int, context: Context) -> list[int]:
    model, batches = _needs_data(context, "sensitivity")
    trials = int(context.options.get("trials", 4))
    if trials < 1:
        raise ValueError(f"sensitivity: trials must be a positive integer, got {trials}")
    batches = batches[: int(context.options.get("batches", 4))]
    damage = block_damage(model, groups, batches, trials, quiet=context.quiet)
    curves = []
    for g in groups:
        known = sorted(damage[g.unit, g.layer].items())
        xs, ys = [k for k, _ in known], [v for _, v in known]
        curves.append([float(np.interp(k, xs, ys)) for k in g.allowed])
    context.details["sensitivity"] = {f"{u}:{layer}": d for (u, layer), d in damage.items()}
    return knapsack(groups, curves, target)


def block_damage(model: nn.Module, groups: Sequence[Group], batches: Sequence[Mapping], trials: int,
                 *, quiet: bool = False) -> dict[tuple[str, int], dict[int, float]]:  # fmt: skip
    """Per group, ``{units removed: relative squared error of the block's output}`` at 0 and ``trials`` cuts.

    Block by block on the unpruned model's own inputs to that block, through the layer-wise engine
    (:func:`~sinv_prune.surgery.layerwise.layer_by_layer`: hidden states on the host, the block alone
    on the compute device); the cut units are masked by gates, nothing is removed.
    """
    from sinv_prune.surgery.layerwise import layer_by_layer

    adapter = get_adapter(model)
    by_layer: dict[int, list[Group]] = {}
    for g in groups:
        by_layer.setdefault(g.layer, []).append(g)
    out: dict[tuple[str, int], dict[int, float]] = {}
    with torch.no_grad(), contextlib.ExitStack() as stack:
        gates = {name: stack.enter_context(get_unit(name).gates(model, requires_grad=False)) for name in _kinds(groups)}
        for layer in layer_by_layer(model, adapter, batches, quiet=quiet, desc="sensitivity"):
            clean = layer.run()  # on the host: the next block's inputs
            norm = sum(_energy(y, inp) for y, inp in zip(clean, layer.batches, strict=True))
            for g in by_layer.get(layer.index, []):
                out[g.unit, layer.index] = {0: 0.0}
                gate = gates[g.unit][layer.index]
                for k in _trial_counts(g.allowed, trials):
                    gate.fill_(1.0)
                    gate[g.pick(k)] = 0.0
                    err = [0.0]

                    def add(j: int, x: torch.Tensor, y: torch.Tensor, err=err, clean=clean, layer=layer) -> None:
                        err[0] += _energy(y - clean[j].to(y.device), layer.batches[j])

                    layer.run(add)
                    out[g.unit, layer.index][k] = err[0] / max(norm, 1e-30)
                gate.fill_(1.0)
            layer.outputs = clean
    return out


def _energy(x: torch.Tensor, inp) -> float:
    """Sum of squares over the non-padding tokens."""
    from sinv_prune.surgery.block_inputs import rows

    valid = None if inp.valid is None else inp.valid.to(x.device)
    return float(rows(x, valid).double().pow(2).sum())


def _trial_counts(allowed: list[int], trials: int) -> list[int]:
    """``trials`` allowed counts spread over ``allowed`` (the largest always among them)."""
    positive = allowed[1:]
    if not positive:
        return []
    picks = {positive[min(len(positive) - 1, math.ceil((i + 1) * len(positive) / trials) - 1)] for i in range(trials)}
    return sorted(picks)


def _needs_data(context: Context, name: str) -> tuple[nn.Module, list]:
    if context.model is None or not context.batches:
        raise ValueError(f"allocation {name!r} needs calibration batches (pass batches= or calibration=)")
    return context.model, list(context.batches)


# -- search -------------------------------------------------------------------------------


@register("search", options=("budget", "offspring", "batches", "tokens", "levels"), needs_data=True)
def _search(groups: list[Group], target: int, context: Context) -> list[int]:
    model, batches = _needs_data(context, "search")
    opts = context.options
    budget = int(opts.get("budget", 32))
    offspring = int(opts.get("offspring", 4))
    levels = int(opts.get("levels", 32))
    if budget < 1 or offspring < 1 or levels < 2:
        raise ValueError(f"search: budget, offspring must be >= 1 and levels >= 2, got {budget}, {offspring}, {levels}")
    batches = _truncate(batches[: int(opts.get("batches", 2))], opts.get("tokens", 256))
    seed_plan = knapsack(groups, standardized_curves(groups), target)
    steps = [_step(g, levels) for g in groups]
    allowed = [set(g.allowed) for g in groups]
    # Mutations move units between groups of the same kind and unit cost, so the parameters stay as they are.
    peers: dict[tuple[str, int, int], list[int]] = {}
    for i, g in enumerate(groups):
        peers.setdefault((g.unit, g.cost, steps[i]), []).append(i)
    movable = [p for p in peers.values() if len(p) > 1]
    rng = random.Random(context.seed)
    fitness = KLFitness(model, groups, batches)
    with fitness, bar(total=budget, desc="search (KL)", unit="plan", disable=context.quiet) as search:
        best, best_fit = list(seed_plan), fitness(seed_plan)
        seed_fit, history = best_fit, [best_fit]
        search.update(1)
        search.set_postfix(best=f"{best_fit:.5f}")
        used = 1
        while used < budget and movable:
            children = [_mutate(best, movable, steps, allowed, rng) for _ in range(min(offspring, budget - used))]
            for child in children:
                used += 1
                search.update(1)
                if child == best:
                    continue
                fit = fitness(child)
                if fit < best_fit:
                    best, best_fit = child, fit
                    search.set_postfix(best=f"{best_fit:.5f}")
            history.append(best_fit)
    context.details["search"] = {"seed_fitness": seed_fit, "best_fitness": best_fit, "evaluations": used,
                                 "budget": budget, "history": history}  # fmt: skip
    return best


def _step(g: Group, levels: int) -> int:
    """One search level of a group: the smallest allowed step at least ``1/levels`` of its width."""
    diffs = sorted({b - a for a, b in zip(g.allowed, g.allowed[1:], strict=False) if b > a})
    if not diffs:
        return 0
    base = diffs[0]
    return base * max(1, math.ceil(len(g.scores) / levels / base))


def _mutate(plan: list[int], movable, steps, allowed, rng: random.Random) -> list[int]:
    child = list(plan)
    for _ in range(rng.randint(1, 3)):
        peers = movable[rng.randrange(len(movable))]
        a, b = rng.sample(peers, 2)
        s = steps[a]
        if child[a] + s in allowed[a] and child[b] - s in allowed[b]:
            child[a] += s
            child[b] -= s
    return child


def _truncate(batches: list, tokens: int | None) -> list:
    if not tokens:
        return batches
    out = []
    for batch in batches:
        out.append({k: v[..., : int(tokens)] if isinstance(v, torch.Tensor) and v.dim() >= 2 else v
                    for k, v in batch.items()})  # fmt: skip
    return out


class KLFitness:
    """KL(unpruned || masked) per token on fixed batches; a plan is applied by gates, nothing is removed.

    A context manager: the gates (forward pre-hooks) and the eval mode hold inside the ``with`` block
    only, and are gone however it ends (an error while the references are computed included)::

        with KLFitness(model, groups, batches) as fitness:
            kl = fitness(plan)
    """

    def __init__(self, model: nn.Module, groups: Sequence[Group], batches: Sequence[Mapping]):
        self.model, self.groups, self.batches = model, list(groups), list(batches)
        self.gates: dict[str, list[torch.Tensor]] | None = None
        self.reference: list[torch.Tensor] = []
        self._stack: contextlib.ExitStack | None = None

    def __enter__(self) -> KLFitness:
        with contextlib.ExitStack() as stack:  # unwinds what was set up if a step below fails
            stack.callback(self.model.train, self.model.training)
            self.model.eval()
            self.gates = {
                name: stack.enter_context(get_unit(name).gates(self.model, requires_grad=False))
                for name in _kinds(self.groups)
            }
            with torch.no_grad():
                self.reference = [torch.log_softmax(self._logits(b).float(), -1) for b in self.batches]
            self._stack = stack.pop_all()
        return self

    def __exit__(self, *exc) -> None:
        stack, self._stack = self._stack, None
        self.gates, self.reference = None, []
        if stack is not None:
            stack.close()

    def _logits(self, batch: Mapping) -> torch.Tensor:
        device = next(self.model.parameters()).device
        feed = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items() if k != "labels"}
        return self.model(**feed, use_cache=False).logits

    def __call__(self, plan: Sequence[int]) -> float:
        if self._stack is None:
            raise RuntimeError("KLFitness measures inside its with block only")
        for g, k in zip(self.groups, plan, strict=True):
            gate = self.gates[g.unit][g.layer]
            gate.fill_(1.0)
            gate[g.pick(k)] = 0.0
        total, count = 0.0, 0
        with torch.no_grad():
            for ref, batch in zip(self.reference, self.batches, strict=True):
                logp = torch.log_softmax(self._logits(batch).float(), -1)
                kl = (ref.exp() * (ref - logp)).sum(-1)
                mask = batch.get("attention_mask")
                if mask is not None:
                    kl = kl[mask.to(kl.device).bool()]
                total += float(kl.sum())
                count += kl.numel()
        return total / max(count, 1)


def groups_for(
    model: nn.Module,
    unit: str,
    scores: Sequence[Sequence[float]],
    layers: Iterable[int],
    *,
    min_per_layer: int | None,
    multiple: int = 1,
    shape: str = "q_per_group",
    seed: int = 0,
) -> list[Group]:
    """The :class:`Group` s of one part over the current ``layers`` (scores: one row per current layer)."""
    kind = get_unit(unit)
    out = []
    for layer in layers:
        row = [float(x) for x in scores[layer]]
        allowed, layout = kind.allowed(model, layer, row, min_per_layer, multiple, shape)
        out.append(Group(unit, layer, row, kind.cost(model, layer), allowed, layout, shape, seed))
        if any(math.isnan(x) for x in row):
            raise ValueError(f"layer {layer}: NaN scores cannot be ranked")
    return out


def _kinds(groups: Sequence[Group]) -> list[str]:
    """The unit kinds among ``groups``, in order of appearance (the gates to open)."""
    return list(dict.fromkeys(g.unit for g in groups))

"""``shrink``: remove a share of a model's parameters by a joint search over whole layers, heads, MLP channels
and (mixture-of-experts models) routed experts.

1. One pass over the calibration text, one block at a time, measures what the search needs
   (:mod:`~sinv_prune.shrink.statistics`): per-layer statistics of the consumers (kept on the host in
   ``statistics_dtype``), OBS orders, block influence, REAP scores of MoE layers' experts.
2. Seeds: the uniform single-unit cuts (MLP channels only, or experts only on a MoE model; query heads / KV
   groups only; whole layers only, the least influential blocks) and their mixes with uniform MLP channels
   (experts) making up the rest.
3. A (1 + 1) evolutionary search from the best seed (:meth:`~sinv_prune.shrink.space.Space.mutate`): a
   child replaces the best only when its fitness (KL to the unpruned model on held-out calibration
   tokens, every candidate with OBS selection and a guarded refit in each layer) is lower, so the result
   is never worse by it than any seed. ``budget`` evaluations, deterministic per ``seed``; ``time_limit``
   stops it earlier (then the count depends on the machine; the result says so).
4. The best plan and the best seed are compared on the held-out perplexity (all held-out sequences);
   the better is built for real (:func:`~sinv_prune.prune`, then the refits written into the kept
   columns), so the returned model is never worse by that measure either.
"""

from __future__ import annotations

import copy
import math
import random
import time
from dataclasses import asdict, dataclass, field, replace

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from sinv_prune.arch import get_adapter
from sinv_prune.progress import bar
from sinv_prune.scoring import consumer_statistics
from sinv_prune.scoring.allocation import non_embedding_parameters
from sinv_prune.scoring.consumer_statistics import Statistics, consumer_modules
from sinv_prune.shrink.calibration import calibration_sequences
from sinv_prune.shrink.fitness import Candidates
from sinv_prune.shrink.space import Genome, Space, build_space
from sinv_prune.shrink.statistics import Picks, mlp_order
from sinv_prune.surgery.block_inputs import input_device, preserve_modes
from sinv_prune.surgery.offload import apply_offload, is_offloaded, onloaded
from sinv_prune.surgery.refit import consumer_weights, write_consumer
from sinv_prune.surgery.removal import count_parameters, prune
from sinv_prune.surgery.store import PLACES, Store
from sinv_prune.units.experts import EXPERTS
from sinv_prune.units.heads import HEADS
from sinv_prune.units.layers import LAYERS
from sinv_prune.units.mlp import MLP

#: The units shrink can search, in the order seeds are named by.
UNITS = (LAYERS.name, HEADS.name, MLP.name, EXPERTS.name)
#: The units that meet the target to a step (dense layers' MLP channels, MoE layers' experts).
FILL_UNITS = (MLP.name, EXPERTS.name)


def model_units(adapter) -> tuple[str, ...]:
    """The units a model has to search: layers and heads, MLP channels where it has dense layers, experts where
    it has MoE layers (a MoE layer's own channels are not searched)."""
    counts = [adapter.num_experts(i) for i in range(adapter.num_layers)]
    return (
        (LAYERS.name, HEADS.name) + ((MLP.name,) if not all(counts) else ()) + ((EXPERTS.name,) if any(counts) else ())
    )


@dataclass
class ShrinkResult:
    """What ``shrink`` chose and why: the plan, its shares, every seed's fitness, the search, the times."""

    plan: dict
    chosen: str  # "search" or the seed it kept
    target: int
    removed: int
    params_before: int
    params_after: int
    non_embedding: int
    shares: dict[str, int]
    widths: list[dict]
    fitness: float
    seeds: dict[str, dict]
    heldout_ppl: dict[str, float]
    evaluations: int
    budget: int
    stopped_by_time: bool
    history: list[float]
    seconds: dict[str, float]
    stock: bool
    seed: int
    settings: dict = field(default_factory=dict)
    record_stock: bool | None = None
    built: str = "per-layer refit"
    #: (unit, layer) of the built model's consumers whose refit was not finite: plainly pruned there instead
    fallbacks: list[tuple[str, int]] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)

    def __str__(self) -> str:
        ne = self.non_embedding
        lines = [
            f"shrink: removed {self.removed:,} of {ne:,} non-embedding parameters ({100 * self.removed / ne:.2f}%; "
            f"target {self.target:,}), {self.params_before:,} -> {self.params_after:,} parameters",
            "  share of the cut: "
            + ", ".join(f"{u} {100 * v / max(self.removed, 1):.0f}%" for u, v in self.shares.items()),  # fmt: skip
            f"  fitness (KL to the unpruned model, held-out tokens): {self.fitness:.5f}; kept: {self.chosen}; "
            f"{self.evaluations}/{self.budget} evaluations"
            + (" (stopped by the time limit)" if self.stopped_by_time else ""),  # fmt: skip
            "  held-out perplexity: " + ", ".join(f"{k} {v:.3f}" for k, v in self.heldout_ppl.items()),
            f"  {'candidate':<18} {'removed':>8} " + " ".join(f"{u:>7}" for u in self.shares) + f" {'KL':>9}",
        ]
        for name, s in self.seeds.items():
            tot = max(s["removed"], 1)
            lines.append(
                f"  {name:<18} {100 * s['removed'] / ne:7.2f}% "
                + " ".join(f"{100 * s['shares'][u] / tot:6.0f}%" for u in self.shares)
                + f" {s['fitness']:9.5f}"
            )
        kept = [w for w in self.widths if not w.get("dropped")]
        dropped = [w["layer"] for w in self.widths if w.get("dropped")]
        heads = sorted({(w["heads"], w["kv_heads"]) for w in kept})
        mlp = [w[MLP.name] for w in kept if MLP.name in w]
        experts = [w[EXPERTS.name] for w in kept if EXPERTS.name in w]
        text = f"  widths: layers dropped {dropped or 'none'}; heads (q, kv) {heads}"
        text += f"; MLP {min(mlp)}-{max(mlp)}" if mlp else ""
        text += f"; experts {min(experts)}-{max(experts)}" if experts else ""
        lines.append(text if kept else "  widths: none")
        if self.fallbacks:
            lines.append("  refit not finite, plainly pruned instead: "
                         + ", ".join(f"layer {layer} {unit}" for unit, layer in self.fallbacks))  # fmt: skip
        t = self.seconds
        lines.append("  time: " + ", ".join(f"{k} {v:.0f} s" for k, v in t.items()))
        return "\n".join(lines)


def shrink(
    model: nn.Module,
    params: float | None = None,
    *,
    to: int | None = None,
    calibration=None,
    tokenizer=None,
    sequences: int = 64,
    length: int = 512,
    stock: bool = False,
    units: tuple[str, ...] | None = None,
    multiple: int = 8,
    min_mlp: float = 0.25,
    budget: int = 48,
    time_limit: float | None = None,
    fitness_sequences: int = 4,
    fitness_tokens: int = 256,
    holdout: float = 0.125,
    seed: int = 0,
    quiet: bool = False,
    statistics: Statistics | None = None,
    refine: bool = False,
    statistics_dtype: str = "float32",
    keep_statistics: bool = False,
    offload: str = "none",
    offload_folder: str | None = None,
    store: str | None = None,
) -> ShrinkResult:
    """Remove ``params`` (a share, 0-1) of ``model``'s non-embedding parameters, or down to ``to`` parameters in
    all, in place, by the joint search of this module's docstring; returns a :class:`ShrinkResult`.

    ``calibration``: text (a file, a directory of files, a ``datasets`` id; ``tokenizer`` then needed) or
    batches / id tensors; ``sequences`` x ``length`` tokens are used, ``holdout`` of the sequences held out
    (refit guard, fitness on the first ``fitness_sequences`` of them cut to ``fitness_tokens``, perplexity
    check on all). ``stock``: only shapes the stock class (and vLLM) load: the same heads, MLP width and expert
    count in every kept layer. ``units``: which may go (default: every unit the model has, :func:`model_units`;
    the fill units are always among them: ``mlp`` on dense layers, meeting the target to a step of ``multiple``
    channels, ``experts`` on MoE layers, to one expert); ``min_mlp``: share of each layer's channels (and
    experts, at least ``num_experts_per_tok``) that stays. Bad arguments raise a
    one-line ``ValueError`` before anything changes. ``statistics``: the :class:`Statistics` of an earlier call
    on this same (unpruned) model and calibration, to skip the pass (``result.statistics`` holds it where that
    call had ``keep_statistics=True``; otherwise it is None and the statistics are freed on return).
    ``statistics_dtype``: ``"float32"`` (default) or ``"float64"``, the dtype the per-layer sums are kept in
    (on the host, one layer on the device at a time; ``scripts/check_statistics_dtype.py`` measures the
    difference).
    ``refine``: also build the chosen plan block by block (:func:`~sinv_prune.prune` with ``compensate="obs"``
    on every calibration sequence, after the blocks are dropped; ``target="residual"`` on pre-norm blocks, so
    each refit also makes up for the error of the blocks before it) and keep it where its held-out perplexity
    is lower (``result.built`` says which; it costs a full compensation pass and a copy of the model).
    ``offload``: ``none``, ``cpu`` or ``disk`` (``offload_folder``), applied first
    (:func:`~sinv_prune.surgery.offload.apply_offload`; a model already under accelerate's hooks keeps them):
    the statistics pass brings one block at a time to the device, candidates change consumers' forwards (not
    weights), and the build writes the cut and refitted weights back to the offload maps. Not with ``refine``.
    ``store``: where the per-layer statistics (and the build's rollback copies) wait, ``"cpu"`` (host memory)
    or ``"disk"`` (safetensors files in a temporary folder, one layer read back at a time), so the host memory
    beyond the model does not grow with depth (:mod:`sinv_prune.surgery.store`); default ``"disk"`` with
    ``offload="disk"``, else ``"cpu"``.
    """
    start = time.perf_counter()
    store = store if store is not None else ("disk" if offload == "disk" else "cpu")
    if store not in PLACES:
        raise ValueError(f"store must be one of {', '.join(map(repr, PLACES))}, got {store!r}")
    if refine and (offload != "none" or is_offloaded(model)):
        raise ValueError("refine builds a copy of the model; it cannot run on offloaded blocks (use offload 'none')")
    apply_offload(model, offload, folder=offload_folder)
    adapter = get_adapter(model)
    units = model_units(adapter) if units is None else tuple(units)
    _check(model, adapter, params, to, units, budget, holdout, fitness_sequences, min_mlp, multiple)
    dtype = consumer_statistics.statistics_dtype(statistics_dtype)
    before = count_parameters(model)
    non_emb = non_embedding_parameters(model)
    target = math.ceil(params * non_emb) if params is not None else before - int(to)
    if not 0 < target < non_emb:
        raise ValueError(f"--to {to:,}: the model has {before:,} parameters, {non_emb:,} outside the embeddings;"
                         " the target must remove some of those and not all")  # fmt: skip
    space = build_space(model, adapter, target, stock=stock, units=units, multiple=multiple, min_mlp=min_mlp)
    seqs = calibration_sequences(calibration, tokenizer, sequences=sequences, length=length)
    every = max(2, round(1 / holdout))
    heldout = [i % every == every - 1 for i in range(len(seqs))]
    heldout[-1] = heldout[-1] or not any(heldout)  # fewer sequences than 1/holdout: the last is held out
    held_seqs = [s for s, h in zip(seqs, heldout, strict=True) if h]
    seconds: dict[str, float] = {}
    t = time.perf_counter()
    orders: dict[int, list[list[int]]] = {}

    def on_layer(layer: int, fits: dict) -> None:  # the MLP's OBS order while its statistics are on the device
        s = space.layers[layer]
        if s.max_steps:
            weight = consumer_weights(adapter.mlp_out(layer), model)[0]  # read from its offload map where offloaded
            orders[layer] = mlp_order(s, fits[MLP.name, layer][0], weight)

    stats = statistics or Statistics(model, adapter, seqs, heldout, quiet=quiet, dtype=dtype, on_layer=on_layer,
                                     store=Store(store))  # fmt: skip
    if len(stats.influence) != adapter.num_layers:
        raise ValueError("statistics= come from another model (its layer count differs)")
    seconds["statistics"] = time.perf_counter() - t
    t = time.perf_counter()
    picks = Picks(stats, space, adapter, quiet=quiet, orders=orders)
    seconds["OBS orders"] = time.perf_counter() - t
    bypass = stats.bypass_order()
    rng = random.Random(seed)
    seeds = seed_genomes(space, bypass, rng)
    if not seeds:
        raise ValueError(f"no plan removes {target:,} parameters under these constraints (min_mlp {min_mlp})")
    chosen_seqs = held_seqs[:fitness_sequences]
    cut = min(fitness_tokens, *(s.numel() for s in chosen_seqs))
    fit_batch = torch.stack([s[:cut] for s in chosen_seqs])  # equal lengths: one batch
    t = time.perf_counter()
    found: dict[str, dict] = {}
    with Candidates(model, adapter, picks, [fit_batch]) as cand:
        for name, g in seeds.items():
            found[name] = {"fitness": cand.kl(g), "removed": space.removed(g), "shares": space.shares(g),
                           "genome": g}  # fmt: skip
        best_seed = min(found, key=lambda n: found[n]["fitness"])
        best, best_fit = found[best_seed]["genome"], found[best_seed]["fitness"]
        seen = {g.key() for g in seeds.values()}
        history, used, tries, timed_out = [best_fit], len(seeds), 0, False
        with bar(total=budget, desc="shrink search (KL)", unit="plan", disable=quiet) as progress:
            progress.update(min(used, budget))
            while used < budget:
                if time_limit is not None and time.perf_counter() - t > time_limit:
                    timed_out = True
                    break
                tries += 1
                if tries > 50 * budget:
                    break
                child = space.mutate(best, rng, bypass)
                if child is None or child.key() in seen:
                    continue
                seen.add(child.key())
                fit = cand.kl(child)
                used += 1
                progress.update(1)
                if fit < best_fit:
                    best, best_fit = child, fit
                    progress.set_postfix(best=f"{best_fit:.5f}")
                history.append(best_fit)
        seconds["search"] = time.perf_counter() - t
        t = time.perf_counter()
        ppl = {"unpruned": math.exp(_heldout_ce(cand, held_seqs, None))}
        ppl["search"] = math.exp(_heldout_ce(cand, held_seqs, best))
        chosen, genome = "search", best
        if best.key() != found[best_seed]["genome"].key():
            ppl[best_seed] = math.exp(_heldout_ce(cand, held_seqs, found[best_seed]["genome"]))
            if ppl[best_seed] < ppl["search"]:
                chosen, genome, best_fit = best_seed, found[best_seed]["genome"], found[best_seed]["fitness"]
        plan, kept_widths = to_plan(genome, picks), widths(genome, space, adapter)
        cuts = _cut_consumers(genome, picks)
        for key, removed in cuts.items():
            picks.refit(*key, removed)  # solved (and any fallback known) now
        fallbacks = sorted(key for key, removed in cuts.items() if picks.fell_back(*key, removed))
        cand.reset()
        blocks_run = round(cand.blocks_run / max(cand.blocks_total, 1), 3)  # share of the fitness forwards' blocks
    built = "per-layer refit"
    summary = None
    if refine:
        seconds["compare and build"] = time.perf_counter() - t
        t = time.perf_counter()
        sequential, summary = _sequential_build(model, plan, seqs, progress=not quiet)
        ppl["sequential"] = math.exp(_model_ce(sequential, held_seqs))
        seconds["sequential refit"] = time.perf_counter() - t
        t = time.perf_counter()
        if ppl["sequential"] < ppl[chosen]:
            _become(model, sequential)
            built = "sequential OBS refit"
            fallbacks = []  # the per-layer refits are not used
        else:
            summary = None
        del sequential
    if summary is None:
        modules = consumer_modules(adapter)
        summary = prune(model, plan, store=store)
        for layer in sorted({layer for _, layer in cuts}):  # one turn per block where it is offloaded
            keys = [key for key in cuts if key[1] == layer]
            with onloaded(modules[keys[0]], root=model):
                for key in keys:  # cached (or on disk) since the compare
                    write_consumer(modules[key], *picks.refit(*key, cuts[key])[1:])
    seconds["compare and build"] = seconds.get("compare and build", 0.0) + time.perf_counter() - t
    seconds["total"] = time.perf_counter() - start
    record = getattr(model.config, "sinv_prune", None)
    record_stock = record.get("stock_layout") if isinstance(record, dict) else None
    for s in found.values():
        s.pop("genome")
    result = ShrinkResult(
        plan=_json_plan(plan), chosen=chosen, target=target, removed=space.removed(genome), params_before=before,
        params_after=count_parameters(model), non_embedding=non_emb, shares=space.shares(genome),
        widths=kept_widths, fitness=best_fit, seeds=found, heldout_ppl=ppl, evaluations=used,
        budget=budget, stopped_by_time=timed_out, history=history, seconds={k: round(v, 2) for k, v in seconds.items()},
        stock=stock, seed=seed, record_stock=record_stock, built=built, fallbacks=fallbacks,
        settings={"units": list(units), "multiple": multiple, "min_mlp": min_mlp, "sequences": len(seqs),
                  "length": length, "holdout": holdout, "fitness_tokens": int(fit_batch.numel()),
                  "heldout_tokens": sum(s.numel() for s in held_seqs), "time_limit": time_limit,
                  "fitness_blocks_run": blocks_run, "statistics_dtype": str(stats.dtype).removeprefix("torch.")},
    )  # fmt: skip
    result.summary = summary  # the removal's PruneSummary (not fields: to_dict leaves them out)
    result.statistics = stats if keep_statistics else None
    if not keep_statistics and statistics is None:
        stats.close()
    return result


def _check(model, adapter, params, to, units, budget, holdout, fitness_sequences, min_mlp, multiple) -> None:
    if (params is None) == (to is None):
        raise ValueError("give exactly one of params= (a share of the non-embedding parameters) and to= (a size)")
    if params is not None and (isinstance(params, bool) or not isinstance(params, (int, float)) or not 0 < params < 1):
        raise ValueError(f"params must be a share between 0 and 1 of the non-embedding parameters, got {params!r}")
    if to is not None and (isinstance(to, bool) or not isinstance(to, int) or to <= 0):
        raise ValueError(f"to must be a positive parameter count, got {to!r}")
    unknown = sorted(set(units) - set(UNITS))
    fill = [u for u in model_units(adapter) if u in FILL_UNITS]
    if unknown or not set(fill) <= set(units):
        raise ValueError(f"units must include {' and '.join(map(repr, fill))} (they meet the target to a step) "
                         f"and be among {', '.join(UNITS)}, got {list(units)}")  # fmt: skip
    if EXPERTS.name in units and EXPERTS.name not in fill:
        raise ValueError(f"units: {model.config.model_type} has no mixture-of-experts layers: there are no experts")
    if budget < 1 or fitness_sequences < 1 or not 0 < holdout <= 0.5 or not 0 < min_mlp < 1 or multiple < 1:
        raise ValueError("budget and fitness_sequences must be >= 1, holdout in (0, 0.5], min_mlp in (0, 1), "
                         "multiple >= 1")  # fmt: skip
    from sinv_prune.surgery.removal import unprunable_reason

    refusal = unprunable_reason(model, adapter)
    if refusal:
        raise ValueError(f"cannot shrink this model: {refusal}")


def seed_genomes(space: Space, bypass: list[int], rng: random.Random) -> dict[str, Genome]:
    """The uniform single-unit cuts and their mixes with uniform fill (MLP channels, experts) making up the rest
    (only those that exist), each named by the units it takes from (``mlp``, ``heads+mlp``, ``layers+experts``).

    Every seed is repaired as the search's genomes are (:meth:`Space.repair`: uniform fill first, then, unless
    ``stock``, the steps past the target given back), so each removes the target to within one fill step;
    a head option or a count of whole blocks that alone overshoots by more is no seed (its mix with fill,
    one option or one block less, is)."""
    n = len(space.layers)
    stock_space = Space(space.layers, space.target, True, space.units, space.min_layers)
    uniform: list[Genome | None] = [stock_space.repair(space.empty(), rng)]
    if HEADS.name in space.units:
        options = space.layers[0].heads
        same = all(len(s.heads) == len(options) for s in space.layers)
        by_cost = sorted(range(1, len(options)), key=lambda j: options[j].removed) if same else []
        whole = [j for j in by_cost if sum(s.heads[j].removed for s in space.layers) >= space.target]
        if whole:
            uniform.append(replace(space.empty(), heads=(whole[0],) * n))
        under = [j for j in by_cost if j not in whole]
        if under:
            uniform.append(stock_space.repair(replace(space.empty(), heads=(under[-1],) * n), rng))
    if LAYERS.name in space.units:
        block = space.layers[0].block
        need = -(-space.target // block)
        if need <= n - space.min_layers:
            uniform.append(replace(space.empty(), dropped=tuple(sorted(bypass[:need]))))
        if need - 1 > 0:
            uniform.append(stock_space.repair(replace(space.empty(), dropped=tuple(sorted(bypass[: need - 1]))), rng))
    out: dict[str, Genome] = {}
    for g in uniform:
        g = None if g is None else space.repair(g, rng)
        if g is not None:
            out.setdefault("+".join(u for u, v in space.shares(g).items() if v) or "none", g)
    return out


def _cut_consumers(genome: Genome, picks: Picks) -> dict[tuple[str, int], list[int]]:
    """Per refitted consumer (``o_proj``, the dense down projection) the units ``genome`` removes from it."""
    out = {}
    for layer in range(len(genome.heads)):
        if layer in genome.dropped:
            continue
        heads, channels = picks.heads(layer, genome.heads[layer]), picks.channels(layer, genome.mlp[layer])
        if heads:
            out[HEADS.name, layer] = heads
        if channels:
            out[MLP.name, layer] = channels
    return out


def to_plan(genome: Genome, picks: Picks) -> dict:
    """The :func:`~sinv_prune.prune` plan of ``genome`` (current numbering)."""
    plan: dict = {}
    for (unit, layer), removed in _cut_consumers(genome, picks).items():
        plan.setdefault(unit, {})[layer] = removed
    experts = {layer: picks.experts(layer, genome.expert_cut(layer)) for layer in range(len(genome.heads))
               if layer not in genome.dropped and genome.expert_cut(layer)}  # fmt: skip
    if experts:
        plan[EXPERTS.name] = experts
    if genome.dropped:
        plan[LAYERS.name] = list(genome.dropped)
    return plan


def _json_plan(plan: dict) -> dict:
    return {k: ({str(i): v for i, v in sorted(e.items())} if isinstance(e, dict) else e) for k, e in plan.items()}


def widths(genome: Genome, space: Space, adapter) -> list[dict]:
    """Per layer what stays: heads, KV heads, MLP channels (or that the block is dropped)."""
    out = []
    for s in space.layers:
        if s.layer in genome.dropped:
            out.append({"layer": s.layer, "dropped": True})
            continue
        option = s.heads[genome.heads[s.layer]]
        row = {"layer": s.layer, "heads": option.heads, "kv_heads": option.groups}
        if s.expert:
            row[EXPERTS.name] = adapter.num_experts(s.layer) - genome.expert_cut(s.layer)
        else:
            row[MLP.name] = adapter.intermediate_size(s.layer) - genome.mlp[s.layer] * s.step
        out.append(row)
    return out


def _sequential_build(model: nn.Module, plan: dict, seqs: list[torch.Tensor], progress: bool = False):
    """A copy of ``model`` cut by ``plan``: blocks (and experts) dropped first, then heads and channels by
    sequential OBS compensation on ``seqs`` (its own held-out guard; each consumer fitted to the unpruned residual
    stream after it where the blocks are pre-norm, ``target="residual"``); the copy and the summary of the cut."""
    other = copy.deepcopy(model)
    dropped = list(plan.get(LAYERS.name, []))
    first_plan = {k: plan[k] for k in (LAYERS.name, EXPERTS.name) if k in plan}  # nothing to refit: cut first
    first = prune(other, first_plan) if first_plan else None
    shift = {layer: layer - sum(d < layer for d in dropped) for layer in range(get_adapter(model).num_layers)}
    rest = {u: {shift[layer]: v for layer, v in plan[u].items()} for u in (HEADS.name, MLP.name) if u in plan}
    batches = [{"input_ids": torch.stack(seqs[i : i + 4])} for i in range(0, len(seqs), 4)]
    target = "residual" if get_adapter(other).residual_norms() else "output"
    summary = prune(other, rest, calibration=batches, compensate="obs", target=target, progress=progress)
    if first is not None:
        summary.params_before = first.params_before
        summary.removed_layers, summary.removed_layers_original = first.removed_layers, first.removed_layers_original
        summary.experts = first.experts
    return other, summary


def _become(model: nn.Module, other: nn.Module) -> None:
    """Make ``model`` (in place, for its callers) the module ``other`` is: class, submodules, weights, config."""
    model.__class__ = type(other)
    for key in ("_parameters", "_buffers", "_modules"):
        model.__dict__[key] = other.__dict__[key]
    model.config = other.config


def _model_ce(model: nn.Module, seqs: list[torch.Tensor]) -> float:
    """Mean next-token cross-entropy of ``model`` over ``seqs``."""
    total, count = 0.0, 0
    with preserve_modes(model), torch.no_grad():
        model.eval()
        for ids in seqs:
            logits = model(input_ids=ids[None].to(input_device(model)), use_cache=False).logits[0, :-1].float()
            total += float(F.cross_entropy(logits, ids[1:].to(logits.device), reduction="sum"))
            count += ids.numel() - 1
    return total / max(count, 1)


def _heldout_ce(cand: Candidates, seqs: list[torch.Tensor], genome: Genome | None) -> float:
    """Mean next-token cross-entropy of the candidate (None: the unpruned model) over the held-out sequences."""
    cand.reset() if genome is None else cand.apply(genome)
    total, count = 0.0, 0
    with torch.no_grad():
        for ids in seqs:
            logits = cand.logits(ids[None])[0, :-1]
            total += float(F.cross_entropy(logits, ids[1:].to(logits.device), reduction="sum"))
            count += ids.numel() - 1
    return total / max(count, 1)
